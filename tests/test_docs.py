"""Docs that run: every script under docs/ and bench/ imports (docs/probe-seeds/analyse.py also redraws its
figures), and every ``<file>.md#anchor`` that code, studies or docs point to is a heading (or an explicit anchor) of
that file."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("bench/*.py")) + sorted(ROOT.glob("docs/**/*.py"))
SEARCHED = ("platform", "docs", "studies", "cluster", "bench", "tests", "README.md", "Makefile")
LINK = re.compile(r"((?:\.\./|\./)?[A-Za-z0-9_./-]*?[A-Za-z0-9_-]+\.md)#([A-Za-z0-9_.-]+)")


def _load(path: Path):
    name = "doc_script_" + "_".join(path.relative_to(ROOT).with_suffix("").parts).replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_under_docs_and_bench_imports(path):
    module = _load(path)
    assert callable(getattr(module, "main", None)), f"{path.relative_to(ROOT)} has no main()"


def test_the_probe_seeds_analysis_redraws_its_figures(tmp_path):
    module = _load(ROOT / "docs" / "probe-seeds" / "analyse.py")
    shutil.copy(ROOT / "docs" / "probe-seeds" / "summary.json", tmp_path / "summary.json")
    module.main(["--figures-only", "--out", str(tmp_path)])
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn and set(drawn) <= {p.name for p in (ROOT / "docs" / "probe-seeds").glob("*.png")}
    assert all((tmp_path / name).stat().st_size > 10_000 for name in drawn)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))
    return found


def _target(source: Path, link: str) -> Path | None:
    """The Markdown file a link names: relative to the file that holds it, else to the repository, else docs/."""
    for base in (source.parent, ROOT, ROOT / "docs"):
        candidate = (base / link).resolve()
        if candidate.is_file():
            return candidate
    return None


def _links():
    out = []
    for item in SEARCHED:
        top = ROOT / item
        files = [top] if top.is_file() else [p for p in top.rglob("*") if p.suffix in (".py", ".md", ".yaml", ".html")]
        for path in files:
            if path.name == "test_docs.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for link, anchor in LINK.findall(line):
                    anchor = anchor.rstrip(".")  # a link that ends a sentence
                    if link.startswith(("http", "//")) or "://" in line.split(link)[0][-12:]:
                        continue
                    out.append((path, number, link, anchor))
    return out


def test_slugs_follow_github():
    assert slug("RoPE and NTK-aware scaling") == "rope-and-ntk-aware-scaling"
    assert slug("`p_train` and `p_eval`") == "p_train-and-p_eval"
    assert slug("4. Submit and monitor") == "4-submit-and-monitor"
    assert slug("Table 4: softmax-free attention and re-weighting") == "table-4-softmax-free-attention-and-re-weighting"


def test_every_markdown_anchor_that_is_pointed_to_exists():
    links = _links()
    assert len(links) > 50  # the search itself works
    missing = []
    cache: dict[Path, set[str]] = {}
    for path, number, link, anchor in links:
        target = _target(path, link)
        where = f"{path.relative_to(ROOT)}:{number}"
        if target is None:
            missing.append(f"{where}: {link} does not exist")
            continue
        if target not in cache:
            cache[target] = anchors(target)
        if anchor not in cache[target]:
            missing.append(f"{where}: {link}#{anchor} is not a heading of {target.relative_to(ROOT)}")
    assert not missing, "\n".join(missing)
