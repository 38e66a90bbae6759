"""The ``attnlab`` command.

Each area registers its own sub-commands through an ``add_parser(subparsers)`` function in its
``cli`` module, so this file stays a thin dispatcher. Bad input raises ``attnlab.errors.UserError``,
printed here as one line (``attnlab: error: ...``) with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from attnlab.errors import Interrupted, UserError

# The module that contributes each sub-command, in the order they appear in --help.
_COMMANDS = {
    "data": "attnlab.data.cli",
    "train": "attnlab.train.cli",
    "eval": "attnlab.evaluate.cli",
    "attention": "attnlab.attention.cli",
    "study": "attnlab.study.cli",
    "results": "attnlab.results.cli",
    "cluster": "attnlab.cluster.cli",
    "export": "attnlab.export.cli",
    "serve": "attnlab.serve.cli",
    "demo": "attnlab.demo",
}
_COMMAND_MODULES = tuple(_COMMANDS.values())


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every sub-command, or of ``command`` only (``attnlab results ...`` then never imports the
    training code and torch: a report answers in a second)."""
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Study how attention mechanisms extrapolate in length: data, training, evaluation, "
        "studies (Ray Tune + Optuna) and reports.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in ([_COMMANDS[command]] if command in _COMMANDS else _COMMAND_MODULES):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module must surface
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words else None)
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except UserError as exc:
        print(f"attnlab: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:  # it recorded what it had done: say so, and how to go on, as the last line
        sys.stdout.flush()
        print(exc.last_line(words), file=sys.stderr, flush=True)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("attnlab: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)



if __name__ == "__main__":
    sys.exit(main())
