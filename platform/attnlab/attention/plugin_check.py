"""``attnlab attention check``: does a plugin variant keep its contract? One verdict per check.

Owns the checks of a loaded plugin's variants (:func:`check_variant`), run on CPU on small random inputs, in
order: reference, causality (before any agreement: a disagreement that follows from a leak says so), fused vs
reference in float64, ALiBi, sharpening, bf16 autocast, memory (the fused form must grow as O(T), FlexAttention
calls counted as their CUDA kernel) and lowering (the compiled training graph through inductor as far as CPU
allows). Every difference is printed with the tolerance it is judged against.

It must never import Ray or model code. It runs the plugin's own code, so a plugin that hangs hangs it.

Details: docs/plugins.md#check (what each check passes on, what it prints).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from attnlab.attention import attend
from attnlab.attention.flex import cuda_code_path
from attnlab.attention.plugin import (LoadedPlugin, PluginSpec, Shape, build_params, flex_calls_as_kernels,
                                     prepare_state)
from attnlab.attention.variants import get_variant
from attnlab.errors import one_line

# The inputs of the float64 comparisons: odd length past the first three rows, two heads, two sequences.
B, H, T, D = 2, 2, 37, 16
TOLERANCE = 1e-8  # float64, relative to max(1, the largest reference value)
NORMALISED_TOLERANCE = 1e-9  # float64: |row sum - 1| of a normalised reference
NEGATIVE_TOLERANCE = 1e-12  # float64: the most negative weight of a normalised reference
CAUSALITY_TOLERANCE = 1e-12  # float64: the change of an earlier output when the future changes
ALIBI_MIN_CHANGE = 1e-9  # float64: the least change of the output that shows ctx.alibi reaches the reference
MEMORY_LENGTHS = (256, 1024)
MAX_MEMORY_EXPONENT = 1.3  # T^1 is linear, T^2 quadratic; between: constant overheads
LOWERING_LENGTH = 128


@dataclass(frozen=True)
class Verdict:
    variant: str
    check: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.variant}: {self.check}: {self.detail}"


def check_plugin(loaded: LoadedPlugin, names: list[str] | None = None,
                 say: Callable[[str], None] = print) -> bool:
    """Check every variant of ``loaded`` (or those in ``names``), printing one line per check; True if all pass."""
    ok = True
    for spec in loaded.specs:
        if names is None or spec.name in names:
            start = time.perf_counter()
            verdicts = check_variant(spec, say=lambda v: say(v.line()))
            passed = sum(v.ok for v in verdicts)
            say(f"{spec.name}: {passed} of {len(verdicts)} checks passed in {time.perf_counter() - start:.1f} s")
            ok &= passed == len(verdicts)
    return ok


def check_variant(spec: PluginSpec, say: Callable[[Verdict], None] = lambda v: None) -> list[Verdict]:
    """Every check of one variant, in order; ``say`` gets each verdict as it is reached."""
    verdicts = []
    leaks = False  # a form that leaks the future cannot agree with another: causality comes first, as the cause
    for check in CHECKS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the one-time fallback warnings are stated in the verdicts
                name, ok, detail = check(spec)
        except Exception as exc:  # noqa: BLE001 - a plugin's error is a failed check, in one line
            name, ok, detail = check.__name__.strip("_").replace("_", " "), False, one_line(exc)
        if check is _causality:
            leaks = not ok
        elif leaks and not ok and check in (_fused_vs_reference, _sharpening):
            detail = f"follows from the causality failure above (fix that first): {detail}"
        verdict = Verdict(spec.name, name, ok, detail)
        say(verdict)
        verdicts.append(verdict)
    return verdicts


def _diff(err: float, tolerance: float) -> str:
    """A difference and the tolerance it is judged against, as every verdict prints them."""
    return f"{err:.1e} (tolerance {tolerance:.1e})"


# --- inputs and runs -------------------------------------------------------------------------------------------

@dataclass
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    x: torch.Tensor
    params: torch.nn.Module | None
    shape: Shape

    def leaves(self) -> list[tuple[str, torch.Tensor]]:
        named = [("q", self.q), ("k", self.k), ("v", self.v), ("x", self.x)]
        if self.params is not None:
            named += [(f"param {n}", p) for n, p in self.params.named_parameters()]
        return named


def _inputs(spec: PluginSpec, dtype=torch.float64, seed: int = 0, length: int = T, batch: int = B,
            qkv_dtype=None) -> _Inputs:
    gen = torch.Generator().manual_seed(seed)
    shape = Shape(H * D, H, D)
    torch.manual_seed(seed)
    params = build_params(spec, shape)
    if params is not None:
        params = params.to(dtype)
    qkv = [torch.randn(batch, H, length, D, generator=gen, dtype=torch.float64).to(qkv_dtype or dtype)
           .requires_grad_() for _ in range(3)]
    x = torch.randn(batch, length, H * D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    return _Inputs(*qkv, x, params, shape)


def _out(spec: PluginSpec, impl: str, inp: _Inputs) -> torch.Tensor:
    state = prepare_state(spec, inp.x, inp.params, inp.shape)
    return attend(inp.q, inp.k, inp.v, spec, impl=impl, state=state)


def _grads(spec: PluginSpec, impl: str, inp: _Inputs, weight: torch.Tensor):
    out = _out(spec, impl, inp)
    names, leaves = zip(*inp.leaves())
    grads = torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True, materialize_grads=True)
    return out, dict(zip(names, grads))


def _where(name: str, index: tuple[int, ...]) -> str:
    if name in ("out", "q", "dq"):
        return f"b={index[0]} h={index[1]} row={index[2]}"
    if name in ("k", "v"):
        return f"b={index[0]} h={index[1]} key={index[2]}"
    if name == "x":
        return f"b={index[0]} token={index[1]}"
    return f"[{', '.join(map(str, index))}]" if index else ""


def _largest(a: torch.Tensor, b: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    diff = (a.double() - b.double()).abs()
    if diff.numel() == 0:
        return 0.0, ()
    flat = int(diff.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return float(diff.max()), index


def _fused_name(spec: PluginSpec) -> str:
    return spec.variant.fused_form or "none"


# --- the checks --------------------------------------------------------------------------------------------------

def _reference(spec: PluginSpec):
    from attnlab.attention import weights_for_rows

    inp = _inputs(spec)
    with torch.no_grad():
        w = weights_for_rows(inp.q, inp.k, spec, state=prepare_state(spec, inp.x, inp.params, inp.shape))
    if not torch.isfinite(w).all():
        return "reference", False, "the weights are not finite (NaN or inf)"
    detail = f"weights of shape {tuple(w.shape)}, finite"
    if spec.variant.normalised:
        negative = float((-w).clamp_min(0).max())
        off = float((w.sum(-1) - 1).abs().max())
        if negative > NEGATIVE_TOLERANCE or off > NORMALISED_TOLERANCE:
            return "reference", False, (f"declares normalised=True but a row has a weight of {-negative:.2g} "
                                        f"(tolerance {-NEGATIVE_TOLERANCE:.1e}) or sums to 1 {'+-'} "
                                        f"{_diff(off, NORMALISED_TOLERANCE)}: fix the reference or drop normalised")
        detail += f", non-negative, rows summing to 1 within {_diff(off, NORMALISED_TOLERANCE)} (normalised)"
    return "reference", True, detail


def _fused_vs_reference(spec: PluginSpec):
    name = "fused vs reference (float64)"
    if spec.variant.fused_form is None:
        return name, True, "reference only: nothing to compare (no fused form)"
    worst = {"forward": (-1.0, "", 1.0), "backward": (-1.0, "", 1.0)}
    for position in ("none", "alibi"):
        s = spec.replace(position_bias=position)
        weight = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        inp_ref, inp_fused = _inputs(s), _inputs(s)
        ref_out, ref_grads = _grads(s, "dense", inp_ref, weight)
        out, grads = _grads(s, "flex", inp_fused, weight)
        pairs = [("forward", "out", out, ref_out)] + [("backward", n, grads[n], ref_grads[n]) for n in ref_grads]
        for phase, label, got, want in pairs:
            err, index = _largest(got, want)
            scale = max(1.0, float(want.abs().max()) if want.numel() else 1.0)
            if err / scale > worst[phase][0] / worst[phase][2]:
                what = label if phase == "forward" else f"d{label}" if " " not in label else f"d({label})"
                where = f"{what}{' ' if label in ('out', 'q', 'k', 'v', 'x') else ''}{_where(label, index)}"
                worst[phase] = (err, f"{where} (position {position})", scale)
    ok = all(err <= TOLERANCE * scale for err, _, scale in worst.values())
    (f_err, f_where, f_scale), (b_err, b_where, b_scale) = worst["forward"], worst["backward"]
    detail = (f"{_fused_name(spec)}: forward max |diff| {_diff(f_err, TOLERANCE * f_scale)} at {f_where}; backward "
              f"max |diff| {_diff(b_err, TOLERANCE * b_scale)} at {b_where}")
    if not ok:
        detail = f"the fused form disagrees with its reference: {detail}"
    return name, ok, detail


def _alibi(spec: PluginSpec):
    inp = _inputs(spec)
    with torch.no_grad():
        plain = _out(spec.replace(position_bias="none"), "dense", inp)
        biased = _out(spec.replace(position_bias="alibi"), "dense", inp)
    change = float((plain - biased).abs().max())
    if change <= ALIBI_MIN_CHANGE:
        return "ALiBi", False, (f"the reference ignores ctx.alibi (output changes by up to {change:.1e}, at least "
                                f"{ALIBI_MIN_CHANGE:.1e} expected): a model with position alibi would train without "
                                "it; add ctx.alibi(rows.h, rows.i, rows.j) to the score (docs/plugins.md#alibi)")
    return "ALiBi", True, (f"ctx.alibi reaches the reference (output changes by up to {change:.2g}, at least "
                           f"{ALIBI_MIN_CHANGE:.1e} expected)")


def _sharpening(spec: PluginSpec):
    if not spec.variant.normalised:
        try:
            spec.replace(p=3.0)
        except ValueError:
            return "sharpening", True, "not normalised: a sharpening power p is refused in one line"
        return "sharpening", False, "not normalised, yet p=3 was accepted"
    sharpened = spec.replace(p=3.0)
    inp = _inputs(sharpened)
    weight = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out, grads = _grads(sharpened, "dense", inp, weight)
    if not (torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads.values())):
        return "sharpening", False, "p=3 on the reference gives non-finite outputs or gradients"
    reason = sharpened.unfusable_reason()
    if spec.variant.fused_form is None:
        return "sharpening", True, "p=3 on the reference rows: finite outputs and gradients; no fused form"
    if reason is not None:
        return "sharpening", True, ("p=3 on the reference rows: finite outputs and gradients; the fused form runs "
                                    f"the dense reference when sharpened, after a one-time warning ({reason})")
    # the two passes of flex.attend_log_scores over the variant's log_score, against the sharpened reference
    fused_out, fused_grads = _grads(sharpened, "flex", _inputs(sharpened), weight)
    pairs = [("out", fused_out, out)] + [(n, fused_grads[n], grads[n]) for n in grads]
    err, label, index, scale = _worst(pairs)
    what = label if label == "out" else f"d{label}" if " " not in label else f"d({label})"
    where = f"{what}{' ' if label in ('out', 'q', 'k', 'v', 'x') else ''}{_where(label, index)}"
    if err > TOLERANCE * scale:
        return "sharpening", False, (f"the fused two-pass form disagrees with the sharpened reference (p=3): max "
                                     f"|diff| {_diff(err, TOLERANCE * scale)} at {where}")
    return "sharpening", True, (f"p=3: finite outputs and gradients; the fused two-pass form equals the sharpened "
                                f"reference in float64 (forward and backward max |diff| "
                                f"{_diff(err, TOLERANCE * scale)} at {where})")


def _worst(pairs):
    """``(err, label, index, scale)`` of the largest scaled difference among ``(label, got, want)`` pairs."""
    worst = (-1.0, "", None, 1.0)
    for label, got, want in pairs:
        err, index = _largest(got, want)
        scale = max(1.0, float(want.abs().max()) if want.numel() else 1.0)
        if err / scale > worst[0] / worst[3]:
            worst = (err, label, index, scale)
    return worst


def _causality(spec: PluginSpec):
    t = T // 2
    forms = [("reference", "dense")] + ([("fused", "flex")] if spec.variant.fused_form else [])
    leaks = []
    for form, impl in forms:
        for position in ("none", "alibi"):
            s = spec.replace(position_bias=position)
            inp = _inputs(s)
            with torch.no_grad():
                before = _out(s, impl, inp)
                after = _out(s, impl, _future_changed(inp, t))
            leak, index = _largest(after[..., : t + 1, :], before[..., : t + 1, :])
            if leak > CAUSALITY_TOLERANCE:
                leaks.append(f"the {form} form leaks the future: output {_where('out', index)} changes by "
                             f"{_diff(leak, CAUSALITY_TOLERANCE)} when the tokens after row {t} change (position "
                             f"{position})")
                break
    if leaks:
        return "causality", False, "; ".join(leaks)
    return "causality", True, (f"changing the tokens after row {t} (x, q, k, v) changes no earlier output of "
                               f"{' or '.join(f for f, _ in forms)} by more than {CAUSALITY_TOLERANCE:.1e} (with and "
                               "without ALiBi)")


def _future_changed(inp: _Inputs, t: int) -> _Inputs:
    """The same inputs with every token after row ``t`` changed (x, q, k and v)."""
    gen = torch.Generator().manual_seed(7)
    changed = copy.copy(inp)
    for field, axis in (("q", -2), ("k", -2), ("v", -2), ("x", 1)):
        tensor = getattr(inp, field).detach().clone()
        future = tensor.narrow(axis, t + 1, tensor.shape[axis] - t - 1)
        future += torch.randn(future.shape, generator=gen, dtype=tensor.dtype)
        setattr(changed, field, tensor)
    return changed


def _bf16(spec: PluginSpec):
    forms = [("reference", "dense")] + ([("fused", "flex")] if spec.variant.fused_form else [])
    bad = []
    for form, impl in forms:
        inp = _inputs(spec, dtype=torch.float32, qkv_dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _out(spec, impl, inp)
        names, leaves = zip(*inp.leaves())
        grads = torch.autograd.grad(out.float().square().sum(), leaves, allow_unused=True, materialize_grads=True)
        if out.dtype != torch.bfloat16:
            bad.append(f"the {form} output is {out.dtype}, not v's bf16")
        if not torch.isfinite(out).all():
            bad.append(f"the {form} output is not finite")
        bad += [f"the {form} gradient of {n} is not finite" for n, g in zip(names, grads)
                if not torch.isfinite(g).all()]
    if bad:
        return "bf16 autocast", False, "; ".join(bad)
    return "bf16 autocast", True, f"finite outputs and gradients ({' and '.join(f for f, _ in forms)})"


def _peak_bytes(spec: PluginSpec, impl: str, length: int) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    inp = _inputs(spec, dtype=torch.float32, length=length, batch=1)
    tracker = MemTracker()
    stand_in = flex_calls_as_kernels() if impl == "flex" else contextlib.nullcontext()
    with stand_in, tracker:
        out = _out(spec, impl, inp)
        out.square().sum().backward()
        del out
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def _memory(spec: PluginSpec):
    t1, t2 = MEMORY_LENGTHS
    impl = "flex" if spec.variant.fused_form else "dense"
    p1, p2 = _peak_bytes(spec, impl, t1), _peak_bytes(spec, impl, t2)
    exponent = math.log(max(p2, 1) / max(p1, 1)) / math.log(t2 / t1)
    figures = f"peak {p1 / 2**20:.2f} MiB at T={t1}, {p2 / 2**20:.2f} MiB at T={t2}: grows as T^{exponent:.2f}"
    if impl == "dense":
        return "memory", True, (f"reference only: training keeps O(T^2) per layer for the backward ({figures}); "
                                "without gradients (evaluation) the platform runs it in row chunks, O(T x chunk)")
    if exponent > MAX_MEMORY_EXPONENT:
        return "memory", False, (f"the fused form's memory is not O(T): {figures} (a tensor of T x T somewhere in "
                                 "prepare or the fused form?)")
    kernel = " (FlexAttention counted as its CUDA kernel)" if spec.variant.log_score is not None else ""
    return "memory", True, f"fused form O(T): {figures}{kernel}"


def _lowering(spec: PluginSpec):
    from attnlab.attention.inductor_proxy import lowered_training_graph

    impl = "flex" if spec.variant.fused_form else "dense"
    inp = _inputs(spec, dtype=torch.float32, length=LOWERING_LENGTH)
    params, shape = inp.params, inp.shape

    def step(q, k, v, x):
        return attend(q, k, v, spec, impl=impl, state=prepare_state(spec, x, params, shape))

    try:
        graphs, stops = lowered_training_graph(step, (inp.q, inp.k, inp.v, inp.x))
    except Exception as exc:  # noqa: BLE001 - inductor's failures come in many types
        return "lowering", False, _lowering_failure(spec, exc)
    calls = stops.count("fw")
    if spec.variant.log_score is not None:
        if calls < 1 or stops.count("bw") != calls:
            return "lowering", False, f"expected FlexAttention's forward and backward lowerings, saw {stops}"
        return "lowering", True, (f"compiled training graph ({', '.join(graphs)}) through inductor up to the GPU: "
                                  f"{calls} FlexAttention call(s), forward and backward")
    what = "the fused function's" if impl == "flex" else "reference only: the dense reference's"
    return "lowering", True, (f"{what} compiled training graph ({', '.join(graphs)}) lowered through inductor "
                              "(CPU, up to code generation; no FlexAttention call)")


# In this order: causality before any agreement (a form that leaks the future cannot agree with another).
CHECKS = (_reference, _causality, _fused_vs_reference, _alibi, _sharpening, _bf16, _memory, _lowering)
# Where docs/plugins.md gives the fix of a lowering failure: a state tensor read twice in log_score, anything else.
READ_TWICE_DOC = "docs/plugins.md#a-state-tensor-read-twice"
LOWERING_DOC = "docs/plugins.md#check"


def _lowering_failure(spec: PluginSpec, exc: BaseException) -> str:
    """One line: inductor's own cause in full (its first paragraph, not the wrapper's text or the lowered arguments),
    the state tensors ``log_score`` reads more than once when that is the cause, and the doc section with the fix."""
    cause = exc
    while (cause.__cause__ or cause.__context__) is not None:
        cause = cause.__cause__ or cause.__context__
    paragraph = " ".join(str(cause).strip().split("\n\n")[0].split())
    if paragraph.endswith(":"):  # it introduces the example torch gives after it: the sentence ends here
        paragraph = paragraph[:-1].removesuffix(" like").rstrip(" .,") + "."
    text = f"{type(cause).__name__}: {paragraph}"
    if "multiple indexing operations on the same tensor" not in paragraph:
        return f"inductor could not lower the compiled training graph: {text} ({LOWERING_DOC})"
    try:
        names = _read_twice(spec)
    except Exception:  # noqa: BLE001 - naming the tensor is a courtesy: the cause above is the verdict
        names = []
    which = (f"log_score reads {' and '.join(f'ctx.state[{n!r}]' for n in names)} at more than one index"
             if names else "log_score reads a state tensor that takes gradients at more than one index")
    return (f"inductor could not lower FlexAttention's backward: {which}; torch says: {text} Fix: give each read its "
            "own tensor from prepare (a copy, or a detached one where its gradient there is zero), see "
            f"{READ_TWICE_DOC}")


def _read_twice(spec: PluginSpec) -> list[str]:
    """The names of ``ctx.state`` tensors taking gradients that ``log_score`` indexes more than once (one call, on
    index tensors, counted by a torch function mode)."""
    from torch.overrides import TorchFunctionMode

    from attnlab.attention.plugin import Context

    inp = _inputs(spec)
    state = prepare_state(spec, inp.x, inp.params, inp.shape)
    tensors = {id(t): name for name, t in state.prepared.items() if t.requires_grad}
    reads = dict.fromkeys(tensors.values(), 0)

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.__getitem__ and args and id(args[0]) in tensors:
                reads[tensors[id(args[0])]] += 1
            return func(*args, **(kwargs or {}))

    ctx = Context(inp.shape, T, dict(state.prepared), None, spec.position_bias, torch.float64)
    index = [torch.tensor(i) for i in (0, 0, 5, 2)]
    with Reads(), torch.no_grad():
        spec.variant.log_score(torch.tensor(0.5, dtype=torch.float64), *index, ctx)
    return [name for name, count in reads.items() if count > 1]


def checked_names(loaded: LoadedPlugin, name: str | None) -> list[str]:
    """The variants ``attention check`` looks at: ``name`` (from ``FILE:NAME``) or every variant of the plugin."""
    if name is None:
        return list(loaded.names)
    get_variant(name)
    return [name]
