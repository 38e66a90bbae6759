"""b. Fused vs reference: every registered variant (one per distinct spec, sharpened softmax too) and each shipped
plugin's variants, their fused form on this device (on CUDA FlexAttention's compiled kernels) against the dense
reference in float64 on the same inputs, forward and backward (dq, dk, dv; for a plugin also the layer input x),
in float32 and bf16, at each length.

The error is the largest |fused - reference| over the largest |reference| of that tensor; the tolerances are those
of the CUDA tests (``tests/test_attention_flex.py``): 1e-3 in float32, 5e-2 in bf16. A variant whose fused form
subtracts two calls (a sign-changing ``f`` split into ``f+`` and ``f-``, or ``recentre_l1``) is held to them in
float32 only: in bf16 its parts can cancel, and its figure is reported, not judged; so is a plugin's dx in bf16 (the
gradient of what ``prepare`` computes is a difference of row and column sums of dS). A variant without a fused form
(a reference-only plugin) runs its reference in the dtype on this device against float64.

Some errors are the dtype's, not the kernel's. ReLU's derivative jumps at 0, so a score that float32 rounds to the
other side of 0 than float64 does takes the other derivative, and a whole ``dP`` term enters or leaves that key's
gradient: at 4,096 tokens, 2 of 33.6M causal scores flip, and ``relu_shen``'s dq and dk are 1.4e-3 and 1.5e-3 off
*in the dense float32 form* (on CPU; 0 flips and 6e-7 at 1,024). So a fused tensor over the tolerance is held to
the dense form in the same dtype on the same inputs: within :data:`FLOOR_FACTOR` times that form's error it is at
the dtype's floor (PASS, reported as such); beyond it, or for a reference-only case (whose form is the dense one),
it fails.

Each case compiles FlexAttention's forward and backward (about 15 s on a cold H200), so the cases run in parallel
worker processes (:mod:`gpucheck.background`), dealt out in the order of :func:`planned`: the first length in float32
and bf16, then the longer lengths bf16 first, the headline variants first within each; a budget that runs out skips
the tail. Dynamo's caches are reset between variants (one compiled FlexAttention instance serves a process, and its
recompile limit would otherwise turn later cases into the unfused path).
"""

from __future__ import annotations

import copy
import time
import warnings
from pathlib import Path

import torch

from gpucheck.harness import FAIL, PASS, ROOT, Context, Outcome, one_line, reset_dynamo, say
from gpucheck.background import worker_count

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
FLOOR_FACTOR = 4.0  # a fused error within 4x the dense form's own error in that dtype is the dtype's floor
HEADLINE = ("lssar", "lssa", "softmax")
PLUGIN_DIR = ROOT / "plugins"


def judge(held: dict[str, float], tolerance: float, floor: dict[str, float] | None) -> tuple[list[str], list[str]]:
    """``(off, at_floor)``: the tensors of ``held`` over ``tolerance`` that fail, and those over it that are within
    :data:`FLOOR_FACTOR` times the dense same-dtype form's error ``floor`` (None: not measured, none is)."""
    over = [n for n, e in held.items() if e > tolerance]
    at_floor = [n for n in over if floor is not None and held[n] <= FLOOR_FACTOR * floor[n]]
    return [n for n in over if n not in at_floor], at_floor


def cases() -> list[tuple[str, float | None]]:
    """``(name, p)``: one per distinct registered spec (aliases dropped), sharpened softmax, then every variant of
    each shipped plugin (``plugins/*.py``, loaded here); the headline variants first."""
    from attnlab.attention import AttentionSpec, get_variant, load_plugin, variant_names

    seen, built_in = set(), []
    for name in variant_names():
        spec = get_variant(name)
        if not isinstance(spec, AttentionSpec):
            continue  # a plugin's variant loaded earlier in this process: listed with its plugin below
        key = spec.replace(name="", source="")
        if key not in seen:
            seen.add(key)
            built_in.append((spec.name, spec.p))  # the variant as registered: LSSAR with its p = 15
    built_in = sorted(built_in, key=lambda c: (c[0] not in HEADLINE, HEADLINE.index(c[0]) if c[0] in HEADLINE
                                               else 0, c[0]))
    built_in.insert(3, ("softmax", 15.0))
    plugins = []
    for path in sorted(Path(PLUGIN_DIR).glob("*.py")):
        plugins += [(name, None) for name in load_plugin(str(path)).names]
    return built_in + plugins


def _inputs(spec, T: int, heads: int, head_dim: int, device: torch.device, seed: int):
    """q, k, v ``(1, H, T, D)`` and, for a plugin, the layer input x ``(1, T, H*D)`` and its parameters: float64."""
    from attnlab.attention import PluginSpec
    from attnlab.attention.plugin import Shape, build_params

    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(1, heads, T, head_dim, generator=gen, dtype=torch.float64) for _ in range(3))
    x = params = shape = None
    if isinstance(spec, PluginSpec):
        shape = Shape(heads * head_dim, heads, head_dim)
        torch.manual_seed(seed)
        params = build_params(spec, shape)
        x = torch.randn(1, T, heads * head_dim, generator=gen, dtype=torch.float64)
    gains = None
    if getattr(spec, "learned_qk_gain", False):  # QK-norm's learned gains, (H, D) each, away from their init of 1
        gains = tuple(1 + 0.2 * torch.randn(heads, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (to(q), to(k), to(v), to(x), None if params is None else params.to(device), shape,
            None if gains is None else tuple(map(to, gains)))


def _run(spec, impl: str, dtype: torch.dtype, inputs, weight: torch.Tensor, rounding: torch.dtype):
    """The output and the gradients of ``sum(out * weight)`` with respect to q, k, v (and x), on q, k, v rounded
    to ``rounding`` and computed in ``dtype``."""
    from attnlab.attention import PluginSpec, attend
    from attnlab.attention.plugin import prepare_state

    q, k, v, x, params, shape, gains = inputs
    # The reference (float64) reads the same values: q, k, v rounded to the fused run's dtype first.
    leaves = [t.detach().to(rounding).to(dtype).requires_grad_() for t in (q, k, v)]
    names = ["dq", "dk", "dv"]
    state = None
    if isinstance(spec, PluginSpec):
        # The layer input, the parameters and prepare run in float32 (float64 for the reference), without autocast:
        # the part judges the attention's forms on the same prepared tensors.
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        xs = x.detach().float().to(wide).requires_grad_()
        p = None if params is None else copy.deepcopy(params).float().to(wide)
        leaves.append(xs)
        names.append("dx")
        state = prepare_state(spec, xs, p, shape)
    qk_gain = None if gains is None else tuple(g.to(dtype if dtype == torch.float64 else torch.float32)
                                               for g in gains)
    out = attend(*leaves[:3], spec, impl=impl, state=state, qk_gain=qk_gain)
    grads = torch.autograd.grad((out.double() * weight).sum(), leaves, allow_unused=True, materialize_grads=True)
    return {"out": out.detach(), **dict(zip(names, grads))}


def _relative(got: dict, want: dict) -> dict[str, float]:
    return {name: float((got[name].double() - want[name]).abs().max() / want[name].abs().max().clamp_min(1e-30))
            for name in want}


def _subtracts(spec) -> bool:
    """Whether the fused form subtracts two FlexAttention calls (bf16 cancellation: reported, not judged)."""
    from attnlab.attention.flex import parts_of

    return hasattr(spec, "phi") and (len(parts_of(spec)) > 1 or spec.post == "recentre_l1")


def planned(sizes) -> list[tuple[int, str, str, float | None]]:
    """Every case ``(T, dtype, name, p)``, in the order they are dealt out."""
    first, *rest = sizes.agree_lengths
    order = [(first, "float32"), (first, "bfloat16")] + [(T, dt) for T in rest for dt in ("bfloat16", "float32")]
    return [(T, dt, name, p) for T, dt in order for name, p in cases()]


def label_of(name: str, p) -> str:
    from attnlab.attention import get_variant

    registered = getattr(get_variant(name), "p", None)
    return name if p == registered else f"{name} p={p:g}" if p is not None else f"{name} p=none"


def check_case(sizes, device: torch.device, T: int, dtype_name: str, name: str, p) -> dict:
    """One case: the fused form in ``dtype_name`` against the float64 reference, forward and backward."""
    from attnlab.attention import get_variant
    from attnlab.attention.flex import unfusable_reason

    dtype = getattr(torch, dtype_name)
    row = {"variant": label_of(name, p), "name": name, "p": p, "T": T, "dtype": dtype_name}
    t0 = time.perf_counter()
    problem = None
    try:
        spec = get_variant(name, p=p)
        reason = unfusable_reason(spec)
        impl = "dense" if reason else "flex"
        inputs = _inputs(spec, T, sizes.agree_heads, sizes.head_dim, device, seed=T)
        weight = torch.randn(1, sizes.agree_heads, T, sizes.head_dim, device=device, dtype=torch.float64,
                             generator=torch.Generator(device=device).manual_seed(1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _run(spec, impl, dtype, inputs, weight, rounding=dtype)
        fell_back = [w for w in caught if "no fused form" in str(w.message)]
        want = _run(spec, "dense", torch.float64, inputs, weight, rounding=dtype)
        errors = _relative(got, want)
        finite = all(bool(torch.isfinite(t).all()) for t in got.values())
        judged = not (dtype == torch.bfloat16 and _subtracts(spec))
        # In bf16 a plugin's dx (through prepare) is reported, not judged: prepare's tensors enter every score of
        # a row and of a column, so their gradient is a row sum minus a column sum of dS, sums that cancel (a
        # softmax row's dS sums to zero), and bf16's rounding of dS is left (FoX, H200: 6-9 % of max |dx|).
        unjudged = [n for n in errors if not judged or (dtype == torch.bfloat16 and n == "dx")]
        held = {n: e for n, e in errors.items() if n not in unjudged}
        floor = None
        if not reason and any(e > TOLERANCE[dtype] for e in held.values()):
            # over the tolerance: how far off is the dense form itself in this dtype (module docstring)?
            floor = _relative(_run(spec, "dense", dtype, inputs, weight, rounding=dtype), want)
        off, at_floor = judge(held, TOLERANCE[dtype], floor)
        err = max((e for n, e in held.items() if n not in at_floor), default=0.0)
        row.update(form="reference only" if reason else "fused", errors=errors, error=err, finite=finite,
                   judged=judged, unjudged=unjudged, tolerance=TOLERANCE[dtype], at_floor=at_floor,
                   **({"dense_errors": floor} if floor is not None else {}))
        if not finite:
            problem = "not finite"
        elif fell_back and not reason:
            problem = "fell back to the dense reference"
        elif off:
            which = max(off, key=held.get)
            problem = (f"{which} off by {held[which]:.1e} (tolerance {TOLERANCE[dtype]:g}"
                       + (f"; the dense {dtype_name} form: {floor[which]:.1e}" if floor is not None else "") + ")")
    except Exception as exc:  # noqa: BLE001 - one case that breaks is one failure; the others run
        problem = one_line(exc, 200)
    if problem:
        row["failure"] = problem
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def run_cases(sizes, device: torch.device, assigned: list, report, expired=lambda: False) -> None:
    """Check ``assigned`` cases one after the other, handing each row to ``report`` as it ends; none starts once
    ``expired()``."""
    cases()  # loads the shipped plugins in this process: their variants are among the cases
    current = None
    for T, dtype_name, name, p in assigned:
        if expired():
            break
        if current != (name, p):
            reset_dynamo()  # a fresh recompile count for this variant's FlexAttention specialisations
            current = (name, p)
        report(check_case(sizes, device, T, dtype_name, name, p))
    reset_dynamo()


def start_workers(background, sizes) -> int:
    """Deal every case out to the agreement workers; the number of workers."""
    plan = planned(sizes)
    n = worker_count(len(plan))
    for w in range(n):
        background.start(f"agreement-{w}", "agreement", [list(c) for c in plan[w::n]])
    return n


def _line(row: dict) -> str:
    if "skipped" in row:
        return f"{row['variant']:>28} T={row['T']:<6} {row['dtype']:<9} skipped ({row['skipped']})"
    if "failure" in row:
        return f"{row['variant']:>28} T={row['T']:<6} {row['dtype']:<9} FAIL {row['failure']}"
    unjudged = row.get("unjudged") or []
    note = (" (not judged)" if not row["judged"] else
            "; " + ", ".join(f"{n} {row['errors'][n]:.1e} not judged" for n in unjudged) if unjudged else "")
    note += "".join(f"; {n} {row['errors'][n]:.1e} at {row['dtype']}'s floor (dense {row['dense_errors'][n]:.1e})"
                    for n in row.get("at_floor") or [])
    return (f"{row['variant']:>28} T={row['T']:<6} {row['dtype']:<9} {row['error']:.1e}{note}"
            f"{' reference only' if row['form'] != 'fused' else ''} ({row['seconds']:.0f} s)")


def agreement(ctx: Context) -> Outcome:
    sizes, device = ctx.sizes, ctx.device
    plan = planned(sizes)
    all_cases = cases()
    say(f"{len(all_cases)} variants ({', '.join(label_of(n, p) for n, p in all_cases)}) x 2 dtypes x T = "
        f"{', '.join(map(str, sizes.agree_lengths))}; B=1, H={sizes.agree_heads}, d={sizes.head_dim}; error = "
        "max |fused - float64 reference| / max |reference|")
    background = ctx.background
    workers = background.keys("agreement-") if background is not None else []
    got: dict[tuple, dict] = {}
    broken: list[str] = []
    if workers:
        say(f"{len(workers)} worker processes, started with the check")
        deadline = ctx.clock.part_start + ctx.clock.part_budget
        finished = background.wait(workers, min(deadline, ctx.clock.start + ctx.clock.total_s))
        background.stop(workers)
        for key in workers:
            for row in background.results(key):
                if "done" in row:
                    if not row["done"]:
                        broken.append(f"worker {key}: {row['error']}")
                        say(f"{key} failed: {row['error']}\n{background.log_tail(key)}")
                    continue
                got[(row["T"], row["dtype"], row["name"], row["p"])] = row
        if not finished and not got:
            say(background.log_tail(workers[0]))
    else:  # in this process, one case after another (--no-workers)
        def report(row):
            got[(row["T"], row["dtype"], row["name"], row["p"])] = row
            say(_line(row))

        run_cases(sizes, device, plan, report, expired=ctx.clock.expired)
    rows = []
    for T, dtype_name, name, p in plan:
        row = got.get((T, dtype_name, name, p))
        if row is None:
            row = {"variant": label_of(name, p), "name": name, "p": p, "T": T, "dtype": dtype_name,
                   "skipped": "time budget"}
        elif workers:
            say(_line(row))
        rows.append(row)
    failures = broken + [f"{r['variant']} T={r['T']} {r['dtype']}: {r['failure']}" for r in rows if "failure" in r]
    worst = {dt: max([r["error"] for r in rows if r["dtype"] == dt and r.get("judged") and r.get("finite")],
                     default=0.0) for dt in ("float32", "bfloat16")}
    done = [r for r in rows if "skipped" not in r]
    skipped = len(rows) - len(done)
    floored = [r for r in done if r.get("at_floor")]
    data = {"cases": rows, "variants": len(all_cases), "checked": len(done), "skipped": skipped, "worst": worst,
            "at_floor": len(floored),
            "workers": len(workers), "compile_s": round(sum(r.get("seconds", 0) for r in done), 1)}
    figures = (f"{len(done)}/{len(rows)} cases ({len(all_cases)} variants x 2 dtypes x "
               f"{len(sizes.agree_lengths)} lengths{f', {len(workers)} workers' if workers else ''}); worst error "
               f"float32 {worst['float32']:.1e} (tol 1e-3), bf16 {worst['bfloat16']:.1e} (tol 5e-2)"
               + (f"; {len(floored)} at their dtype's floor ("
                  + ", ".join(f"{r['variant']} T={r['T']} {r['dtype']}" for r in floored[:3]) + ")" if floored else "")
               + (f"; {skipped} skipped for time" if skipped else ""))
    if failures:
        return Outcome(FAIL, f"{len(failures)} case(s) failed: {'; '.join(failures[:3])} ({figures})", data)
    return Outcome(PASS, figures, data)
