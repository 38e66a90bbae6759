"""``attnlab eval CHECKPOINT``: argument handling and the printed tables only; the work is
:func:`attnlab.evaluate.evaluate_checkpoint`. Lists (lengths, p_eval, rope) are parsed in the handler so a bad
value is a one-line ``UserError``. No Ray here; torch is imported only when the command runs.
"""

from __future__ import annotations

import sys

_METRIC_ORDER = ("val_loss", "acc", "bpb", "loss_bucket", "entropy", "sink_mass", "passkey_acc", "passkey_rank")


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
                   help="a checkpoint folder, or a run folder (its latest checkpoint)")
    p.add_argument("--data", help="prepared data folder (default: the checkpoint's training data)")
    p.add_argument("--lengths", help="comma-separated eval lengths, e.g. 1024,2048 or 1k,2k "
                   "(default: --multiples x the training length)")
    p.add_argument("--multiples", default="1,2,4,8,16",
                   help="multiples of the training length when --lengths is not given (default 1,2,4,8,16)")
    p.add_argument("--p-eval", default="none",
                   help="sharpening powers at evaluation, e.g. none,3,15 (none = the attention as trained, "
                   "including its p_train; a number replaces it at evaluation; default none)")
    p.add_argument("--rope", default="ntk", help="RoPE scaling beyond the training length: ntk, none or both "
                   "(default ntk)")
    p.add_argument("--max-tokens", help="target tokens scored at every length (default: all the largest "
                   "length allows, capped at 131072 on CPU / 4194304 on CUDA)")
    p.add_argument("--long-docs", action="store_true",
                   help="also evaluate on windows inside documents of at least L+1 tokens (window_mode long_docs)")
    p.add_argument("--passkey", action="store_true", help="also score passkey retrieval by length and depth")
    p.add_argument("--passkey-trials", default="4", help="passkey prompts per depth and length (default 4)")
    p.add_argument("--diagnostics", action="store_true",
                   help="also report per-layer attention entropy and sink mass (on 2 windows per length)")
    p.add_argument("--batch-size", help="windows per forward (default: 8 at the training length, fewer for "
                   "longer windows, at least 1)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--store", help="results store URI to write the rows to (default: none, print only)")
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


def _eval(args) -> int:
    import pandas as pd

    from attnlab.errors import UserError
    from attnlab.evaluate.extrapolation import evaluate_checkpoint, parse_lengths
    from attnlab.results import reports

    if args.format not in ("markdown", "csv"):
        raise UserError(f"--format {args.format!r} is not allowed: use markdown or csv")
    context = {}
    if args.study:
        context["study"] = args.study
    if args.trial:
        context["trial"] = args.trial
    log = None if args.quiet else (lambda message: print(message, file=sys.stderr, flush=True))
    rows = evaluate_checkpoint(
        args.checkpoint,
        data=args.data,
        lengths=None if args.lengths is None else args.lengths,
        multiples=parse_lengths(args.multiples),
        p_evals=args.p_eval,
        rope_scalings=args.rope,
        max_tokens=_positive_int("--max-tokens", args.max_tokens),
        long_docs=args.long_docs,
        passkey=args.passkey,
        passkey_trials=_positive_int("--passkey-trials", args.passkey_trials),
        diagnostics=args.diagnostics,
        batch_size=_positive_int("--batch-size", args.batch_size),
        device=args.device,
        context=context,
        store=args.store,
        log=log,
    )
    if not rows:
        raise UserError("eval produced no rows (no windows at any length?)")
    frame = pd.DataFrame(rows)
    present = [m for m in _METRIC_ORDER if m in set(frame["metric"])]
    for metric in present:
        result = reports.table(frame, metric=metric)
        if args.format == "csv":
            sys.stdout.write(f"# {metric}\n" + reports.to_csv(result))
        else:
            sys.stdout.write(f"## {metric}\n\n{reports.to_markdown(result)}\n\n")
    if args.store:
        print(f"wrote {len(rows)} rows to {args.store}", file=sys.stderr)
    return 0
