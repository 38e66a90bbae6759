"""Evaluation's peak GPU memory by phase, against the memory plan (``attnlab.model.memory.estimate_eval``).

GPT-2 small (untrained), eager, no grad, bf16 autocast, in this fresh process. For each variant and cell (windows x
tokens), the peak of ``torch.cuda.max_memory_allocated`` from a reset, in GiB, of each phase of scoring:

- ``blocks``: ``GPT.hidden_states`` (the blocks' phase);
- ``token_stats``: the whole per-token scoring of evaluation (the blocks, then the LM head in chunks);
- ``head, transposed`` and ``head, rows``: the LM head and the cross-entropy on the first chunk of positions
  (``EVAL_HEAD_CHUNK``), the float32 logits given as ``(B, vocab, T)`` or as ``(positions, vocab)`` rows; beside
  each, its bytes per logit above what was allocated before (CUDA's log-softmax copies a transposed input
  contiguous first);

and the plan's tensors for the cell with their parts. The GPU check's part e measures evaluation's peak as a
study runs it (compiled, ``score_windows``); this probe takes it apart.

    python bench/eval_memory.py                                   # lssar (p 15) and softmax; 4 x 1,024,
                                                                  # 1 x 4,096 and 1 x 16,384 tokens
    python bench/eval_memory.py --variants lssar:15 --cells 4x1024

``--smoke``: the tiny preset at 32 tokens on CPU (no peak there: the phases run, the figures are ``-``); a test runs
it. Without CUDA and without ``--smoke`` it exits 2 with one line. The machine header (``bench/machine.py``) comes
first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # bench/machine.py, also when a test loads this file
import machine  # noqa: E402  (puts platform/ on sys.path)

GIB = 2**30
VARIANTS = "lssar:15,softmax"
CELLS = "4x1024,1x4096,1x16384"
SMOKE_CELLS = "2x32,1x64"


def _pairs(text: str, sep: str, what: str) -> list[tuple[str, str]]:
    out = []
    for item in text.split(","):
        left, found, right = item.strip().partition(sep)
        if not left or (sep == "x" and not found):
            raise SystemExit(f"--{what}={text!r}: use a comma-separated list of "
                             + ("WINDOWSxTOKENS, e.g. 4x1024" if sep == "x" else "NAME or NAME:P, e.g. lssar:15"))
        out.append((left, right))
    return out


def peak(fn, device):
    """``(GiB allocated before, peak GiB, fn())``; on CPU ``(None, None, fn())``."""
    import torch

    if device.type != "cuda":
        return None, None, fn()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return before / GIB, torch.cuda.max_memory_allocated(device) / GIB, out


def measure(model, B: int, T: int, device) -> dict:
    """Every phase's peak for ``B`` windows of ``T`` tokens, and the plan's tensors."""
    import torch
    import torch.nn.functional as F

    from attnlab.model.memory import EVAL_HEAD_CHUNK, estimate_eval
    from attnlab.model.scoring import autocast_context

    V = model.cfg.vocab_size
    x = torch.randint(0, V, (B, T + 1), device=device, generator=torch.Generator(device=device).manual_seed(T))
    plan = estimate_eval(model.cfg, T, B, precision="bf16")
    chunk = min(T, EVAL_HEAD_CHUNK)
    row = {"B": B, "T": T, "plan_gib": plan.tensor_bytes / GIB,
           "plan_parts": {k: v / GIB for k, v in plan.breakdown.items() if v}}
    t0 = time.perf_counter()
    with torch.no_grad(), autocast_context(device, "bf16"):
        row["before_gib"], row["blocks_gib"], h = peak(lambda: model.hidden_states(x[:, :-1]), device)
        row["token_stats_gib"] = peak(lambda: model.token_stats(x[:, :-1], x[:, 1:]), device)[1]
        h, y = h[:, :chunk], x[:, 1:chunk + 1]
        row["head_transposed_gib"] = peak(lambda: F.cross_entropy(
            model.lm_head(h).float().transpose(1, 2), y, reduction="none"), device)[1]
        row["head_rows_gib"] = peak(lambda: F.cross_entropy(
            model.lm_head(h).float().reshape(-1, V), y.reshape(-1), reduction="none"), device)[1]
    del h
    logits = B * chunk * V
    for key in ("head_transposed", "head_rows"):
        gib = row[f"{key}_gib"]
        row[f"{key}_bytes_per_logit"] = None if gib is None else (gib - row["before_gib"]) * GIB / logits
    row["seconds"] = time.perf_counter() - t0
    return row


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=VARIANTS, help="NAME or NAME:P (p_train), comma-separated")
    ap.add_argument("--cells", default=None, help=f"WINDOWSxTOKENS, comma-separated (default {CELLS})")
    ap.add_argument("--smoke", action="store_true", help=f"tiny preset on CPU, cells {SMOKE_CELLS}")
    args = ap.parse_args(argv)
    variants = [(name, float(p) if p else None) for name, p in _pairs(args.variants, ":", "variants")]
    cells = [(int(b), int(t)) for b, t in _pairs(args.cells or (SMOKE_CELLS if args.smoke else CELLS), "x", "cells")]
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("bench/eval_memory.py needs a CUDA GPU (torch.cuda.is_available() is False); use --smoke for the "
              "CPU check", file=sys.stderr)
        return 2
    from attnlab.model import GPT, preset

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    machine.print_header(device)
    shape = dict(train_len=32, vocab_size=512) if args.smoke else dict(train_len=1024)
    name = "tiny" if args.smoke else "gpt2-small"
    print(f"- {name}, untrained, eager, no grad, bf16 autocast on CUDA; peaks in GiB "
          "(max_memory_allocated from a reset)\n")
    print("| variant | windows x tokens | allocated before | blocks | token_stats | head, transposed (B/logit) | "
          "head, rows (B/logit) | plan (tensors) | plan's parts | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant, p in variants:
        torch.manual_seed(0)
        model = GPT(preset(name, attention=variant, p_train=p, **shape)).to(device).eval()
        for B, T in cells:
            r = measure(model, B, T, device)
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r["plan_parts"].items())
            print(f"| {variant}{'' if p is None else f' p={p:g}'} | {B} x {T:,} | {_fmt(r['before_gib'])} | "
                  f"{_fmt(r['blocks_gib'])} | {_fmt(r['token_stats_gib'])} | {_fmt(r['head_transposed_gib'])} "
                  f"({_fmt(r['head_transposed_bytes_per_logit'])}) | {_fmt(r['head_rows_gib'])} "
                  f"({_fmt(r['head_rows_bytes_per_logit'])}) | {r['plan_gib']:.2f} | {parts} | {r['seconds']:.0f} |",
                  flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
