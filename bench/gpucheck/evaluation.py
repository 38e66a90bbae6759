"""Evaluation on the GPU.

- :func:`bench_eval`: the full run's ``eval`` part: evaluation tokens/s at 1x and 16x the training length for
  softmax, LSSA and LSSAR (``model.token_stats`` under no_grad and the run's autocast, the blocks compiled as
  evaluation compiles them), with the measured peak beside the memory plan's estimate.
- :func:`evaluation`: the quick check's part e: an LSSAR model scored by the evaluation's own function
  (:func:`attnlab.evaluate.measure.score_windows`) at 1x..16x its training length with a ``p_eval`` sweep: the
  graphs the compiler built (at most one per length and sharpening mode), finite losses, and the measured peak
  against the memory plan's estimate at each length.
"""

from __future__ import annotations

import math
import time

import torch

from gpucheck.harness import (FAIL, PASS, Clock, Context, Outcome, autocast, fmt, free_memory, is_oom, one_line,
                              reset_dynamo, say, sync, wait_for_warmers)
from gpucheck.sizes import (VARIANTS, Sizes, eval_batch, eval_estimate, gib, model_config, peak_vs_estimate,
                            precision_label)


def bench_eval(sizes: Sizes, device: torch.device, clock: Clock, compile_backend: str | None) -> list[dict]:
    from attnlab.model import GPT, compile_model

    dtype = getattr(torch, sizes.dtype)
    say(f"{sizes.preset} (untrained), token_stats under no_grad, {precision_label(sizes)}, NTK RoPE, "
        f"{'compiled (' + compile_backend + ')' if compile_backend else 'eager'}, "
        f"{sizes.eval_calls} timed calls after the first\n")
    say("| variant | multiple | T | batch | tokens/s | first call s (compile) | peak GiB | estimate GiB | "
        "peak / estimate |")
    say("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name, p in VARIANTS:
        torch.manual_seed(0)
        model = GPT(model_config(sizes, name, p)).to(device).eval()
        if compile_backend:
            compile_model(model, True, backend=compile_backend)
        for mult in sizes.eval_multiples:
            T = mult * sizes.train_len
            B = eval_batch(sizes, mult)
            row = {"variant": name, "p": p, "multiple": mult, "T": T, "batch": B,
                   "estimate_gib": gib(eval_estimate(sizes, model.cfg, T, B).tensor_bytes), "peak_gib": None}
            if clock.expired():
                row["skipped"] = "time budget"
                say(f"| {name} | {mult}x | {T} | {B} | skipped (time budget) | | | | |")
                rows.append(row)
                continue
            try:
                idx = torch.randint(0, model.cfg.vocab_size, (B, T + 1), device=device)

                def call(model=model):
                    with torch.no_grad(), autocast(device, dtype):
                        return model.token_stats(idx[:, :-1], idx[:, 1:], rope_scaling="ntk")

                t0 = time.perf_counter()
                loss, _ = call()
                sync(device)
                row["first_call_s"] = time.perf_counter() - t0
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                row["finite"] = bool(torch.isfinite(loss).all())
                t0 = time.perf_counter()
                for _ in range(sizes.eval_calls):
                    call()
                sync(device)
                row["tokens_per_s"] = B * T * sizes.eval_calls / (time.perf_counter() - t0)
                if device.type == "cuda":
                    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                row["peak_vs_estimate"] = peak_vs_estimate(row["peak_gib"], row["estimate_gib"])
                say(f"| {name}{'' if p is None else f' p={p:g}'} | {mult}x | {T} | {B} | "
                    f"{row['tokens_per_s']:,.0f} | {row['first_call_s']:.1f} | {fmt(row['peak_gib'])} | "
                    f"{fmt(row['estimate_gib'])} | {fmt(row['peak_vs_estimate'])} |")
            except Exception as exc:  # noqa: BLE001
                row["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                say(f"| {name} | {mult}x | {T} | {B} | {row['error']} | | | | |")
            rows.append(row)
            free_memory(device)
        del model
        reset_dynamo()
        free_memory(device)
    return rows




# --- the quick check's part e -------------------------------------------------------------------------------------

def counting_backend(backend: str | None, counter: list[int]):
    """A torch.compile backend that counts the graphs it is handed: inductor's code (``inductor``) or none
    (``eager``: the captured graph runs as it is, for the CPU smoke run)."""
    def compile_graph(gm, example_inputs):
        counter[0] += 1
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward
    return compile_graph


def _model(ctx: Context, graphs: list[int], compiled: bool = True):
    from attnlab.model import GPT, compile_model

    torch.manual_seed(0)
    model = GPT(model_config(ctx.sizes, "lssar", 15.0)).to(ctx.device).eval()
    if compiled:
        compile_model(model, True, backend=counting_backend(ctx.compile_backend or "eager", graphs))
    return model


def _windows(ctx: Context, mult: int, vocab_size: int):
    import numpy as np

    n = max(1, ctx.sizes.eval_windows_1x // mult)
    T = mult * ctx.sizes.train_len
    return np.random.default_rng(mult).integers(0, vocab_size, size=(n, T + 1))


def warm(ctx: Context) -> None:
    """Compile what :func:`evaluation` scores (each length, sharpened and plain), in a background process."""
    from attnlab.evaluate.measure import attention_spec_for, score_windows

    precision = "bf16" if ctx.sizes.dtype == "bfloat16" else "fp32"
    model = _model(ctx, [0])
    for mult in ctx.sizes.eval_multiples:
        windows = _windows(ctx, mult, model.cfg.vocab_size)
        for p in (None, 1.0):
            score_windows(model, windows, batch_size=len(windows), device=ctx.device, precision=precision,
                          attention=attention_spec_for(model, p))


# The lowering failure torch 2.11's inductor raised on the compiled LSSAR evaluation graph (an H200 and an H100:
# bench/RESULTS.md, the quick GPU check's part e).
# On CPU, torch 2.13 lowers such a graph up to the GPU (tests/test_cuda_proxy_attention.py), which cannot tell
# whether 2.13 would lower it on a GPU.
KNOWN_LOWERING_FAILURE = "convert FlexibleLayout to FixedLayout first"


def _score_cells(ctx: Context, model, rows: list, problems: list) -> None:
    """Score every (length, p_eval) cell; a row each, and the problems found (non-finite loss, peak over plan)."""
    from attnlab.evaluate.measure import attention_spec_for, score_windows
    from attnlab.model.memory import ALLOCATOR_OVERHEAD, estimate_eval

    sizes, device = ctx.sizes, ctx.device
    precision = "bf16" if sizes.dtype == "bfloat16" else "fp32"
    for mult in sizes.eval_multiples:
        T = mult * sizes.train_len
        windows = _windows(ctx, mult, model.cfg.vocab_size)
        n = len(windows)
        est = estimate_eval(model.cfg, T, n, precision=precision)
        for p in sizes.eval_p:
            row = {"T": T, "windows": n, "p_eval": p, "estimate_gib": gib(est.tensor_bytes)}
            rows.append(row)
            if ctx.clock.expired():
                row["skipped"] = "time budget"
                continue
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                row["allocated_before_gib"] = torch.cuda.memory_allocated(device) / 2**30
            t0 = time.perf_counter()
            scores = score_windows(model, windows, batch_size=n, device=device, precision=precision,
                                   attention=attention_spec_for(model, p))
            row["seconds"] = time.perf_counter() - t0
            row["loss"] = scores.loss
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            row["peak_vs_estimate"] = peak_vs_estimate(row["peak_gib"], row["estimate_gib"])
            if not math.isfinite(row["loss"]):
                problems.append(f"T={T} p_eval={p}: loss {row['loss']}")
            allowance = gib(est.tensor_bytes * (1 + ALLOCATOR_OVERHEAD))
            if row["peak_gib"] is not None and row["peak_gib"] > allowance:
                problems.append(f"T={T} p_eval={p}: peak {row['peak_gib']:.2f} GiB over the plan's "
                                f"{allowance:.2f} GiB")
            say(f"| {T} | {n} | {'none' if p is None else f'{p:g}'} | {row['loss']:.4f} | {row['seconds']:.1f} "
                f"| {fmt(row['peak_gib'])} | {fmt(row['estimate_gib'])} | {fmt(row['peak_vs_estimate'])} |")


def evaluation(ctx: Context) -> Outcome:
    """Part e: LSSAR (p_train 15) at each multiple of its training length, for each ``p_eval``, the blocks compiled
    as evaluation compiles them. Should that compile fail, the cells are scored again with the blocks eager
    (``eval.compile: false``; FlexAttention still compiled, per call) and the figures are those."""
    sizes = ctx.sizes
    precision = "bf16" if sizes.dtype == "bfloat16" else "fp32"
    backend = ctx.compile_backend or "eager"  # graphs are counted either way: the smoke run captures them
    wait_for_warmers(ctx, "warm-eval", 0.5)
    lengths = [m * sizes.train_len for m in sizes.eval_multiples]
    p_labels = ["none" if p is None else f"{p:g}" for p in sizes.eval_p]
    say(f"{sizes.preset} lssar (p_train 15, untrained) trained at T = {sizes.train_len}; score_windows at T = "
        f"{', '.join(map(str, lengths))}, p_eval {', '.join(p_labels)}; {precision}; compiled ({backend}), graphs "
        "counted")
    say("| T | windows | p_eval | loss | first call s | peak GiB | plan GiB (tensors) | peak / plan |")
    say("|---|---|---|---|---|---|---|---|")
    graphs, rows, problems, compile_error = [0], [], [], None
    model = _model(ctx, graphs)
    try:
        _score_cells(ctx, model, rows, problems)
    except Exception as exc:  # noqa: BLE001 - the compiled path failed: say why, then score with eager blocks
        compile_error = one_line(exc, 300)
        hint = (" (as torch 2.11 failed on an H200: evaluate with eval.compile: false; "
                "docs/gpu.md#what-the-first-gpu-runs-found)"
                if KNOWN_LOWERING_FAILURE in str(exc) else "")
        problems.append(f"the compiled evaluation failed: {compile_error}{hint}")
        say(f"compiled evaluation failed: {compile_error}{hint}\nscoring again with the blocks eager:")
    # Scored again outside the except block: inside it, the exception's traceback keeps the frames of the failed
    # call alive, the first model's weights with them (an H100 measured 0.5 GiB more in every eager cell:
    # bench/results/2026-11-27-h100-quick.md).
    del model
    reset_dynamo()
    if compile_error is not None:
        graphs, rows = [0], []
        model = _model(ctx, graphs, compiled=False)
        try:
            _score_cells(ctx, model, rows, problems)
        finally:
            del model
            reset_dynamo()
    done = [r for r in rows if "skipped" not in r]
    modes = {"sharpened" if (r["p_eval"] is None or r["p_eval"] > 1) else "plain" for r in done}
    limit = len({r["T"] for r in done}) * len(modes)
    if graphs[0] > limit:
        problems.append(f"{graphs[0]} graphs compiled for {len({r['T'] for r in done})} lengths x {len(modes)} "
                        f"sharpening modes (at most {limit})")
    ratios = [r["peak_vs_estimate"] for r in done if r.get("peak_vs_estimate") is not None]
    skipped = len(rows) - len(done)
    how = "blocks eager after the compile failed" if compile_error else f"{graphs[0]} graphs compiled (at most {limit})"
    figures = (f"{len(done)}/{len(rows)} cells (T = {', '.join(map(str, lengths))} x p_eval {', '.join(p_labels)}); "
               f"{how}; peak / plan " + (f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "- (no GPU)")
               + (f"; {skipped} skipped for time" if skipped else ""))
    data = {"rows": rows, "graphs": graphs[0], "graph_limit": limit, "skipped": skipped,
            "compile_error": compile_error}
    return Outcome(FAIL if problems else PASS, ("; ".join(problems[:3]) + f" ({figures})") if problems else figures,
                   data)
