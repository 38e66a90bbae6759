"""Figures and numbers for docs/probe-seeds.md: why LSSAR's 16x copy accuracy depends on the seed.

Reads what `attnlab study run studies/probe_copy.yaml` left behind (the results store and the run folders) and,
optionally, run folders trained with intermediate checkpoints (``--trajectory``). Uses the platform's own pieces:
``ResultsStore``/``reports`` for the per-seed table, ``evaluate.score_windows`` for accuracy,
``evaluate.diagnostics.offset_profile`` for where attention lands. It only reads runs and writes PNG/JSON into
``--out``; it trains nothing.

    python docs/probe-seeds/analyse.py --store runs-probe/results --runs runs-probe/runs \
        [--trajectory RUN_DIR ...] --out docs/probe-seeds
    python docs/probe-seeds/analyse.py --figures-only --out docs/probe-seeds   # redraw from summary.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from pathlib import Path

import numpy as np
import torch

from attnlab.data.generators.synthetic import open_task
from attnlab.evaluate.diagnostics import offset_profile
from attnlab.evaluate.measure import score_windows
from attnlab.model.checkpoint import META_FILE, STATE_FILE, load_model
from attnlab.results import ResultsStore, reports

LENGTHS = (64, 1024)
DIAG_WINDOWS = 16  # windows per length for the offset profile (16 x 32 = 512 scored query rows)


def study_runs(runs: str, study: str = "probe_copy") -> list[dict]:
    """[{attention, seed, run_dir}] of a study's trials (from runs/<study>/trials/*.json)."""
    out = []
    for path in sorted(glob.glob(os.path.join(runs, study, "trials", "*.json"))):
        with open(path, encoding="utf-8") as handle:
            info = json.load(handle)
        point = info.get("point", {})
        out.append(dict(attention=point.get("attention"), seed=point.get("seed"), run_dir=info["run_dir"]))
    return out


def eval_data(config: dict, length: int, n: int | None = None):
    source = open_task(config["data"])
    windows, mask = source.eval_set(length, max_tokens=None, seed=int(config.get("data_seed", 0)))
    return (windows, mask) if n is None else (windows[:n], mask[:n])


def accuracy(model, config, length: int) -> float:
    windows, mask = eval_data(config, length)
    return score_windows(model, windows, mask, batch_size=max(1, 512 // length), device=torch.device("cpu"),
                         rope_scaling="none").acc


def where_mass_lands(model, config, length: int) -> list[dict]:
    windows, mask = eval_data(config, length, DIAG_WINDOWS)
    distance = int(config["data"].get("distance", config["data"]["copy_len"]))
    profiles = offset_profile(model, windows, mask, max_offset=model.cfg.train_len, rope_scaling="none")
    for p in profiles:
        p["source"] = float(p["profile"][distance - 1])  # the key holding the token to copy
        p["top_source"] = float(p["top"][distance - 1])  # rows whose largest weight is on it
        p["local_other"] = float(p["profile"].sum()) - p["source"]
    return profiles


def covered_rows(model, config, length: int = 1024, layer: int = 1) -> dict:
    """Row by row at ``length``: is the prediction right, and is the copy source the top key of some head of
    ``layer``? (What the averaged profile cannot say: whether the heads cover the same rows or split them.)"""
    from attnlab.attention.dense import weights_for_rows

    windows, mask = eval_data(config, length, DIAG_WINDOWS)
    distance = int(config["data"].get("distance", config["data"]["copy_len"]))
    correct, top, mass = [], [], []
    for window, rows_mask in zip(windows, mask):
        rows = np.nonzero(rows_mask)[0]
        captured = {}

        def observe(index, q, k):
            if index == layer:
                a = weights_for_rows(q[..., rows[0]:, :], k, model.spec, row_start=int(rows[0]), seq_len=q.shape[2])[0]
                captured["w"] = a.abs() / a.abs().sum(-1, keepdim=True)

        with torch.no_grad():
            hidden = model.hidden_states(torch.as_tensor(window[None, :-1]), rope_scaling="none", on_attention=observe)
            predicted = model.lm_head(hidden)[0].argmax(-1).numpy()
        w = captured["w"][:, rows - rows[0], :]  # (H, R, T)
        source = torch.as_tensor(rows - (distance - 1))
        correct.append(predicted[rows] == window[1:][rows])
        top.append((w.argmax(-1) == source[None, :]).numpy())
        mass.append(w[:, torch.arange(len(rows)), source].numpy())
    correct, top, mass = np.concatenate(correct), np.concatenate(top, 1), np.concatenate(mass, 1)
    covered = top.any(0)
    return dict(acc=float(correct.mean()), covered=float(covered.mean()), both=float(top.all(0).mean()),
                acc_covered=float(correct[covered].mean()) if covered.any() else float("nan"),
                acc_uncovered=float(correct[~covered].mean()) if (~covered).any() else float("nan"),
                source_mass_sum=float(mass.sum(0).mean()))


def copy_head(profiles_1x: list[dict]) -> tuple[int, int]:
    """The (layer, head) putting the most mass on the copy source at 1x."""
    best = max(profiles_1x, key=lambda p: p["source"])
    return best["layer"], best["head"]


def checkpoint_step(directory: Path) -> int | None:
    """The step a checkpoint folder records (its meta.json), or None when it is not a whole checkpoint."""
    try:
        if not (directory / STATE_FILE).is_file():
            return None
        return int(json.loads((directory / META_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoints(run_dir: str) -> list[tuple[int, str]]:
    found = []
    for d in glob.glob(os.path.join(run_dir, "checkpoint_*")) + glob.glob(os.path.join(run_dir, "checkpoints", "step_*")):
        step = checkpoint_step(Path(d))
        if step is not None:
            found.append((step, d))
    return sorted(found)


def trajectory(run_dir: str, out: str) -> dict:
    """Accuracy at 1x/16x and the copy head's source mass at 16x for every checkpoint of a run folder
    (cached in ``out/trajectory_<run>.json``)."""
    cache = os.path.join(out, f"trajectory_{os.path.basename(os.path.normpath(run_dir))}.json")
    if os.path.exists(cache):
        with open(cache, encoding="utf-8") as handle:
            return json.load(handle)
    points = []
    config = None
    for step, directory in checkpoints(run_dir):
        model, config, _ = load_model(directory)
        prof = where_mass_lands(model, config, 1024)
        prof1 = where_mass_lands(model, config, 64)
        layer, head = copy_head(prof1)
        at16 = next(p for p in prof if (p["layer"], p["head"]) == (layer, head))
        points.append(dict(step=step, acc1=accuracy(model, config, 64), acc16=accuracy(model, config, 1024),
                           copy_head=[layer, head], source16=at16["source"], beyond16=at16["beyond"],
                           top16=at16["top_source"], top_beyond16=at16["top_beyond"],
                           top16_any=max(p["top_source"] for p in prof),
                           heads={str(length): [dict(layer=p["layer"], head=p["head"], source=p["source"],
                                                     top_source=p["top_source"], beyond=p["beyond"],
                                                     top_beyond=p["top_beyond"], entropy=p["entropy"])
                                                for p in profiles]
                                  for length, profiles in ((64, prof1), (1024, prof))},
                           source1=next(p for p in prof1 if (p["layer"], p["head"]) == (layer, head))["source"]))
        print(f"{os.path.basename(run_dir)} step {step}: {points[-1]}", flush=True)
    result = dict(run=os.path.basename(os.path.normpath(run_dir)), attention=config["attention"],
                  seed=config["seed"], steps=config["steps"], points=points)
    with open(cache, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store")
    parser.add_argument("--runs")
    parser.add_argument("--figures-only", action="store_true", help="redraw the figures from OUT/summary.json")
    parser.add_argument("--trajectory", nargs="*", default=[], metavar="RUN_DIR",
                        help="run folders with intermediate checkpoints (label taken from their config)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    if args.figures_only:
        with open(os.path.join(args.out, "summary.json"), encoding="utf-8") as handle:
            figures(json.load(handle), args.out)
        return
    if not (args.store and args.runs):
        parser.error("--store and --runs are required (or --figures-only)")
    frame = ResultsStore(args.store).read(study="probe_copy", rope_scaling="none", p_eval=None)
    print(reports.to_markdown(reports.table(frame, metric="acc"), digits=3, per_seed=True))

    summary = {"runs": []}
    for run in study_runs(args.runs):
        model, config, meta = load_model(run["run_dir"])
        record = dict(attention=run["attention"], seed=run["seed"], step=meta["step"], lengths={})
        for length in LENGTHS:
            profiles = where_mass_lands(model, config, length)
            record["lengths"][length] = dict(
                acc=accuracy(model, config, length),
                heads=[dict(layer=p["layer"], head=p["head"], source=p["source"], local_other=p["local_other"],
                            beyond=p["beyond"], sink=p["sink_mass"], entropy=p["entropy"],
                            top_source=p["top_source"], top_beyond=p["top_beyond"],
                            profile=p["profile"].tolist(), top=p["top"].tolist()) for p in profiles])
        if run["attention"] == "lssar":
            record["rows_1x"] = covered_rows(model, config, 64)
            record["rows_16x"] = covered_rows(model, config)
            print(f"lssar seed {run['seed']} rows at 1x: {record['rows_1x']}; at 16x: {record['rows_16x']}", flush=True)
        summary["runs"].append(record)
        h = record["lengths"][1024]
        print(f"{run['attention']:8s} seed {run['seed']}: acc@1x {record['lengths'][64]['acc']:.3f} "
              f"acc@16x {h['acc']:.3f}; per head (layer.head: source / other<64 / beyond / entropy) at 16x: "
              + "; ".join(f"{x['layer']}.{x['head']}: {x['source']:.3f}/{x['local_other']:.3f}/{x['beyond']:.3f}/"
                          f"{x['entropy']:.2f} top@source {x['top_source']:.3f}" for x in h["heads"]), flush=True)

    trajectories = [trajectory(run_dir, args.out) for run_dir in args.trajectory]
    for t, run_dir in zip(trajectories, args.trajectory):
        if "rows_16x" not in t:
            model, config, _ = load_model(run_dir)
            t["rows_16x"] = covered_rows(model, config)
        print(f"{t['run']} (final checkpoint) rows at 16x: {t['rows_16x']}", flush=True)
    summary["trajectories"] = trajectories
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=1)

    figures(summary, args.out)
    print(f"figures in {args.out}")


def figures(summary: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    for run in summary["runs"]:  # JSON turns the length keys into text
        run["lengths"] = {int(k): v for k, v in run["lengths"].items()}

    # Figure 1: per layer-1 head, the rows whose largest weight is on the copy source, and the mass there,
    # at 1x and 16x, for every study run.
    runs = sorted(summary["runs"], key=lambda r: (("lssar", "lssa", "softmax").index(r["attention"]), r["seed"]))
    figure = Figure(figsize=(11, 6.4), dpi=100)
    panels = [figure.add_subplot(2, 1, k) for k in (1, 2)]
    colors = {(1, 0): "tab:blue", (1, 1): "tab:orange"}
    for i, run in enumerate(runs):
        for j, length in enumerate((64, 1024)):
            heads = [h for h in run["lengths"][length]["heads"] if h["layer"] == 1]
            for h in heads:
                x = i + (-0.3 if length == 64 else 0.05) + 0.13 * h["head"]
                for axes, key in zip(panels, ("top_source", "source")):
                    axes.bar(x, h[key], width=0.12, color=colors[(1, h["head"])], alpha=0.45 if length == 64 else 1.0,
                             label=f"head 1.{h['head']} at {'1x' if length == 64 else '16x'}" if i == 0 else None)
        panels[0].text(i, 1.04, f"acc {run['lengths'][64]['acc']:.3f} / {run['lengths'][1024]['acc']:.3f}",
                       ha="center", fontsize=7)
    for axes in panels:
        axes.set_xticks(range(len(runs)))
        axes.set_xticklabels([f"{r['attention']} s{r['seed']}" for r in runs], fontsize=8)
        axes.set_ylim(0, 1.12)
        axes.grid(True, axis="y", alpha=0.3)
    panels[0].set_ylabel("rows whose top key\nis the copy source")
    panels[1].set_ylabel("mean attention mass\non the copy source")
    panels[0].set_title("Layer-1 heads on the scored rows (probe_copy, 800 steps, rope none); "
                        "text: copy accuracy at 1x / 16x", fontsize=10)
    panels[1].legend(fontsize=7, ncol=4, loc="upper right")
    figure.tight_layout()
    figure.savefig(os.path.join(out, "heads_1x_16x.png"))

    # Figure 2: the 1x offset profile of the layer-1 heads, a good seed against the seed that split its rows.
    picks = [r for r in runs if r["attention"] == "lssar"]
    figure = Figure(figsize=(11, 3.6), dpi=100)
    for k, run in enumerate(picks):
        axes = figure.add_subplot(1, len(picks), k + 1)
        for h in (h for h in run["lengths"][64]["heads"] if h["layer"] == 1):
            axes.plot(range(len(h["profile"])), h["profile"], marker=".", color=colors[(1, h["head"])],
                      label=f"head 1.{h['head']}")
        axes.axvline(31, color="0.5", linestyle=":", linewidth=1)
        axes.set_yscale("log")
        axes.set_ylim(1e-4, 1.5)
        axes.set_xlabel("key offset (tokens back); dotted: copy source")
        axes.set_title(f"lssar seed {run['seed']}: acc {run['lengths'][64]['acc']:.3f} at 1x, "
                       f"{run['lengths'][1024]['acc']:.3f} at 16x", fontsize=9)
        if k == 0:
            axes.set_ylabel("mean weight at 1x (64 tokens)")
            axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(os.path.join(out, "profile_1x.png"))

    # Figure 4: accuracy at 16x against the layer-1 heads' summed mass on the copy source at 16x, every model.
    figure = Figure(figsize=(6.4, 4.6), dpi=100)
    axes = figure.add_subplot(1, 1, 1)
    markers = {"lssar": "o", "lssa": "s", "softmax": "^"}
    for attention in ("lssar", "lssa", "softmax"):
        xs = [sum(h["source"] for h in r["lengths"][1024]["heads"] if h["layer"] == 1) for r in runs
              if r["attention"] == attention]
        ys = [r["lengths"][1024]["acc"] for r in runs if r["attention"] == attention]
        axes.scatter(xs, ys, marker=markers[attention], s=60, label=f"{attention}, probe_copy runs (800 steps)",
                     zorder=3)
    for t in summary.get("trajectories") or []:
        xs = np.array([sum(h["source"] for h in p["heads"]["1024"] if h["layer"] == 1) for p in t["points"]])
        ys = np.array([p["acc16"] for p in t["points"]])
        learned = np.array([p["acc1"] >= 0.99 for p in t["points"]])
        dots = axes.scatter(xs[learned], ys[learned], marker="o", s=14, alpha=0.8,
                            label=f"{t['attention']} seed {t['seed']} checkpoints ({t['steps']}-step schedule)")
        axes.scatter(xs[~learned], ys[~learned], marker="o", s=14, facecolors="none",
                     edgecolors=dots.get_facecolor()[0])
    axes.scatter([], [], marker="o", s=14, facecolors="none", edgecolors="0.4",
                 label="hollow: checkpoint with acc < 0.99 at 1x (task not yet learned)")
    axes.set_xlabel("layer-1 heads' attention mass on the copy source at 16x, summed over the 2 heads")
    axes.set_ylabel("copy accuracy at 16x")
    axes.set_title("16x accuracy against the mass the copy heads keep on the source", fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=6, loc="upper left")
    figure.tight_layout()
    figure.savefig(os.path.join(out, "acc_vs_source_mass.png"))

    # Figure 3: accuracy and the layer-1 heads' top-on-source rows at 16x against training step.
    trajectories = summary.get("trajectories") or []
    if trajectories:
        figure = Figure(figsize=(11, 4.2), dpi=100)
        left, right = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
        for t in trajectories:
            steps = [p["step"] for p in t["points"]]
            label = f"{t['attention']} seed {t['seed']}, {t['steps']}-step schedule"
            line = left.plot(steps, [p["acc16"] for p in t["points"]], marker="o", markersize=3, label=label)[0]
            left.plot(steps, [p["acc1"] for p in t["points"]], linestyle=":", color=line.get_color())
            for head, style in ((0, "-"), (1, "--")):
                values = [next(h["top_source"] for h in p["heads"]["1024"] if (h["layer"], h["head"]) == (1, head))
                          for p in t["points"]]
                right.plot(steps, values, linestyle=style, color=line.get_color(), marker="o", markersize=3)
        left.set_xlabel("training step")
        left.set_ylabel("copy accuracy (solid: 16x, dotted: 1x)")
        left.set_title("accuracy vs training step", fontsize=10)
        right.set_xlabel("training step")
        right.set_ylabel("rows whose top key is the source, at 16x")
        right.set_title("layer-1 heads at 16x (solid: head 1.0, dashed: head 1.1)", fontsize=10)
        for axes in (left, right):
            axes.grid(True, alpha=0.3)
            axes.set_ylim(-0.02, 1.05)
        left.legend(fontsize=7, loc="lower right")
        figure.tight_layout()
        figure.savefig(os.path.join(out, "acc_vs_step.png"))


if __name__ == "__main__":
    main()
