"""The export templates' copies of attnlab's code, kept verbatim: ``python -m attnlab.export.copies [--fix]``.

A block of ``templates/*.py`` under a line ``# Copied from attnlab.MODULE.NAME`` (optionally ``with A->B, C->D``:
text replaced in the copy) is the top-level function, class or assignment ``NAME`` of that module, line for line.
Without ``--fix`` the blocks that differ from their sources are listed and the exit status is 1 (tests/test_export.py
runs this check before any logits); ``--fix`` (``make fix-copies``) rewrites them from their sources. Both list a
template that uses a name it neither defines nor imports (a copy that now calls a new helper: copy that too).

Copied: the spec, masks, row chunks, dense reference and RoPE (attention_attnlab.py); the plugin contract and its
reference path (plugin_attnlab.py); the norms, MLPs and the power as a tensor (modeling_attnlab.py). Template code,
not copied: configuration_attnlab.py (transformers' config); modeling_attnlab.py's transformers classes, the attention
layer and block (attnlab's carry backends and observers) and the call they make; ``check_scaling`` (a ValueError
where attnlab raises UserError); plugin_attnlab.py's loading of a recorded source (docs/export.md#the-modeling-code).
Reads attnlab's source files as text, never imports them.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import re
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # the attnlab package folder: the sources
TEMPLATES = Path(__file__).resolve().parent / "templates"
MARKER = re.compile(r"^# Copied from (attnlab(?:\.\w+)+)(?: with (.+))?$")
_MODULE_NAMES = {"__name__", "__file__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__"}


@dataclass(frozen=True)
class Copy:
    """One marked block: its template, the marker's line (1-based), the dotted name it copies, the replacements, and
    the block's lines in the template (``first`` .. ``last``, 1-based, inclusive)."""

    template: Path
    line: int
    source: str
    replacements: tuple[tuple[str, str], ...]
    first: int
    last: int

    def where(self) -> str:
        return f"{self.template.name}:{self.line}"


def _node_name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


@functools.lru_cache(maxsize=64)
def _spans(text: str, filename: str) -> dict[int, tuple[str | None, int]]:
    """Each top-level statement by its first line (decorators included): ``(its name or None, its last line)``."""
    spans = {}
    for node in ast.parse(text, filename).body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        spans[first] = (_node_name(node), node.end_lineno)
    return spans


def _replacements(text: str | None, where: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for part in (text or "").split(","):
        if part.strip():
            old, arrow, new = part.strip().partition("->")
            if not arrow or not old.strip():
                raise ValueError(f"{where}: 'with {text}' is not allowed: write with A->B, C->D")
            pairs.append((old.strip(), new.strip()))
    return tuple(pairs)


def find_copies(template: Path) -> tuple[list[Copy], list[str]]:
    """The marked blocks of one template, and a line for each marker that is not above a top-level definition."""
    text = template.read_text()
    spans, found, problems = _spans(text, str(template)), [], []
    for i, line in enumerate(text.splitlines(), start=1):
        match = MARKER.match(line)
        if match is None:
            if line.startswith("# Copied from"):
                problems.append(f"{template.name}:{i}: {line!r} is not a marker: write "
                                "# Copied from attnlab.MODULE.NAME")
            continue
        if i + 1 not in spans:
            problems.append(f"{template.name}:{i}: the marker is not directly above a top-level def, class or "
                            "assignment")
            continue
        try:
            replacements = _replacements(match.group(2), f"{template.name}:{i}")
        except ValueError as exc:
            problems.append(str(exc))
            continue
        found.append(Copy(template, i, match.group(1), replacements, i + 1, spans[i + 1][1]))
    return found, problems


def source_path(dotted: str, package: Path = PACKAGE) -> Path:
    """The file of ``attnlab.MODULE`` in ``attnlab.MODULE.NAME`` (ValueError when there is none)."""
    module = dotted.split(".")[:-1]
    folder = package.joinpath(*module[1:])
    path = folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")
    if not path.is_file():
        raise ValueError(f"{dotted}: attnlab has no module {'.'.join(module)}")
    return path


def source_text(dotted: str, package: Path = PACKAGE) -> str:
    """The lines of the top-level ``NAME`` of ``attnlab.MODULE`` (decorators included; ValueError when absent)."""
    path = source_path(dotted, package)
    module, name = dotted.rsplit(".", 1)
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    for first, (found, last) in _spans(text, str(path)).items():
        if found == name:
            return "".join(lines[first - 1:last])
    raise ValueError(f"{dotted}: {module} has no top-level def, class or assignment {name}")


def expected_text(copy: Copy, package: Path = PACKAGE) -> str:
    """What the block must read: its source's lines with the marker's replacements made."""
    text = source_text(copy.source, package)
    for old, new in copy.replacements:
        text = text.replace(old, new)
    return text


def _defined(text: str, filename: str) -> set[str]:
    top = symtable.symtable(text, filename, "exec")
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}


def undefined_names(template: Path) -> list[str]:
    """A line for each name the template's code reads that it neither defines, imports nor has as a builtin, and
    each name it imports from a sibling template (``from .attention_attnlab import ...``) that one does not define."""
    text = template.read_text()
    top = symtable.symtable(text, str(template), "exec")
    known = _defined(text, str(template)) | set(dir(builtins)) | _MODULE_NAMES
    problems = [f"{template.name}: the module reads {s.get_name()}, which it neither defines nor imports"
                for s in top.get_symbols() if s.is_referenced() and s.get_name() not in known]
    for node in ast.parse(text, str(template)).body:
        sibling = template.parent / f"{node.module}.py" if isinstance(node, ast.ImportFrom) and node.level == 1 \
            and node.module else None
        if sibling is not None and sibling.is_file():
            there = _defined(sibling.read_text(), str(sibling))
            problems += [f"{template.name}:{node.lineno} imports {alias.name} from {sibling.name}, which does not "
                         "define it" for alias in node.names if alias.name not in there]

    def walk(table: symtable.SymbolTable, where: str) -> None:
        for child in table.get_children():
            scope = f"{where}.{child.get_name()}" if where else child.get_name()
            problems.extend(f"{template.name}: {scope} uses {s.get_name()}, which {template.name} neither defines "
                            "nor imports (copy it too)" for s in child.get_symbols()
                            if s.is_global() and s.get_name() not in known)
            walk(child, scope)
    walk(top, "")
    return problems


def _templates(templates: Path) -> list[Path]:
    return sorted(templates.glob("*.py"))


def _blocks(template: Path, package: Path) -> tuple[list[str], list[str], list[tuple[Copy, str | ValueError]]]:
    """The template's lines, its bad markers, and each marked block with what it must read (the ValueError that
    says why, when its source has no such name)."""
    copies, bad = find_copies(template)
    wants = []
    for copy in copies:
        try:
            wants.append((copy, expected_text(copy, package)))
        except ValueError as exc:
            wants.append((copy, exc))
    return template.read_text().splitlines(keepends=True), bad, wants


def _differs(lines: list[str], copy: Copy, want: str | ValueError) -> bool:
    return isinstance(want, str) and "".join(lines[copy.first - 1:copy.last]) != want


def check(templates: Path = TEMPLATES, package: Path = PACKAGE) -> list[str]:
    """One line for each copied block that differs from its source, each bad marker and each undefined name."""
    problems = []
    for template in _templates(templates):
        lines, bad, wants = _blocks(template, package)
        problems += bad
        for copy, want in wants:
            if isinstance(want, ValueError):
                problems.append(f"{copy.where()}: {want}")
            elif _differs(lines, copy, want):
                problems.append(f"{copy.where()}: the block below the marker is not {copy.source} as attnlab has it: "
                                "run make fix-copies (python -m attnlab.export.copies --fix)")
        problems += undefined_names(template)
    return problems


def fix(templates: Path = TEMPLATES, package: Path = PACKAGE) -> tuple[list[str], list[str]]:
    """Rewrite every copied block that differs from its source. Returns ``(the blocks rewritten, what is still
    wrong)``: bad markers, unknown sources, undefined names."""
    fixed = []
    for template in _templates(templates):
        lines, _, wants = _blocks(template, package)
        stale = [(copy, want) for copy, want in wants if _differs(lines, copy, want)]
        for copy, want in reversed(stale):  # from the bottom: earlier blocks keep their line numbers
            lines[copy.first - 1:copy.last] = want.splitlines(keepends=True)
            fixed.append(f"{template.name}: {copy.source}")
        if stale:
            template.write_text("".join(lines))
    return sorted(fixed), check(templates, package)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnlab.export.copies",
                                     description="Check (or with --fix rewrite) the export templates' blocks marked "
                                     "'# Copied from attnlab.MODULE.NAME' against attnlab's sources.")
    parser.add_argument("--fix", action="store_true", help="rewrite the blocks that differ from their sources")
    args = parser.parse_args(argv)
    fixed, problems = fix() if args.fix else ([], check())
    for line in fixed:
        print(f"rewrote {line}")
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"the copies in {TEMPLATES} are their sources verbatim")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
