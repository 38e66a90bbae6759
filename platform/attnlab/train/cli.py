"""``attnlab train``: pretrain one model with Ray Train (see ``attnlab train --help``)."""

from __future__ import annotations

import argparse
import contextlib
import threading
from pathlib import Path

import yaml

from attnlab.errors import UserError


def parse_assignments(items: list[str] | None) -> dict:
    """``["lr=3e-4", "model.n_layer=4"]`` -> ``{"lr": 3e-4, "model": {"n_layer": 4}}`` (values parsed as YAML)."""
    out: dict = {}
    for item in items or []:
        if "=" not in item:
            raise UserError(f"--set {item!r} is not KEY=VALUE (e.g. --set lr=3e-4 or --set model.n_layer=4)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw)
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="pretrain a model with Ray Train (DDP workers, checkpoints, metrics)",
                              description="Pretrain one model with Ray Train. The run folder (--out) receives "
                              "metrics.jsonl, provenance.json and the checkpoints; re-running with the same --out "
                              "resumes from the latest checkpoint.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="a YAML file of training config fields (see attnlab.train.TrainConfig)")
    src.add_argument("--preset", help="a model preset: gpt2-small, gpt2-medium, gpt2-45m, tiny, tiny-4l")
    p.add_argument("--attention", help="attention variant name (e.g. softmax, lssa, lssar, or a plugin's variant)")
    p.add_argument("--plugin", action="append", metavar="FILE_OR_MODULE",
                   help="an attention plugin (a .py file or an importable module) whose variants --attention may "
                   "name, repeatable; its source travels with the run (docs/plugins.md)")
    p.add_argument("--p-train", help="sharpening in training: default (the variant's own: 15 for lssar), off, or a "
                   "number >= 1")
    p.add_argument("--scale", help="scale factor: inv_sqrt_d, log_n, logd_logn or '<coef>*log_n'")
    p.add_argument("--data", help="a data folder made by `attnlab data prepare` (a path or an s3://, gs:// URI), or "
                   "demo (the offline demo corpus in GPT-2 tokens, prepared on first use) or demo-bytes (the same "
                   "corpus in UTF-8 bytes)")
    p.add_argument("--out", required=True, help="the run folder (a path or an s3://, gs:// URI)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--seq-len", type=int, help="training length (default: the preset's)")
    p.add_argument("--tokens-per-step", type=int, help="tokens per optimizer step (gradient accumulation fills it)")
    p.add_argument("--micro-batch", type=_micro_batch, help="sequences per worker per micro-step, or auto (the "
                   "largest that fits the GPU's memory, keeping --tokens-per-step through accumulation)")
    p.add_argument("--workers", type=int, help="Ray Train workers (DDP ranks)")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL); same as --set gpus_per_worker=1")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other config field, repeatable")
    p.add_argument("--local", action="store_true", help="run in this process without Ray (one worker; debugging)")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's and Train's own output in the terminal (default: a log file, whose path is printed)")
    p.set_defaults(func=run)


def _micro_batch(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from attnlab.train.config import load_train_config

    load_plugins(args.plugin)  # a bad plugin: one line, before anything is read or written
    data = {}
    if args.config:
        path = Path(args.config)
        if not path.exists():
            raise UserError(f"--config {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise UserError(f"--config {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise UserError(f"--config {path} must hold a mapping of config fields")
    data.update(parse_assignments(args.set))
    from attnlab.data.source import resolve_data
    from attnlab.location import Location

    if args.data:
        data["data"] = args.data
    if data.get("data"):
        data["data"] = resolve_data(data["data"])  # workers run elsewhere: never hand them a relative path
    run = Location.parse(args.out, field="--out")  # the user's flag: parsed here, a Location from now on
    cfg = load_train_config(data, preset=args.preset, attention=args.attention, p_train=args.p_train,
                            scale=args.scale, steps=args.steps, seq_len=args.seq_len,
                            tokens_per_step=args.tokens_per_step, micro_batch=args.micro_batch,
                            workers=args.workers, gpus_per_worker=1.0 if args.gpu else None)
    source = _open_checked(cfg)
    print(cfg.plan(), flush=True)
    for warning in cfg.warnings():
        print(f"attnlab: warning: {warning}", flush=True)
    print(f"run folder: {run.uri}", flush=True)
    with _progress(run, cfg.steps):
        if args.local:
            from attnlab.train.loop import train_here
            from attnlab.runfolder import outcome

            train_here(cfg, run, source=source)  # the data opened once
            result = outcome(run, steps=cfg.steps)
        else:
            from attnlab.ray_runtime import ensure_ray, log_file, quiet_ray
            from attnlab.train.ray_train import run_training

            if not args.verbose:
                from attnlab.cache import cache_dir

                path = log_file(run.path if run.is_local else str(cache_dir() / "logs"), "ray")
                quiet_ray(path)
                print(f"Ray's own output: {path}", flush=True)
            ensure_ray(log_to_driver=args.verbose)
            result = run_training(cfg, run)
    final = result.final
    print(f"status: {result.status}; step {final.get('step')}; train_loss {final.get('train_loss')}; "
          f"val_loss {final.get('val_loss')}")
    print(f"latest checkpoint: {result.checkpoint}")
    if result.failure:
        print(f"failure: {result.failure}")
        return 1
    return 0


def load_plugins(refs: list[str] | None) -> None:
    """Load each ``--plugin`` (docs/plugins.md): its variants join the registry for this command."""
    from attnlab.attention import load_plugin

    for ref in refs or []:
        load_plugin(ref)


def _open_checked(cfg):
    """Open the run's data (once, in this process) and check the config fits it before any worker starts."""
    from attnlab.data.source import open_data

    if not cfg.data:
        raise UserError("train.data is required: a folder made by `attnlab data prepare`, or {synthetic: TASK}")
    source = open_data(cfg.data)
    cfg.check_fits_data(source.vocab_size, source.min_tokens(), source.describe())
    cfg.batch_plan(cfg.workers)
    return source


@contextlib.contextmanager
def _progress(run, steps: int):
    """Print the run's progress (step, losses, time left) from its metrics while the block runs."""
    from attnlab.runfolder import watch

    stop = threading.Event()
    thread = threading.Thread(target=watch, args=(run, steps, stop, lambda line: print(line, flush=True)),
                              kwargs={"interval": 2.0}, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
