"""The result tables of docs/, written from a results store by the command each one names: never retyped.

A table sits in a marked block:

    <!-- table study=proxy_text: attnlab results table --study proxy_text --where rope_scaling=none --digits 3 -->
    | variant | ... |
    <!-- end table -->

A block's command is an ``attnlab results table``, ``results compare`` (a verdict, or several as one Holm family:
several ``--b``/``--at``, or ``--pairs FILE`` with FILE relative to the repository's root) or ``results laws``; a
table whose columns are several metrics names one command per metric, separated by `` ; ``. Its body is what
the commands print, one after another (a comparison's text in a ```text fence).

``python docs/tables.py --store URI`` runs each block's commands against that store (``--store URI`` added to
each) and writes their output between the markers; a block whose study is not in the store is left as it is, and
said so. ``--check`` changes nothing and exits 1 when a block differs from what its commands print. ``--study
NAME``: only that study's blocks. Files: docs/*.md by default. tests/test_docs.py checks that every block names
its study and commands that parse and read it, and that every table of docs/findings.md is in a block.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "platform") not in sys.path:
    sys.path.insert(0, str(ROOT / "platform"))

BLOCK = re.compile(r"^<!-- table study=(?P<study>[A-Za-z0-9_.-]+): (?P<command>attnlab [^\n]*?) -->\n"
                   r"(?P<body>.*?)^<!-- end table -->$", re.S | re.M)
SEPARATOR = re.compile(r"\s;\s")  # between the commands of one block
REPORTS = ("table", "compare", "laws")  # the `attnlab results` reports a block may run


def blocks(text: str):
    """Each block's match: ``study``, ``command`` and ``body`` (the lines between the markers)."""
    return list(BLOCK.finditer(text))


def commands(command: str) -> list[str]:
    """The commands a block names: one, or several separated by `` ; ``."""
    return [part.strip() for part in SEPARATOR.split(command)]


def argv_of(command: str) -> list[str]:
    """One command as the arguments of ``attnlab`` (the leading word dropped)."""
    words = shlex.split(command)
    if words[:2] != ["attnlab", "results"] or len(words) < 3 or words[2] not in REPORTS:
        raise ValueError(f"a table's command must be 'attnlab results {'|'.join(REPORTS)} ...': {command}")
    return words[1:]


def pairs_file(argv: list[str]) -> Path | None:
    """The ``--pairs FILE`` of a ``results compare``, as a path from the repository's root; None without one."""
    for i, word in enumerate(argv):
        if word.startswith("--pairs="):
            return ROOT / word.split("=", 1)[1]
        if word == "--pairs" and i + 1 < len(argv):
            return ROOT / argv[i + 1]
    return None


def _run(argv: list[str], store: str) -> str:
    from attnlab.cli import main

    at_root = []  # a --pairs file is the repository's, wherever this runs from
    for i, word in enumerate(argv):
        if word.startswith("--pairs=") or (i and argv[i - 1] == "--pairs"):
            word = ("--pairs=" if word.startswith("--pairs=") else "") + str(pairs_file(argv))
        at_root.append(word)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(at_root + ["--store", store])
    if status not in (0, None):
        raise RuntimeError(f"attnlab {shlex.join(argv)} --store {store} exited {status}")
    text = out.getvalue().rstrip("\n")
    return f"```text\n{text}\n```" if argv[:2] == ["results", "compare"] else text


def render(command: str, store: str) -> str:
    """What the block's ``command`` prints against ``store``: each command's output (a comparison's in a ```text
    fence), a blank line between two, ending in one newline."""
    return "\n\n".join(_run(argv_of(one), store) for one in commands(command)) + "\n"


def update(path: Path, store: str, study: str | None = None, check: bool = False) -> tuple[int, int, int]:
    """``(written, unchanged, absent)`` blocks of ``path``; with ``check``, nothing is written."""
    from attnlab.results import ResultsStore

    results = ResultsStore(store)
    text = path.read_text(encoding="utf-8")
    counts = [0, 0, 0]
    parts, last = [], 0
    for match in blocks(text):
        if study is not None and match["study"] != study:
            continue
        if not results.has_study(match["study"]):
            counts[2] += 1
            print(f"{path.name}: study {match['study']} is not in {store}: its block is left as it is")
            continue
        body = render(match["command"], store)
        if body == match["body"]:
            counts[1] += 1
            continue
        counts[0] += 1
        print(f"{path.name}: {match['study']}'s table {'differs from' if check else 'written by'} "
              f"{match['command']}")
        parts += [text[last:match.start("body")], body]
        last = match.end("body")
    if counts[0] and not check:
        path.write_text("".join(parts) + text[last:], encoding="utf-8")
    return counts[0], counts[1], counts[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="the results store the tables are read from (a path or a URI)")
    ap.add_argument("--study", default=None, help="only the blocks of this study")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a block differs")
    ap.add_argument("files", nargs="*", type=Path, help="Markdown files (default: docs/*.md)")
    args = ap.parse_args(argv)
    files = args.files or sorted((ROOT / "docs").glob("*.md"))
    written = sum(update(path, args.store, args.study, args.check)[0] for path in files)
    return 1 if args.check and written else 0


if __name__ == "__main__":
    sys.exit(main())
