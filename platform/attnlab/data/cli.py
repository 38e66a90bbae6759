"""``attnlab data prepare`` and ``attnlab data verify``: argument parsing only, the work is in prepare/shards.

Never imports Ray or ``datasets`` at module level (``attnlab --help`` stays fast).
"""

from __future__ import annotations

import argparse
import json

from attnlab.data.pipeline.corpora import SOURCE_KINDS
from attnlab.data.tokenizer import DEFAULT_TOKENIZER, TOKENIZERS


def _positive_int(text: str) -> int:
    try:
        value = int(float(text)) if "e" in text.lower() else int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def add_parser(subparsers) -> None:
    data = subparsers.add_parser("data", help="prepare and verify token shards",
                                 description="Tokenise a corpus into Arrow token shards and check them.")
    sub = data.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    p = sub.add_parser(
        "prepare",
        help="tokenise a source (GPT-2 BPE or UTF-8 bytes) into shuffled train/val Arrow shards",
        description="Tokenise documents with tiktoken gpt2 (EOT 50256 before each) or, with --tokenizer bytes, as "
        "UTF-8 bytes (end-of-document 256 before each; 257 ids), shuffle them with --seed, "
        "hold out whole documents for validation, and write train-NNNNN.arrow / val-NNNNN.arrow + manifest.json. "
        "Resumable: re-run the same command after an interruption. Parallel over Ray tasks (set RAY_ADDRESS to "
        "use a running cluster; otherwise a local one is started).",
    )
    p.add_argument("--source", required=True, choices=SOURCE_KINDS,
                   help="fineweb (HF datasets, streaming), parquet/jsonl files or globs, text folder, or demo "
                   "(offline public-domain corpus, ~2.1M tokens)")
    p.add_argument("--path", help="fineweb: hub id or local folder laid out like it (default HuggingFaceFW/fineweb;"
                   " alias fineweb-edu); parquet/jsonl: file, folder or glob; text: folder")
    p.add_argument("--name", help="fineweb config (default sample-10BT; e.g. sample-100BT, CC-MAIN-2024-10)")
    p.add_argument("--text-column", default="text", help="column holding the text (default: text)")
    p.add_argument("--out", required=True, help="output folder or pyarrow URI (s3://..., gs://...)")
    p.add_argument("--shard-tokens", type=_positive_int, default=100_000_000,
                   help="tokens per shard (default 100000000)")
    p.add_argument("--val-tokens", type=_positive_int, default=None,
                   help="validation budget in tokens, whole documents (default: 100M capped at 10%% of the "
                   "corpus; 0 = none)")
    p.add_argument("--seed", type=int, default=0, help="document shuffle seed (default 0)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default=DEFAULT_TOKENIZER,
                   help="gpt2 (tiktoken's GPT-2 BPE, 50,257 ids) or bytes (UTF-8 bytes + an end-of-document symbol, "
                   "257 ids: the CPU proxy's small vocabulary); recorded in the manifest (default gpt2)")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="parallel tasks (1 = no Ray; default: all CPUs)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (the summary line is still printed)")
    p.set_defaults(func=_prepare)

    v = sub.add_parser("verify", help="re-check every shard's sha256, token and document counts",
                       description="Re-read every shard named in DIR/manifest.json; exit 2 naming each missing "
                       "or corrupt shard.")
    v.add_argument("dir", help="a folder written by attnlab data prepare (or a pyarrow URI)")
    v.set_defaults(func=_verify)


def _prepare(args) -> int:
    from attnlab.data.pipeline.prepare import prepare

    result = prepare(
        args.source, args.path, args.out, name=args.name, text_column=args.text_column,
        shard_tokens=args.shard_tokens, val_tokens=args.val_tokens, seed=args.seed, workers=args.workers,
        progress=not args.quiet, tokenizer=args.tokenizer,
    )
    if args.quiet or result["already_prepared"]:
        print(result["summary"])
    return 0


def _verify(args) -> int:
    from attnlab.data.shards import verify

    summary = verify(args.dir)
    print(f"ok: {summary['shards']} shard(s), tokens {json.dumps(summary['tokens'])}, docs {json.dumps(summary['docs'])}")
    return 0
