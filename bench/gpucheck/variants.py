"""The full run's ``variants`` part: a few bf16 training steps of every distinct registered variant and of
sharpened softmax on a small model: finite losses and gradients, or the variant's expected failure."""

from __future__ import annotations

import math

import torch

from gpucheck.harness import Clock, autocast, free_memory, say
from gpucheck.sizes import EXPECTED_FAILURES, Sizes, precision_label, vocab


def check_cases() -> list[tuple[str, float | None]]:
    """One ``(name, p)`` per distinct registered spec (canonical names, aliases dropped), with its registered power
    (LSSAR's p = 15: ``(name, None)`` would build it unsharpened), then sharpened softmax."""
    from attnlab.attention import AttentionSpec, get_variant, variant_names

    seen, cases = set(), []
    for name in variant_names():
        spec = get_variant(name)
        if not isinstance(spec, AttentionSpec):
            continue  # a plugin's variant loaded in this process
        key = spec.replace(name="", source="")
        if key not in seen:
            seen.add(key)
            cases.append((spec.name, spec.p))
    return sorted(cases, key=lambda c: c[0]) + [("softmax", 15.0)]


def check_variant(sizes: Sizes, device: torch.device, name: str, p) -> dict:
    """A few bf16 steps of a small model: the losses, and the first step whose loss or gradients are not finite."""
    import warnings

    from attnlab.attention import resolve_backend
    from attnlab.model import GPT, preset
    from attnlab.train.config import TrainConfig
    from attnlab.train.recipe import build_optimizer

    torch.manual_seed(0)
    cfg = preset(sizes.preset, attention=name, p_train=p, train_len=sizes.check_len, n_layer=sizes.check_layers,
                 **vocab(sizes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dense fallback's one warning: the backend column says it
        backend = resolve_backend(cfg.attention_spec(), device, cfg.attn_impl).value
    model = GPT(cfg).to(device)
    optimizer = build_optimizer(model, TrainConfig(preset=sizes.preset), device)
    dtype = getattr(torch, sizes.dtype)
    gen = torch.Generator(device=device).manual_seed(2)
    losses, failure = [], None
    try:
        for step in range(sizes.check_steps):
            idx = torch.randint(0, cfg.vocab_size, (sizes.check_batch, sizes.check_len + 1), device=device,
                                generator=gen)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with autocast(device, dtype):
                    _, loss = model(idx[:, :-1], idx[:, 1:])
                loss.backward()
            losses.append(loss.item())
            if not math.isfinite(losses[-1]):
                failure = f"loss {losses[-1]} at step {step}"
                break
            bad = [n for n, prm in model.named_parameters() if prm.grad is not None
                   and not torch.isfinite(prm.grad).all()]
            if bad:
                failure = f"non-finite gradient at step {step} ({bad[0]})"
                break
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        del model, optimizer
        free_memory(device)
    return {"variant": name, "p": p, "backend": backend, "losses": losses, "failure": failure}


def bench_variants(sizes: Sizes, device: torch.device, clock: Clock) -> list[dict]:
    say(f"{sizes.preset} with {sizes.check_layers} layer(s), T = {sizes.check_len}, batch {sizes.check_batch}, "
        f"{sizes.check_steps} steps, {precision_label(sizes)}, lr 6e-4, eager model, attn_impl auto\n")
    say("| variant | backend | losses | result | expected | verdict |")
    say("|---|---|---|---|---|---|")
    rows = []
    for name, p in check_cases():
        label = name if p is None else f"{name} p={p:g}"
        expected = EXPECTED_FAILURES.get(label)
        if clock.expired():
            rows.append({"variant": name, "p": p, "skipped": "time budget"})
            say(f"| {label} | | | skipped (time budget) | | |")
            continue
        try:
            row = check_variant(sizes, device, name, p)
        except Exception as exc:  # noqa: BLE001
            row = {"variant": name, "p": p, "backend": "?", "losses": [],
                   "failure": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
        row["expected_failure"] = expected
        failed = row["failure"] is not None
        row["verdict"] = ("as expected" if failed == bool(expected) else
                          "UNEXPECTED failure" if failed else "passes (a failure was expected)")
        rows.append(row)
        losses = " -> ".join(f"{x:.3f}" for x in (row["losses"][:1] + row["losses"][-1:])) or "-"
        say(f"| {label} | {row['backend']} | {losses} | {row['failure'] or 'finite'} | "
            f"{expected or 'finite'} | {row['verdict']} |")
    return rows


