"""The ``attnlab`` command.

Each area registers its own sub-commands through an ``add_parser(subparsers)`` function in its
``cli`` module, so this file stays a thin dispatcher. Bad input raises ``attnlab.errors.UserError``,
printed here as one line (``attnlab: error: ...``) with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from attnlab.errors import UserError

# Modules that contribute sub-commands, in the order they appear in --help.
_COMMAND_MODULES = (
    "attnlab.data.cli",
    "attnlab.train.cli",
    "attnlab.evaluate.cli",
    "attnlab.attention.cli",
    "attnlab.study.cli",
    "attnlab.results.cli",
    "attnlab.cluster.cli",
    "attnlab.serve.cli",
    "attnlab.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Study how attention mechanisms extrapolate in length: data, training, evaluation, "
        "studies (Ray Tune + Optuna) and reports.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module must surface
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except UserError as exc:
        print(f"attnlab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnlab: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
