"""The full run's targets and its summary: one line per part, PASSED, FAILED or INCOMPLETE."""

from __future__ import annotations

import torch

from gpucheck.harness import fmt, llmc_reference, say
from gpucheck.sizes import TARGETS, variant_label


def targets(results: dict, device: torch.device) -> list[dict]:
    """The issue's four targets, measured: each with its figure, the threshold and met / not met / not measured."""
    out = []
    att = [r for r in results.get("attention", []) if r.get("variant") == "lssar" and r.get("backend") == "triton"]
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


