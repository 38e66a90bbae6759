"""One command that measures the GPU path on one GPU (issue 14): prints every figure and appends it to
``bench/RESULTS.md`` with the date, the device, torch/CUDA/driver versions and the git sha.

Parts, in order (each has a time allotment; an item that would start past it is reported as skipped):

0. ``proxy``: the CPU tests of the CUDA-only paths (``pytest -m cuda_proxy``: FlexAttention's training graph
   lowered by inductor, checkpoints resumed onto a non-CPU device, recompiles counted, the memory plan). They
   pass on any machine; a failure here means the GPU parts below would fail too.
   ``plan``: the memory plan of what the run does (:mod:`attnlab.model.memory`): the estimated peak of each
   training and evaluation configuration below, and the largest micro-batch that fits this device. The
   ``train`` and ``eval`` tables then print the measured peak (``torch.cuda.max_memory_allocated``) next to
   the estimate's tensor bytes, so the first GPU run calibrates the plan (docs/gpu-memory.md).
1. ``tests``: the CUDA tests (``pytest -m gpu``: every CUDA test carries the ``gpu`` marker).
2. ``attention``: forward + backward time and peak memory of softmax (SDPA), lssa and lssar (p = 15, FlexAttention)
   at T = 1K, 4K, 16K, B*H = 16, d = 64, bf16, each as a ratio to SDPA softmax at the same T. CUDA events,
   median of the repeats after two warm-up calls (the compile is not timed); memory:
   ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` minus what was allocated before the
   call (inputs, the output gradient and the gradients' buffers are counted alike for every method).
3. ``train``: gpt2-small training tokens/s and MFU at T = 1024 for softmax, lssa and lssar: bf16 autocast,
   compiled (:func:`attnlab.model.compile_model`), fused AdamW (``attnlab.train.recipe.build_optimizer``),
   gradient clipping, one micro-batch per step, the largest micro-batch that fits (64, halved on OOM; the
   search for lssa/lssar starts at softmax's). Random tokens: no data loader in the figure. MFU uses
   ``attnlab.train.recipe.peak_flops`` and the model's ``flops_per_token``. Softmax is also given as a ratio
   to llm.c's 468K tok/s per H100 (218K per A100).
4. ``eval``: evaluation tokens/s at 1x and 16x the training length (T = 1024 and 16384) for the same three
   variants: ``model.token_stats`` under ``torch.no_grad`` and bf16 autocast, compiled as the evaluation path
   compiles (``compile_model``: the blocks), NTK RoPE, the evaluation's batch (8 windows at 1x, 8 * 1024 / T
   beyond). The first call (the compile) is reported separately.
5. ``variants``: a few bf16 training steps (eager model; FlexAttention compiled as always) of every distinct
   registered variant plus sharpened softmax, on a 2-layer gpt2-small at T = 1024: finite loss and gradients,
   or the variant's expected failure (:data:`EXPECTED_FAILURES`, with the reason).
6. ``determinism``: LSSAR run twice from the same state, bit for bit: one FlexAttention call's dq, dk, dv at
   T = 4K, then a few compiled bf16 training steps of the 2-layer model (losses and gradients). The sharpened
   backward scatters into no captured buffer (docs/attention.md#the-backward-of-the-two-passes); a difference
   names the tensors that differ.
7. ``recompiles``: the graphs a compiled model builds for studies/p_sweep.yaml's grid as an evaluation-time sweep
   (11 p_eval x 5 lengths, a tiny softmax model trained at 256 tokens): at most one per length and sharpening
   mode (the power reaches the attention as a tensor). Counted with dynamo's ``eager`` backend.

LSSAR's training step against softmax's is printed under ``train`` and in its summary line (per token: the ratio
of their tokens/s).

Then the targets beside the figures, as met / not met (measured, never asserted), and a summary of what
passed and what did not, one line per part.

``--smoke``: tiny sizes, a few iterations, no time allotments, no compile (``--compile-backend eager`` captures
graphs), float32, on CPU without CUDA (or on the GPU if there is one), no append unless ``--append``; a test runs
it so this script cannot rot. Without CUDA and without ``--smoke`` it exits 2.
``--json PATH`` writes every figure as JSON too. Budget: under 20 minutes on one H100.

Run: ``python bench/gpu.py [--smoke] [--parts proxy,plan,tests,attention,train,eval,variants,determinism,recompiles]
[--no-append]
[--json PATH]``
(or ``make bench-gpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform as _platform  # the stdlib module (this file is not inside the attnlab package)
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

import torch  # noqa: E402

PARTS = ("proxy", "plan", "tests", "attention", "train", "eval", "variants", "determinism", "recompiles")
# studies/p_sweep.yaml's grid as an evaluation-time sweep (none = as trained, and ten powers) at its five multiples.
SWEEP_P_EVAL = (None, 1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0, 31.0, 63.0)
SWEEP_MULTIPLES = (1, 2, 4, 8, 16)
VARIANTS = (("softmax", None), ("lssa", None), ("lssar", 15.0))  # the three the issue measures
LLMC_TOKENS_PER_S = {"H100": 468e3, "A100": 218e3}  # llm.c GPT-2 124M training, per GPU
TARGETS = {
    "lssar_memory_16k": 1.2,     # lssar peak memory at 16K <= 1.2x SDPA
    "lssar_time": 2.5,           # lssar forward + backward <= 2.5x SDPA
    "softmax_vs_llmc": 0.65,     # gpt2-small softmax training >= 0.65x llm.c per GPU
    "lssar_train_step": 1.5,     # lssar training step <= 1.5x softmax's at T = 1024
}
# Variants expected to fail a few bf16 training steps ("name" or "name p=P"), with the reason. None is, from the
# math: every path computes the weights in float32 (bf16 has float32's exponent range, so unnormalised rows do
# not overflow it either), sharpening works in log space (FlexAttention) or divides the row maximum out (dense),
# and a few clipped steps at lr 6e-4 move no logit far. On CPU (tiny model, bf16 autocast, 6 steps at T = 128)
# every variant measured so far stayed finite. A failure on the GPU is reported as UNEXPECTED, to be looked at.
EXPECTED_FAILURES: dict[str, str] = {}


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU run and the CPU smoke run."""

    att_lengths: tuple[int, ...]
    att_batch: int
    att_heads: int
    head_dim: int
    att_repeats: int
    att_warmup: int
    preset: str
    train_len: int
    max_micro_batch: int
    train_warmup: int
    train_steps: int
    eval_multiples: tuple[int, ...]
    eval_batch_at_1x: int
    eval_calls: int
    check_layers: int
    check_len: int
    check_batch: int
    check_steps: int
    dtype: str
    vocab_size: int | None = None  # None: GPT-2's
    budgets_s: dict = field(default_factory=dict)
    determinism_len: int = 4096  # the attention-level check: one LSSAR call, forward and backward, run twice
    sweep_train_len: int = 256  # the p_eval sweep's tiny model is trained at this length, evaluated at 1..16x


GPU = Sizes(att_lengths=(1024, 4096, 16384), att_batch=1, att_heads=16, head_dim=64, att_repeats=10, att_warmup=2,
            preset="gpt2-small", train_len=1024, max_micro_batch=64, train_warmup=3, train_steps=10,
            eval_multiples=(1, 16), eval_batch_at_1x=8, eval_calls=3,
            check_layers=2, check_len=1024, check_batch=4, check_steps=4, dtype="bfloat16",
            budgets_s=dict(proxy=300, plan=60, tests=270, attention=150, train=330, eval=150, variants=150,
                           determinism=60, recompiles=60))
# The smoke run checks that every step runs, not how fast: no time allotments (a loaded machine must not skip).
SMOKE = Sizes(att_lengths=(32,), att_batch=1, att_heads=2, head_dim=64, att_repeats=1, att_warmup=1,
              preset="tiny", train_len=32, max_micro_batch=4, train_warmup=1, train_steps=1,
              eval_multiples=(1, 2), eval_batch_at_1x=2, eval_calls=1,
              check_layers=1, check_len=16, check_batch=2, check_steps=2, dtype="float32", vocab_size=512,
              budgets_s=dict(proxy=1200, plan=1e9, tests=600, attention=1e9, train=1e9, eval=1e9, variants=1e9,
                             determinism=1e9, recompiles=1e9),
              determinism_len=32, sweep_train_len=16)
TOTAL_BUDGET_S = 24 * 60  # no new item starts after this (GPU run): under 25 minutes in all


# --- small helpers -----------------------------------------------------------------------------------------

class Clock:
    """Seconds since the start; per-part allotments and the overall deadline."""

    def __init__(self, total_s: float):
        self.start = time.monotonic()
        self.total_s = total_s
        self.part_start = self.start
        self.part_budget = total_s

    def begin(self, budget_s: float) -> None:
        self.part_start, self.part_budget = time.monotonic(), budget_s

    def part_elapsed(self) -> float:
        return time.monotonic() - self.part_start

    def expired(self) -> bool:
        now = time.monotonic()
        return now - self.part_start > self.part_budget or now - self.start > self.total_s


def say(text: str = "") -> None:
    print(text, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_dynamo() -> None:
    """Forget compiled graphs (between models: their memory, and the recompile counters)."""
    import torch._dynamo as dynamo

    dynamo.reset()


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error, also when a compiler wrapped it in its own exception."""
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def vocab(sizes: Sizes) -> dict:
    return {} if sizes.vocab_size is None else {"vocab_size": sizes.vocab_size}


def model_config(sizes: Sizes, name: str, p, n_layer: int | None = None):
    """The GPT config every part builds for variant ``name`` (sharpening ``p``) at the run's sizes."""
    from attnlab.model import preset

    overrides = {} if n_layer is None else {"n_layer": n_layer}
    return preset(sizes.preset, attention=name, p_train=p, train_len=sizes.train_len, **overrides, **vocab(sizes))


def variant_label(name: str, p) -> str:
    return name if p is None else f"{name} p={p:g}"


def precision_name(sizes: Sizes) -> str:
    """The memory plan's name for the run's autocast dtype."""
    return "bf16" if sizes.dtype == "bfloat16" else "fp32"


def device_memory(device: torch.device) -> int | None:
    """The device's memory in bytes (None on the CPU: the plan then says what a GPU would need)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def eval_batch(sizes: Sizes, mult: int) -> int:
    """Evaluation windows per call at ``mult`` times the training length (the eval part's batch)."""
    return max(1, sizes.eval_batch_at_1x * sizes.train_len // (mult * sizes.train_len))


def train_estimate(sizes: Sizes, cfg, micro_batch: int, compiled: bool):
    from attnlab.model.memory import estimate_train_step

    return estimate_train_step(cfg, sizes.train_len, micro_batch, precision=precision_name(sizes), compiled=compiled)


def eval_estimate(sizes: Sizes, cfg, length: int, batch: int):
    from attnlab.model.memory import estimate_eval

    return estimate_eval(cfg, length, batch, precision=precision_name(sizes))


def gib(n_bytes) -> float | None:
    return None if n_bytes is None else n_bytes / 2**30


def peak_vs_estimate(peak_gib: float | None, estimate_gib: float | None) -> float | None:
    """Measured peak / estimated tensor bytes (1.0 = the plan was exact; None where nothing was measured)."""
    return peak_gib / estimate_gib if peak_gib is not None and estimate_gib else None


def precision_label(sizes: Sizes) -> str:
    return "no autocast (float32)" if sizes.dtype == "float32" else f"{sizes.dtype} autocast"


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def header(device: torch.device) -> dict:
    from attnlab.provenance import git_info

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": _platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": "cpu", "driver": None, "git": git_info(), "host_cpus": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["device"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = "unknown"
    else:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                   _platform.machine()) if Path("/proc/cpuinfo").exists() else _platform.machine()
        info["device"] = f"CPU: {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    return info


def llmc_reference(device: torch.device) -> tuple[str, float] | None:
    """llm.c's GPT-2 124M tokens/s per GPU for this device (H100, A100), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in LLMC_TOKENS_PER_S.items():
        if key in name:
            return key, value
    return None


# --- 0. the memory plan ---------------------------------------------------------------------------------------

def bench_plan(sizes: Sizes, device: torch.device, compile_backend: str | None) -> list[dict]:
    """The estimated peak of every training and evaluation configuration the run measures, and what fits here."""
    from attnlab.model.memory import largest_micro_batch

    budget = device_memory(device)
    compiled = compile_backend is not None
    say(f"attnlab.model.memory, {precision_name(sizes)}, {'compiled' if compiled else 'eager'}; "
        f"device memory: {f'{gib(budget):.1f} GiB' if budget else 'none (CPU): the figures are what a GPU needs'}\n")
    say("| step | variant | T | batch | estimate GiB (total) | tensors GiB | fits | largest micro-batch that fits |")
    say("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, p in VARIANTS:
        cfg = model_config(sizes, name, p)
        label = name if p is None else f"{name} p={p:g}"
        items = [("train", sizes.train_len, sizes.max_micro_batch, train_estimate(sizes, cfg, sizes.max_micro_batch,
                                                                                  compiled))]
        items += [("eval", m * sizes.train_len, eval_batch(sizes, m),
                   eval_estimate(sizes, cfg, m * sizes.train_len, eval_batch(sizes, m))) for m in sizes.eval_multiples]
        for step, T, batch, est in items:
            fits = None if budget is None else est.total <= budget
            largest = (largest_micro_batch(cfg, T, budget, precision=precision_name(sizes), compiled=compiled)
                       if budget is not None and step == "train" else None)
            rows.append({"step": step, "variant": name, "p": p, "T": T, "batch": batch, "estimate_gib": est.gib(),
                         "tensor_gib": gib(est.tensor_bytes), "breakdown": est.breakdown, "fits": fits,
                         "largest_micro_batch": largest})
            say(f"| {step} | {label} | {T} | {batch} | {est.gib():.2f} | {gib(est.tensor_bytes):.2f} | "
                f"{'-' if fits is None else 'yes' if fits else 'NO'} | {fmt(largest, 'd')} |")
    return rows


# --- 1. the CUDA tests ---------------------------------------------------------------------------------------

def run_cuda_tests(paths: list[str], timeout_s: float, marker: str = "gpu") -> dict:
    """``pytest -m MARKER`` on ``paths`` in a subprocess: its summary line, return code and seconds.

    ``gpu``: the tests that need a CUDA device; ``cuda_proxy``: the CPU tests of the CUDA-only paths (graph
    capture, inductor lowering, checkpoints on a non-CPU device, the memory plan), which run anywhere.
    """
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", marker, "-p", "no:cacheprovider", *paths]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"command": " ".join(cmd[2:]), "rc": None, "summary": f"timed out after {timeout_s:.0f} s",
                "seconds": time.monotonic() - start, "tail": tail[-3000:]}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error|"
                                                                          r"deselected)", ln)), "no summary")
    return {"command": " ".join(cmd[2:]), "rc": proc.returncode, "summary": summary,
            "seconds": time.monotonic() - start, "tail": "" if proc.returncode == 0 else proc.stdout[-3000:]}


# --- 2. attention forward + backward -----------------------------------------------------------------------

def measure_fwd_bwd(fn, q, k, v, repeats: int, device: torch.device, warmup: int = 2) -> tuple[float, float | None]:
    """(median milliseconds, peak MiB above what was allocated before the call) of ``fn(q, k, v)`` + backward."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn_like(v)

    def call():
        fn(q, k, v).backward(grad_out)
        q.grad = k.grad = v.grad = None

    for _ in range(warmup):  # compiles, loads kernels
        call()
    sync(device)
    free_memory(device)
    peak = None
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return statistics.median(times), peak


def bench_attention(sizes: Sizes, device: torch.device, clock: Clock) -> list[dict]:
    from attnlab.attention import attend, get_variant

    dtype = getattr(torch, sizes.dtype)
    methods = [("softmax", None, "sdpa"), ("lssa", None, "flex"), ("lssar", 15.0, "flex")]
    rows = []
    say(f"B={sizes.att_batch}, H={sizes.att_heads} (B*H={sizes.att_batch * sizes.att_heads}), "
        f"d={sizes.head_dim}, {sizes.dtype}, median of {sizes.att_repeats} after {sizes.att_warmup} warm-up "
        "call(s)\n")
    say("| T | variant | backend | fwd+bwd ms | x SDPA | peak MiB | x SDPA |")
    say("|---|---|---|---|---|---|---|")
    for T in sizes.att_lengths:
        gen = torch.Generator(device=device).manual_seed(T)
        q, k, v = (torch.randn(sizes.att_batch, sizes.att_heads, T, sizes.head_dim, generator=gen, device=device,
                               dtype=dtype) for _ in range(3))
        ref = None
        for name, p, impl in methods:
            row = {"T": T, "variant": name, "p": p, "backend": impl, "ms": None, "peak_mib": None}
            if clock.expired():
                row["skipped"] = "time budget"
            else:
                spec = get_variant(name, p=p)
                try:
                    row["ms"], row["peak_mib"] = measure_fwd_bwd(lambda a, b, c: attend(a, b, c, spec, impl=impl),
                                                                 q, k, v, sizes.att_repeats, device,
                                                                 sizes.att_warmup)
                except Exception as exc:  # noqa: BLE001 - a figure that cannot be taken is reported, not fatal
                    row["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                free_memory(device)
            if name == "softmax":
                ref = row
            row["x_time"] = row["ms"] / ref["ms"] if row["ms"] and ref and ref["ms"] else None
            row["x_mem"] = (row["peak_mib"] / ref["peak_mib"] if row["peak_mib"] is not None and ref
                            and ref["peak_mib"] else None)
            note = row.get("error") or row.get("skipped")
            say(f"| {T} | {name}{'' if p is None else f' p={p:g}'} | {impl} | "
                f"{note or fmt(row['ms'])} | {fmt(row['x_time'])} | {fmt(row['peak_mib'], '.0f')} | "
                f"{fmt(row['x_mem'])} |")
            rows.append(row)
        del q, k, v
        free_memory(device)
    return rows


# --- 3. training throughput --------------------------------------------------------------------------------

def batch_candidates(start: int) -> list[int]:
    """``start``, then halved down to 1: the micro-batches tried after an out-of-memory error."""
    out, b = [], start
    while b >= 1:
        out.append(b)
        b //= 2
    return out


def largest_fitting(run, start: int, device: torch.device) -> tuple[int | None, object, list[int]]:
    """``(micro_batch, run(micro_batch), the micro-batches that ran out of memory)``, halving from ``start``."""
    ooms = []
    for b in batch_candidates(start):
        try:
            return b, run(b), ooms
        except Exception as exc:  # noqa: BLE001
            if not is_oom(exc):
                raise
            ooms.append(b)
        # Outside the except block: the exception (and the tensors its frames hold) is gone by now.
        reset_dynamo()
        free_memory(device)
    return None, None, ooms


def train_steps(model, optimizer, batches, device, dtype) -> list[float]:
    losses = []
    for x, y in batches:
        with autocast(device, dtype):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(v) for v in losses]


def train_throughput(sizes: Sizes, device: torch.device, name: str, p, micro_batch: int, compile_backend: str | None,
                     n_layer: int | None = None) -> dict:
    """Tokens/s and MFU of ``sizes.train_steps`` timed steps after ``sizes.train_warmup`` warm-up steps."""
    from attnlab.model import GPT, compile_model
    from attnlab.train.config import TrainConfig
    from attnlab.train.recipe import build_optimizer, peak_flops

    torch.manual_seed(0)
    model = GPT(model_config(sizes, name, p, n_layer)).to(device)
    compiled = compile_backend is not None
    estimate = train_estimate(sizes, model.cfg, micro_batch, compiled)
    if compiled:
        compile_model(model, True, backend=compile_backend)
    optimizer = build_optimizer(model, TrainConfig(preset=sizes.preset), device)
    dtype = getattr(torch, sizes.dtype)
    T, V = sizes.train_len, model.cfg.vocab_size
    gen = torch.Generator(device=device).manual_seed(1)

    def batch():
        idx = torch.randint(0, V, (micro_batch, T + 1), device=device, generator=gen)
        return idx[:, :-1], idx[:, 1:]

    try:
        t0 = time.perf_counter()
        train_steps(model, optimizer, [batch()], device, dtype)
        sync(device)
        first_s = time.perf_counter() - t0
        train_steps(model, optimizer, [batch() for _ in range(sizes.train_warmup - 1)], device, dtype)
        batches = [batch() for _ in range(sizes.train_steps)]
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        losses = train_steps(model, optimizer, batches, device, dtype)
        sync(device)
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        tokens_per_s = micro_batch * T * len(batches) / seconds
        peak_flops_s = peak_flops(device)
        mfu = model.flops_per_token(T) * tokens_per_s / peak_flops_s if peak_flops_s else None
        return {"variant": name, "p": p, "micro_batch": micro_batch, "compiled": compiled,
                "tokens_per_s": tokens_per_s, "step_ms": seconds / len(batches) * 1e3, "mfu": mfu,
                "first_step_s": first_s, "peak_gib": peak, "estimate_gib": gib(estimate.tensor_bytes),
                "peak_vs_estimate": peak_vs_estimate(peak, gib(estimate.tensor_bytes)),
                "loss_finite": all(math.isfinite(x) for x in losses)}
    finally:
        del model, optimizer
        free_memory(device)


def bench_train(sizes: Sizes, device: torch.device, clock: Clock, compile_backend: str | None) -> list[dict]:
    say(f"{sizes.preset}, T = {sizes.train_len}, {precision_label(sizes)}, "
        f"{'compiled (' + compile_backend + ')' if compile_backend else 'eager'}, "
        f"AdamW{' (fused)' if device.type == 'cuda' else ''}, grad clip 1.0, {sizes.train_warmup} warm-up + "
        f"{sizes.train_steps} timed steps, one micro-batch per step, random tokens\n")
    say("| variant | micro-batch | tokens/s | step ms | MFU | peak GiB | estimate GiB | peak / estimate | "
        "first step s (compile) |")
    say("|---|---|---|---|---|---|---|---|---|")
    rows, start = [], sizes.max_micro_batch
    for name, p in VARIANTS:
        if clock.expired():
            rows.append({"variant": name, "p": p, "skipped": "time budget"})
            say(f"| {name} | skipped (time budget) | | | | | | | |")
            continue
        try:
            b, row, ooms = largest_fitting(
                lambda mb: train_throughput(sizes, device, name, p, mb, compile_backend), start, device)
        except Exception as exc:  # noqa: BLE001
            row, b, ooms = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}, None, []
        if row is None:
            row = {"error": "OOM at micro-batch 1"}
        row.update(variant=name, p=p, oom_micro_batches=ooms)
        if name == "softmax" and b:
            start = b  # lssa/lssar start their search at softmax's micro-batch
        rows.append(row)
        reset_dynamo()
        if "error" in row:
            say(f"| {name} | {row['error']} | | | | | | | |")
        else:
            say(f"| {name}{'' if p is None else f' p={p:g}'} | {row['micro_batch']} | {row['tokens_per_s']:,.0f} | "
                f"{row['step_ms']:.1f} | {fmt(row['mfu'], '.1%', 'unknown')} | {fmt(row['peak_gib'])} | "
                f"{fmt(row['estimate_gib'])} | {fmt(row['peak_vs_estimate'])} | {row['first_step_s']:.1f} |")
    ratio = lssar_step_ratio(rows)
    if ratio is not None:
        lssar = next(r for r in rows if r["variant"] == "lssar")
        softmax_row = next(r for r in rows if r["variant"] == "softmax")
        say(f"\nlssar: {lssar['step_ms']:.1f} ms per step at micro-batch {lssar['micro_batch']} against softmax's "
            f"{softmax_row['step_ms']:.1f} ms at {softmax_row['micro_batch']}: {ratio:.2f}x softmax's time per token")
    ref = llmc_reference(device)
    softmax = next((r for r in rows if r["variant"] == "softmax" and "tokens_per_s" in r), None)
    if ref and softmax:
        say(f"\nsoftmax: {softmax['tokens_per_s']:,.0f} tok/s = {softmax['tokens_per_s'] / ref[1]:.2f}x llm.c's "
            f"{ref[1] / 1e3:.0f}K tok/s per {ref[0]}")
    return rows


# --- 4. evaluation throughput -----------------------------------------------------------------------------

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


# --- 5. every variant trains a few bf16 steps ----------------------------------------------------------------

def check_cases() -> list[tuple[str, float | None]]:
    """One ``(name, p)`` per distinct registered spec (canonical names, aliases dropped), then sharpened softmax."""
    from attnlab.attention import get_variant, variant_names

    seen, cases = set(), []
    for name in variant_names():
        spec = get_variant(name)
        key = spec.replace(name="", source="")
        if key not in seen:
            seen.add(key)
            cases.append((spec.name, None))
    return sorted(cases) + [("softmax", 15.0)]


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


# --- 6. determinism: the same steps twice ------------------------------------------------------------------

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


# --- 7. recompiles of an evaluation sweep over p_eval ------------------------------------------------------

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
    say(f"| {len(SWEEP_P_EVAL)} p_eval x {len(lengths)} lengths | {row.get('error') or row.get('skipped') or row['graphs']} | "
        f"{row['limit']} | {len(SWEEP_P_EVAL) * len(lengths)} |")
    return [row]


# --- targets -------------------------------------------------------------------------------------------------

def targets(results: dict, device: torch.device) -> list[dict]:
    """The issue's four targets, measured: each with its figure, the threshold and met / not met / not measured."""
    out = []
    att = [r for r in results.get("attention", []) if r.get("variant") == "lssar"]
    att_long = max(att, key=lambda r: r["T"]) if att else None
    mem = att_long.get("x_mem") if att_long else None
    out.append({"target": f"lssar peak memory at T = {att_long['T'] if att_long else '?'} <= "
                          f"{TARGETS['lssar_memory_16k']}x SDPA", "figure": mem, "limit": TARGETS["lssar_memory_16k"],
                "met": None if mem is None else mem <= TARGETS["lssar_memory_16k"]})
    times = [r["x_time"] for r in att if r.get("x_time") is not None]
    worst = max(times) if times else None
    out.append({"target": f"lssar forward+backward <= {TARGETS['lssar_time']}x SDPA (worst over T = "
                          f"{', '.join(str(r['T']) for r in att if r.get('x_time') is not None) or '?'})",
                "figure": worst, "limit": TARGETS["lssar_time"],
                "met": None if worst is None else worst <= TARGETS["lssar_time"]})
    train = {r["variant"]: r for r in results.get("train", []) if "tokens_per_s" in r}
    ref = llmc_reference(device)
    ratio = train["softmax"]["tokens_per_s"] / ref[1] if ref and "softmax" in train else None
    out.append({"target": f"softmax training >= {TARGETS['softmax_vs_llmc']}x llm.c per GPU"
                          f"{f' ({ref[0]}: {ref[1] / 1e3:.0f}K tok/s)' if ref else ' (no llm.c figure here)'}",
                "figure": ratio, "limit": TARGETS["softmax_vs_llmc"],
                "met": None if ratio is None else ratio >= TARGETS["softmax_vs_llmc"]})
    step = (train["softmax"]["tokens_per_s"] / train["lssar"]["tokens_per_s"]
            if "softmax" in train and "lssar" in train else None)
    out.append({"target": f"lssar training step <= {TARGETS['lssar_train_step']}x softmax's (per token)",
                "figure": step, "limit": TARGETS["lssar_train_step"],
                "met": None if step is None else step <= TARGETS["lssar_train_step"]})
    return out


def lssar_step_ratio(train_rows: list[dict]) -> float | None:
    """LSSAR's training step time per token over softmax's (the ratio of their tokens/s), or None."""
    done = {r["variant"]: r for r in train_rows if r.get("tokens_per_s")}
    if "softmax" not in done or "lssar" not in done:
        return None
    return done["softmax"]["tokens_per_s"] / done["lssar"]["tokens_per_s"]


def summary(results: dict) -> list[dict]:
    """One line per part that ran: PASSED, FAILED or INCOMPLETE (skipped for time), with what failed."""
    out = []

    def add(part, failures, skipped, detail_ok=""):
        verdict = "FAILED" if failures else "INCOMPLETE" if skipped else "PASSED"
        detail = "; ".join(failures) if failures else f"{skipped} item(s) skipped for time" if skipped else detail_ok
        out.append({"part": part, "verdict": verdict, "detail": detail})

    for part in ("proxy", "tests"):
        if part in results:
            r = results[part]
            add(part, [] if r["rc"] in (0, 5) else [r["summary"]], 0, r["summary"])
    if "plan" in results:
        too_big = [f"{r['step']} {r['variant']} T={r['T']} batch {r['batch']} needs {r['estimate_gib']:.1f} GiB"
                   for r in results["plan"] if r["fits"] is False]
        add("plan", too_big, 0, "every configuration fits" if any(r["fits"] for r in results["plan"])
            else "estimates only (no GPU memory to compare with)")
    for part in ("attention", "train", "eval"):
        if part in results:
            rows = results[part]
            failures = [f"{r['variant']}{' ' + str(r['T']) if 'T' in r else ''}: {r['error']}" for r in rows
                        if r.get("error")]
            ratios = [r["peak_vs_estimate"] for r in rows if r.get("peak_vs_estimate")]
            details = [f"measured peak / estimate {min(ratios):.2f}-{max(ratios):.2f}"] if ratios else []
            if part == "train" and lssar_step_ratio(rows) is not None:
                details.insert(0, f"lssar step {lssar_step_ratio(rows):.2f}x softmax's (per token)")
            add(part, failures, sum(1 for r in rows if r.get("skipped")), "; ".join(details))
    if "variants" in results:
        rows = results["variants"]
        failures = [f"{variant_label(r['variant'], r['p'])}: {r['failure']}" for r in rows
                    if r.get("verdict") == "UNEXPECTED failure"]
        dense = [r["variant"] for r in rows if r.get("backend") == "dense"]
        add("variants", failures, sum(1 for r in rows if r.get("skipped")),
            f"{len(rows)} variants finite" + (f"; on the dense reference: {', '.join(dense)}" if dense else
                                              "; none on the dense reference"))
    if "determinism" in results:
        rows = results["determinism"]
        failures = [f"{r['check']}: {r['error']}" for r in rows if r.get("error")]
        failures += [f"{r['check']} differs ({', '.join(r['differences'][:3])})" for r in rows
                     if r.get("differences")]
        add("determinism", failures, sum(1 for r in rows if r.get("skipped")),
            "lssar attention and training gradients bit-identical over 2 runs")
    if "recompiles" in results:
        (r,) = results["recompiles"]
        failures = [r["error"]] if r.get("error") else []
        if r.get("graphs") is not None and r["graphs"] > r["limit"]:
            failures.append(f"{r['graphs']} graphs for {len(r['p_eval'])} p_eval x {len(r['lengths'])} lengths "
                            f"(at most {r['limit']}: one per length and sharpening mode)")
        add("recompiles", failures, 1 if r.get("skipped") else 0,
            f"{r.get('graphs')} graphs for {len(r['p_eval'])} p_eval x {len(r['lengths'])} lengths "
            f"(at most {r['limit']})")
    return out


def print_targets(rows: list[dict]) -> None:
    say("| target | measured | verdict |")
    say("|---|---|---|")
    for r in rows:
        verdict = "not measured" if r["met"] is None else "met" if r["met"] else "NOT met"
        say(f"| {r['target']} | {fmt(r['figure'])} | {verdict} |")


# --- main ----------------------------------------------------------------------------------------------------

class Tee:
    """Everything said goes to stdout and into a buffer (the section appended to RESULTS.md)."""

    def __init__(self, stream):
        self.stream, self.lines = stream, []

    def write(self, text):
        self.lines.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def text(self) -> str:
        return "".join(self.lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few iterations; works without CUDA")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--append", dest="append", action="store_true", default=None,
                    help="append to the results file (default: on for the GPU run, off for --smoke)")
    ap.add_argument("--no-append", dest="append", action="store_false")
    ap.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"), help="the file to append to")
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend for training and evaluation (default: inductor on the GPU run, "
                         "none for --smoke; 'eager' captures graphs without generating code)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="autocast dtype (default: bfloat16 on the GPU run, float32 for --smoke)")
    ap.add_argument("--test-paths", nargs="+", default=None, help="what pytest -m gpu runs (default: tests/)")
    args = ap.parse_args(argv)

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts={unknown[0]!r} is not allowed: use a comma-separated subset of {','.join(PARTS)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "use --smoke for the CPU check", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    sizes = SMOKE if args.smoke else GPU
    if args.dtype:
        sizes = dataclasses.replace(sizes, dtype=args.dtype)
    backend = args.compile_backend or ("none" if args.smoke else "inductor")
    backend = None if backend == "none" else backend
    append = (not args.smoke) if args.append is None else args.append
    clock = Clock(1e9 if args.smoke else TOTAL_BUDGET_S)
    tee = Tee(sys.stdout)
    results: dict = {"parts": parts, "smoke": args.smoke, "sizes": asdict(sizes), "compile_backend": backend}
    with contextlib.redirect_stdout(tee):
        info = header(device)
        results["header"] = info
        git = info["git"]
        say(f"\n## GPU path: attention, training, evaluation (`bench/gpu.py{' --smoke' if args.smoke else ''}`, "
            f"issue 14)\n")
        say(f"- date: {info['date']}")
        say(f"- device: {info['device']}; driver {info['driver'] or '-'}")
        say(f"- python {info['python']}, torch {info['torch']}, CUDA {info['cuda'] or '-'}")
        say(f"- git: {git['sha']}{' (dirty)' if git.get('dirty') else ''}")
        say(f"- parts: {', '.join(parts)}" + ("; no time allotments (smoke)\n" if args.smoke else
                                               f"; no item starts after {TOTAL_BUDGET_S // 60} min\n"))
        steps = {
            "proxy": lambda: run_cuda_tests(args.test_paths or ["tests"], sizes.budgets_s["proxy"], "cuda_proxy"),
            "plan": lambda: bench_plan(sizes, device, backend),
            "tests": lambda: run_cuda_tests(args.test_paths or ["tests"], sizes.budgets_s["tests"]),
            "attention": lambda: bench_attention(sizes, device, clock),
            "train": lambda: bench_train(sizes, device, clock, backend),
            "eval": lambda: bench_eval(sizes, device, clock, backend),
            "variants": lambda: bench_variants(sizes, device, clock),
            "determinism": lambda: bench_determinism(sizes, device, clock, backend),
            "recompiles": lambda: bench_recompiles(sizes, device, clock),
        }
        titles = {"proxy": "CPU tests of the CUDA paths (`pytest -m cuda_proxy`)", "plan": "Memory plan",
                  "tests": "CUDA tests (`pytest -m gpu`)", "attention": "Attention forward + backward",
                  "train": "Training throughput", "eval": "Evaluation throughput",
                  "variants": f"Every variant: a few {sizes.dtype} training steps",
                  "determinism": "LSSAR run twice: bit-identical gradients?",
                  "recompiles": "Graphs compiled by a p_eval sweep (studies/p_sweep.yaml's grid)"}
        for part in PARTS:
            if part not in parts:
                continue
            say(f"### {titles[part]}\n")
            clock.begin(sizes.budgets_s[part])
            results[part] = steps[part]()
            if part in ("proxy", "tests"):
                r = results[part]
                say(f"`{r['command']}`: {r['summary']} (rc {r['rc']}, {r['seconds']:.0f} s)")
                if r["tail"]:
                    say("\n```\n" + r["tail"].strip() + "\n```")
            say(f"\n({part}: {clock.part_elapsed():.0f} s)\n")
        say("### Targets (measured, not asserted)\n")
        results["targets"] = targets(results, device)
        print_targets(results["targets"])
        say("\n### What passed and what did not\n")
        results["summary"] = summary(results)
        for row in results["summary"]:
            say(f"- {row['part']}: **{row['verdict']}**{' - ' + row['detail'] if row['detail'] else ''}")
        results["seconds"] = time.monotonic() - clock.start
        say(f"\nTotal: {results['seconds'] / 60:.1f} min.")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if append:
        with open(args.results, "a") as f:
            f.write(tee.text())
        print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
