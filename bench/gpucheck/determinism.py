"""The full run's ``determinism`` part: LSSAR run twice from the same state, bit for bit: one FlexAttention
call's dq, dk, dv, then a few compiled bf16 training steps (losses and gradients); a difference names the tensors."""

from __future__ import annotations

import torch

from gpucheck.harness import Clock, autocast, free_memory, is_oom, reset_dynamo, say
from gpucheck.sizes import Sizes, precision_label, vocab


def _differences(first: dict, second: dict) -> list[str]:
    """Names whose tensors are not bit for bit equal, with the largest difference."""
    out = []
    for name, a in first.items():
        b = second[name]
        if a is None or b is None:
            if (a is None) != (b is None):
                out.append(f"{name} (missing once)")
        elif not torch.equal(a, b):
            out.append(f"{name} (max |diff| {(a.float() - b.float()).abs().max().item():.1e})")
    return out


def lssar_attention_gradients(sizes: Sizes, device: torch.device) -> dict:
    """dq, dk, dv of one LSSAR FlexAttention call (the fused path, compiled on CUDA) for fixed inputs."""
    from attnlab.attention import attend, get_variant

    dtype = getattr(torch, sizes.dtype)
    gen = torch.Generator(device=device).manual_seed(7)
    shape = (sizes.att_batch, sizes.att_heads, sizes.determinism_len, sizes.head_dim)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    attend(q, k, v, get_variant("lssar"), impl="flex").backward(grad_out)
    return {"dq": q.grad, "dk": k.grad, "dv": v.grad}


def lssar_training_run(sizes: Sizes, device: torch.device, compile_backend: str | None) -> tuple[list[float], dict]:
    """Losses and final gradients of ``check_steps`` LSSAR training steps from a fixed seed and fixed batches."""
    from attnlab.model import GPT, compile_model, preset
    from attnlab.train.config import TrainConfig
    from attnlab.train.recipe import build_optimizer

    torch.manual_seed(0)
    cfg = preset(sizes.preset, attention="lssar", train_len=sizes.check_len, n_layer=sizes.check_layers,
                 **vocab(sizes))
    model = GPT(cfg).to(device)
    if compile_backend:
        compile_model(model, True, backend=compile_backend)
    optimizer = build_optimizer(model, TrainConfig(preset=sizes.preset), device)
    gen = torch.Generator(device=device).manual_seed(3)
    batches = [torch.randint(0, cfg.vocab_size, (sizes.check_batch, sizes.check_len + 1), device=device,
                             generator=gen) for _ in range(sizes.check_steps)]
    losses, grads = [], {}
    dtype = getattr(torch, sizes.dtype)
    try:
        for step, idx in enumerate(batches):
            with autocast(device, dtype):
                _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            losses.append(loss.item())
            if step == len(batches) - 1:
                grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        del model, optimizer
        free_memory(device)
    return losses, grads


def bench_determinism(sizes: Sizes, device: torch.device, clock: Clock, compile_backend: str | None) -> list[dict]:
    """LSSAR run twice from the same state: its attention gradients, then a few training steps, bit for bit.

    Pass 2 of the sharpened form used to differentiate pass 1's LSE as a captured buffer, which inductor computes
    with atomic adds (non-deterministic on a GPU); now it does not (docs/attention.md#the-backward-of-the-two-passes).
    The model-level check also covers every other op's backward (e.g. the embedding's).
    """
    say(f"LSSAR, {precision_label(sizes)}: (1) one FlexAttention call (B*H = {sizes.att_batch * sizes.att_heads}, "
        f"T = {sizes.determinism_len}, d = {sizes.head_dim}) forward + backward, twice; (2) {sizes.check_steps} "
        f"training steps of {sizes.preset} with {sizes.check_layers} layer(s) at T = {sizes.check_len}, "
        f"{'compiled (' + compile_backend + ')' if compile_backend else 'eager'}, twice from the same seed\n")
    say("| check | runs | result |")
    say("|---|---|---|")
    rows = []
    for check in ("attention", "training"):
        row = {"check": check}
        if clock.expired():
            row["skipped"] = "time budget"
            say(f"| {check} | 2 | skipped (time budget) |")
            rows.append(row)
            continue
        try:
            if check == "attention":
                first, second = (lssar_attention_gradients(sizes, device) for _ in range(2))
                row["differences"] = _differences(first, second)
            else:
                reset_dynamo()
                (l1, g1), (l2, g2) = (lssar_training_run(sizes, device, compile_backend) for _ in range(2))
                row["losses"] = l1
                row["differences"] = (["losses"] if l1 != l2 else []) + _differences(g1, g2)
                reset_dynamo()
            row["identical"] = not row["differences"]
        except Exception as exc:  # noqa: BLE001
            row["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        free_memory(device)
        result = row.get("error") or ("bit-identical" if row.get("identical") else
                                      "DIFFER: " + ", ".join(row["differences"][:4]))
        say(f"| {check} | 2 | {result} |")
        rows.append(row)
    return rows


