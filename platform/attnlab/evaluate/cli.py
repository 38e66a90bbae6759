"""``attnlab eval CHECKPOINT``: argument handling and the printed tables only; the work is
:func:`attnlab.evaluate.evaluate_checkpoint`. The flags' lists (lengths, p_eval, rope) are parsed here into an
``EvalConfig``, so a bad value is a one-line ``UserError``. No Ray here; torch is imported only when the command
runs.
"""

from __future__ import annotations

import sys

_METRIC_ORDER = ("val_loss", "acc", "acc_norm", "perplexity", "word_perplexity", "byte_perplexity", "bpb", "coord_err_au", "loss_bucket", "entropy", "sink_mass", "passkey_acc",
                 "passkey_rank")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="validation loss of a checkpoint at 1x..16x its training length (x p_eval x RoPE scaling)",
        description="Evaluate a checkpoint at several lengths: validation loss on non-overlapping windows "
        "with the same token budget at every length, bits per byte, loss per position bucket "
        "(early/middle/late thirds), optionally long documents only, passkey retrieval and per-layer attention "
        "entropy / sink mass. Sharpening at evaluation (--p-eval) never changes the weights. Prints one table "
        "per metric; --store also writes the rows to a results store.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint folder, or a run folder (its latest checkpoint); a path or an s3://, gs:// URI")
    p.add_argument("--data", help="prepared data folder (default: the checkpoint's training data)")
    p.add_argument("--plugin", action="append", metavar="FILE_OR_MODULE",
                   help="an attention plugin to load first, repeatable; not needed for a run trained by attnlab "
                   "(it records its plugin's source), and refused when its bytes differ from those the run records")
    p.add_argument("--lengths", help="comma-separated eval lengths, e.g. 1024,2048 or 1k,2k "
                   "(default: --multiples x the training length)")
    p.add_argument("--multiples", default=None,
                   help="multiples of the training length when --lengths is not given (default 1,2,4,8,16; "
                   "with --downstream: 1)")
    p.add_argument("--p-eval", default="none",
                   help="sharpening powers at evaluation, e.g. none,3,15 (none = the attention as trained, "
                   "including its p_train; a number replaces it at evaluation; default none)")
    p.add_argument("--rope", default="ntk", help="RoPE scalings beyond the training length, comma-separated: ntk, none, "
                   "pi (position interpolation), yarn (as its reference code), yarn_paper (the paper's ramp), "
                   "dynamic:F (transformers' dynamic NTK, factor F), or both (= ntk,none); default ntk "
                   "(docs/protocol.md#rope-at-evaluation)")
    p.add_argument("--max-tokens", help="target tokens scored at every length, whatever the device (default "
                   "262144): max-tokens // L windows of length L")
    p.add_argument("--long-docs", action="store_true",
                   help="also evaluate on windows inside documents of at least L+1 tokens (window_mode long_docs)")
    p.add_argument("--passkey", action="store_true", help="also score passkey retrieval by length and depth")
    p.add_argument("--passkey-trials", default="4", help="passkey prompts per depth and length (default 4)")
    p.add_argument("--diagnostics", action="store_true",
                   help="also report per-layer attention entropy and sink mass (on 2 windows per length)")
    p.add_argument("--force-probe", choices=("finetune", "linear"), default=None,
                   help="orbit models: also fit a force probe (finetune: Vafa et al.'s fine-tuned force head; linear: "
                        "a ridge probe on frozen states) and run symbolic regression on its forces (docs/orbits.md)")
    p.add_argument("--downstream", metavar="TASKS",
                   help="comma-separated lm-evaluation-harness tasks (e.g. hellaswag,arc_easy,lambada_openai) scored "
                   "at --lengths / --multiples (default: the training length) instead of validation windows "
                   "(docs/downstream.md; needs pip install 'attnlab[downstream]')")
    p.add_argument("--tasks-dir", help="with --downstream: a folder (path or URI) of task configs and their data "
                   "prepared ahead (default: the harness's own tasks, data from the datasets cache)")
    p.add_argument("--num-fewshot", default="0", help="with --downstream: few-shot examples per prompt (default 0)")
    p.add_argument("--limit", help="with --downstream: at most this many documents per task (a quick look)")
    p.add_argument("--windows", action="store_true",
                   help="with --downstream: also score the validation windows at --lengths / --multiples")
    p.add_argument("--batch-size", help="windows per forward (default: 8 at the training length, fewer for "
                   "longer windows, at least 1)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--store", help="results store (a path or an s3://, gs:// URI) to write the rows to (default: none, "
                   "print only); cells already stored for this checkpoint are written again")
    p.add_argument("--study", help="study name of the rows (default: adhoc)")
    p.add_argument("--trial", help="trial name of the rows (default: the run folder's name)")
    p.add_argument("--format", default="markdown", help="markdown or csv (default markdown)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_eval)


def _positive_int(name: str, text: str | None) -> int | None:
    from attnlab.errors import UserError

    if text is None:
        return None
    try:
        value = int(str(text).replace("_", ""))
    except ValueError:
        raise UserError(f"{name} {text!r} is not allowed: use a positive integer") from None
    if value < 1:
        raise UserError(f"{name} {text!r} is not allowed: use a positive integer")
    return value


def _list(text: str) -> list[str]:
    return [item.strip() for item in str(text).split(",")]


def eval_config_from_args(args):
    """The flags as an :class:`attnlab.evaluate.plan.EvalConfig` (each list parsed here; bad values: one line)."""
    from attnlab.errors import UserError
    from attnlab.evaluate.plan import EvalConfig
    from attnlab.names import ROPE_BOTH, check_scaling, parse_lengths, parse_optional_number
    from attnlab.validation import parse

    fields: dict = {}
    downstream = getattr(args, "downstream", None)
    if args.lengths is not None:
        fields["lengths"] = parse_lengths(args.lengths, field="--lengths")
    else:
        multiples = []
        for item in _list(args.multiples or ("1" if downstream else "1,2,4,8,16")):
            try:
                multiples.append(float(item))
            except ValueError:
                raise UserError(f"--multiples {item!r} is not allowed: use positive numbers, e.g. 1,2,4,8,16") from None
        fields["multiples"] = multiples
    p_evals = []
    for item in _list(args.p_eval):
        p = None if item.lower() == "train" else parse_optional_number(item, "--p-eval", minimum=1.0)
        if p not in p_evals:
            p_evals.append(p)
    fields["p_eval"] = p_evals
    ropes = []
    for item in _list(args.rope):
        try:
            names = list(ROPE_BOTH) if item == "both" else [check_scaling(item, "--rope").label]
        except UserError as exc:
            raise UserError(f"{exc} (or both: ntk,none)") from None
        for name in names:
            if name not in ropes:
                ropes.append(name)
    fields["rope_scaling"] = ropes
    for flag, name in (("--max-tokens", "max_tokens"), ("--passkey-trials", "passkey_trials"),
                       ("--batch-size", "batch_size")):
        value = _positive_int(flag, getattr(args, name))
        if value is not None:
            fields[name] = value
    fields.update(long_docs=args.long_docs, passkey=args.passkey, diagnostics=args.diagnostics)
    if getattr(args, "force_probe", None):
        fields["force_probe"] = {"kind": args.force_probe}
    if downstream:
        down: dict = {"tasks": downstream, "num_fewshot": _nonnegative_int("--num-fewshot", args.num_fewshot)}
        if args.tasks_dir:
            down["data"] = args.tasks_dir
        if args.limit is not None:
            down["limit"] = _positive_int("--limit", args.limit)
        fields["downstream"] = down
        fields["windows"] = bool(args.windows)
    else:
        for flag, name in (("--tasks-dir", "tasks_dir"), ("--limit", "limit"), ("--windows", "windows")):
            if getattr(args, name, None):
                raise UserError(f"{flag} is only allowed with --downstream TASKS")
    config = parse(EvalConfig, fields, prefix="eval")
    if downstream and config.downstream.lengths is None and args.lengths is not None:
        config = config.model_copy(update={"downstream": config.downstream.model_copy(
            update={"lengths": config.eval_lengths(1)})})
    elif downstream and config.downstream.lengths is None and args.multiples is not None:
        config = config.model_copy(update={"downstream": config.downstream.model_copy(
            update={"multiples": config.multiples})})
    return config


def _nonnegative_int(name: str, text: str) -> int:
    from attnlab.errors import UserError

    try:
        value = int(str(text).replace("_", ""))
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"{name} {text!r} is not allowed: use 0 or a positive integer")
    return value


def _eval(args) -> int:
    import pandas as pd

    from attnlab.errors import UserError
    from attnlab.evaluate.extrapolation import evaluate_checkpoint
    from attnlab.location import Location
    from attnlab.results import LAW_METRIC, reports

    if args.format not in ("markdown", "csv"):
        raise UserError(f"--format {args.format!r} is not allowed: use markdown or csv")
    from attnlab.attention import load_plugin

    for ref in args.plugin or []:
        load_plugin(ref)
    config = eval_config_from_args(args)
    context = {}
    if args.study:
        context["study"] = args.study
    if args.trial:
        context["trial"] = args.trial
    log = None if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    data = None
    if args.data:
        from attnlab.data.source import resolve_data

        data = resolve_data(args.data)
    rows = evaluate_checkpoint(Location.parse(args.checkpoint, field="CHECKPOINT"), config, data=data,
                               context=context, store=args.store, device=args.device, log=log)
    if not rows:
        raise UserError("eval produced no rows (no windows at any length?)")
    frame = pd.DataFrame(rows)
    if "task" in frame.columns:
        frame["task"] = frame["task"].astype(object).where(frame["task"].notna(), None)
    present = [m for m in _METRIC_ORDER if m in set(frame["metric"])]
    for metric in present:
        result = reports.table(frame, metric=metric)
        if args.format == "csv":
            sys.stdout.write(f"# {metric}\n" + reports.to_csv(result))
        else:
            sys.stdout.write(f"## {metric}\n\n{reports.to_markdown(result)}\n\n")
    if LAW_METRIC in set(frame["metric"]):
        laws = reports.laws(frame)
        sys.stdout.write(reports.laws_to_csv(laws) if args.format == "csv" else
                         f"## recovered force law\n\n{reports.laws_to_markdown(laws)}\n")
    if args.store:
        print(f"wrote {len(rows)} rows to {args.store}", file=sys.stderr)
    return 0
