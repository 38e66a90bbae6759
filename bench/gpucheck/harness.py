"""The harness every part of the GPU check shares: the clock and its budgets, the printed line, and the results
written as they come (a JSON file rewritten after each part, and the run's Markdown section appended line by
line), so that a run killed by a time limit keeps every part that finished; and the run's dated log under
``bench/results/`` that ``--append`` adds the section to.

A part is a function ``part(ctx) -> Outcome``; :func:`run_part` times it against its budget, turns an exception into
a FAIL line (the part's error, in one line), and records it. No Ray, no pytest, no network.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from machine import ROOT  # noqa: F401  (bench/machine.py: puts platform/ on sys.path before attnlab is imported)

import torch  # noqa: E402

from gpucheck.sizes import LLMC_TOKENS_PER_S  # noqa: E402

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


def autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def llmc_reference(device: torch.device) -> tuple[str, float] | None:
    """llm.c's GPT-2 124M tokens/s per GPU for this device (H100, A100), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in LLMC_TOKENS_PER_S.items():
        if key in name:
            return key, value
    return None




def run_log(info: dict, kind: str) -> Path:
    """A run's dated log, ``bench/results/<date>-<gpu>-<kind>.md`` (``cpu`` for a run without one), from the
    machine header ``info``: one file per day, device and kind of run."""
    name = info["device"].removeprefix("NVIDIA ").split()[0] if info["driver"] else "cpu"
    name = "".join(c for c in name.lower() if c.isalnum())
    return ROOT / "bench" / "results" / f"{info['date'][:10]}-{name}-{kind}.md"


def append_log(path: str | None, info: dict, kind: str, text: str) -> Path:
    """Append a run's section to ``path``, or to its dated log (:func:`run_log`; a second run that day goes below
    the first); the file written to."""
    path = Path(path) if path is not None else run_log(info, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    below = path.exists() and path.stat().st_size > 0
    with open(path, "a") as f:
        f.write(("\n" if below else "") + text.lstrip("\n"))
    return path


class Tee:
    """Everything said goes to stdout and into a buffer (the section appended to the run's log)."""

    def __init__(self, stream):
        self.stream, self.lines = stream, []

    def write(self, text):
        self.lines.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def text(self) -> str:
        return "".join(self.lines)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (an out-of-memory error says OOM)."""
    if is_oom(exc):
        return "OOM"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:limit]}"


# --- the quick check's parts: outcome, context, recorder ---------------------------------------------------------

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Outcome:
    """What a part found: PASS, FAIL or SKIP, its figures in one line, and every figure for the JSON file."""

    status: str
    figures: str
    data: dict = field(default_factory=dict)


@dataclass
class Context:
    """What every part is handed."""

    sizes: object
    device: torch.device
    clock: "Clock"
    compile_backend: str | None  # None: eager (the CPU smoke run); "inductor" on the GPU
    background: object = None  # gpucheck.background.Background: workers and warmers started with the check


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Recorder:
    """The run's results as they come: ``json_path`` rewritten whole after each part (atomically: a reader never
    sees half a file), ``lines_path`` appended one line per part (flushed and synced): the run's section."""

    def __init__(self, json_path: Path | None, lines_path: Path | None, results: dict):
        self.json_path, self.lines_path, self.results = json_path, lines_path, results
        self.results.setdefault("parts", {})
        for path in (json_path, lines_path):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        if lines_path is not None:
            lines_path.write_text("")
        self.save()

    def save(self) -> None:
        if self.json_path is not None:
            _atomic_write(self.json_path, json.dumps(self.results, indent=1, default=str))

    def line(self, text: str) -> None:
        """One line of the run's section, written at once."""
        if self.lines_path is not None:
            with open(self.lines_path, "a") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())

    def record(self, key: str, title: str, outcome: Outcome, seconds: float, budget_s: float) -> str:
        self.results["parts"][key] = {"title": title, "status": outcome.status, "figures": outcome.figures,
                                      "seconds": round(seconds, 1), "budget_s": budget_s, **outcome.data}
        self.save()
        over = f", over its {budget_s:.0f} s" if seconds > budget_s else ""
        row = f"| {title} | {outcome.status} | {outcome.figures} | {seconds:.0f} s{over} |"
        self.line(row)
        return row


def wait_for_warmers(ctx: Context, prefix: str, fraction: float) -> bool | None:
    """Wait for the background warmers whose names start with ``prefix`` (:mod:`gpucheck.background`), at most
    ``fraction`` of the part's budget; True when they all ended, False when not, None when there are none."""
    keys = ctx.background.keys(prefix) if ctx.background is not None else []
    if not keys:
        return None
    done = ctx.background.wait(keys, ctx.clock.part_start + ctx.clock.part_budget * fraction)
    say(f"compiled ahead in the background: {'done' if done else 'not finished; compiling here too'}")
    return done


def run_part(ctx: Context, recorder: Recorder, key: str, title: str, budget_s: float, part) -> Outcome:
    """Run ``part(ctx)`` within ``budget_s`` (its items check ``ctx.clock.expired()``; the overall deadline skips
    a part that would start after it), print its one line, and record it."""
    if time.monotonic() - ctx.clock.start > ctx.clock.total_s:
        outcome, seconds = Outcome(SKIP, f"not started: the run's {ctx.clock.total_s / 60:.0f} min were spent"), 0.0
    else:
        ctx.clock.begin(budget_s)
        say(f"\n--- {title}" + (f" (budget {budget_s:.0f} s)" if budget_s < 1e8 else " (no budget)"))
        try:
            outcome = part(ctx)
        except Exception as exc:  # noqa: BLE001 - a part that breaks is a FAIL line, and the next part runs
            outcome = Outcome(FAIL, one_line(exc), {"error": one_line(exc, 2000),
                                                     "traceback": traceback.format_exc()[-4000:]})
            say(traceback.format_exc()[-4000:])
        finally:
            free_memory(ctx.device)
        seconds = ctx.clock.part_elapsed()
    recorder.record(key, title, outcome, seconds, budget_s)
    say(f"{title}: {outcome.status} - {outcome.figures} ({seconds:.0f} s)")
    return outcome
