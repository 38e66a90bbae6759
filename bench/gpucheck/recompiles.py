"""The full run's ``recompiles`` part: the graphs a compiled model builds for studies/p_sweep.yaml's grid as an
evaluation-time sweep, counted with dynamo's ``eager`` backend (the same guards as inductor's)."""

from __future__ import annotations

import torch

from gpucheck.harness import Clock, free_memory, is_oom, reset_dynamo, say
from gpucheck.sizes import SWEEP_MULTIPLES, SWEEP_P_EVAL, Sizes, precision_label


def bench_recompiles(sizes: Sizes, device: torch.device, clock: Clock) -> list[dict]:
    """Graphs compiled by the p_eval sweep of studies/p_sweep.yaml (11 p_eval x 5 lengths) on a compiled 2-layer
    model (attn_impl auto: FlexAttention on CUDA) trained without sharpening: at most one per length and
    sharpening mode (none, and every number), the batch being the same at every length.

    Compiled with dynamo's ``eager`` backend and counted (what recompiles is decided by dynamo's guards, whatever
    the backend; inductor would spend minutes generating kernels here)."""
    import numpy as np
    from torch._dynamo.testing import CompileCounter

    from attnlab.evaluate.measure import attention_spec_for, score_windows
    from attnlab.model import GPT, compile_model, preset

    lengths = [m * sizes.sweep_train_len for m in SWEEP_MULTIPLES]
    say(f"tiny (2 layers, head dim 64) trained at T = {sizes.sweep_train_len}, softmax (p_train off); p_eval "
        f"{', '.join('none' if p is None else f'{p:g}' for p in SWEEP_P_EVAL)} at T = "
        f"{', '.join(str(L) for L in lengths)}; one window per call, {precision_label(sizes)}\n")
    reset_dynamo()
    torch.manual_seed(0)
    model = GPT(preset("tiny", attention="softmax", train_len=sizes.sweep_train_len, vocab_size=512)).to(device)
    counter = CompileCounter()
    compile_model(model, True, backend=counter)
    rng = np.random.default_rng(0)
    row = {"lengths": lengths, "p_eval": list(SWEEP_P_EVAL), "limit": 2 * len(lengths)}
    try:
        for L in lengths:
            windows = rng.integers(0, 512, size=(1, L + 1))
            for p in SWEEP_P_EVAL:
                if clock.expired():
                    row["skipped"] = "time budget"
                    break
                score_windows(model, windows, batch_size=1, device=device,
                              precision="bf16" if sizes.dtype == "bfloat16" else "fp32",
                              attention=attention_spec_for(model, p))
        row["graphs"] = counter.frame_count
    except Exception as exc:  # noqa: BLE001
        row["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    finally:
        del model
        reset_dynamo()
        free_memory(device)
    say("| sweep | graphs compiled | at most (lengths x 2 modes) | before the power was a tensor |")
    say("|---|---|---|---|")
    graphs = row.get("error") or row.get("skipped") or row["graphs"]
    say(f"| {len(SWEEP_P_EVAL)} p_eval x {len(lengths)} lengths | {graphs} | "
        f"{row['limit']} | {len(SWEEP_P_EVAL) * len(lengths)} |")
    return [row]


