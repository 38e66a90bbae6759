"""Docs that run: every script under docs/ and bench/ imports (docs/probe-seeds/analyse.py also redraws its
figures), every ``<file>.md#anchor`` that code, studies or docs point to is a heading (or an explicit anchor) of
that file, the README stays a front door whose Python block runs and whose commands parse as written, and every
result table of docs/findings.md is a block that docs/tables.py writes from its study's store by the command it
names."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
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


# The README is the front door (issue 38): at most 12,000 characters, docs/README.md the one index of docs/ (every
# page one row of its table, issue 52), and
# what it shows runs: its Python block is executed, its commands are parsed by the real parser (a study run takes
# minutes; `make demo` and the tests run the studies themselves), its study excerpt is the file's own lines.
README = ROOT / "README.md"
README_LIMIT = 12_000


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_the_readme_is_a_front_door():
    text = README.read_text(encoding="utf-8")
    assert len(text) <= README_LIMIT, f"README.md is {len(text):,} characters, over {README_LIMIT:,}: move a section to docs/"
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README links to what does not exist: {missing}"
    assert "(docs/README.md)" in text, "the README does not link the docs index, docs/README.md"
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| \[[^]]+\]\(([^)#]+\.md)\) \|", index, flags=re.M))
    unlisted = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md" and p.name not in rows]
    assert not unlisted, f"docs pages the index's table (docs/README.md) has no row for: {unlisted}"


def test_the_readme_python_runs(tmp_path):
    blocks = _blocks("python")
    assert blocks, "the README has no python block"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for code in blocks:
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300, check=False)
        assert out.returncode == 0, f"README python block failed:\n{code}\n{out.stderr[-3000:]}"


def _commands() -> list[str]:
    commands = []
    for block in _blocks("bash"):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_every_readme_command_parses_as_written():
    from attnlab.cli import build_parser

    commands = _commands()
    assert any(c.startswith("attnlab study run ") for c in commands)
    assert any(c.startswith("attnlab study submit ") for c in commands)
    assert any(c.startswith("attnlab serve ") for c in commands)
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for command in commands:
        words = shlex.split(os.path.expandvars(command.replace("$PWD", str(ROOT))))
        if words[0] == "make":
            for target in words[1:]:
                assert "=" in target or re.search(rf"^{re.escape(target)}:", makefile, re.M), command
        elif words[0] == "attnlab":
            try:
                build_parser().parse_args(words[1:])
            except SystemExit as exc:
                pytest.fail(f"README command does not parse ({exc}): {command}")
            for word in words[1:]:
                if word.endswith((".yaml", ".py")) and not word.startswith("-"):
                    assert (ROOT / word).is_file(), f"{command}: {word} does not exist"
        else:
            assert words[0] == "ray" and words[1] == "start", f"a README command this test does not check: {command}"


def test_the_readme_study_excerpt_is_the_study_file():
    (block,) = _blocks("yaml")
    name = re.search(r"^name: (\S+)$", block, re.M).group(1)
    source = (ROOT / "studies" / f"{name}.yaml").read_text(encoding="utf-8").splitlines()
    at = 0
    for line in block.splitlines():
        assert line in source[at:], f"studies/{name}.yaml has no line {line!r} (after line {at})"
        at = source.index(line, at) + 1


# --- result tables: written from a store by the command each names (issue 52) ---------------------------------------

def test_tables_writes_each_block_from_the_store_and_checks_it(tmp_path, capsys):
    """A table, a family of verdicts (in a ```text fence) and a block of two commands are written from the store as
    the commands print them; a study the store lacks keeps its block; then --check finds nothing to change."""
    from attnlab.cli import main
    from attnlab.results import ResultsStore

    store = ResultsStore(str(tmp_path / "store"))
    rows = [dict(study="t4", trial=f"{a}-s{s}", attention=a, scale="logd_logn", p_train=None, p_eval=None,
                 rope_scaling="none", step=100, tokens=409600, eval_len=n, train_len=64, window_mode="nonoverlap",
                 metric="val_loss", value=v + s / 10 + n / 1000, seed=s, train_key=f"h-{a}-{s}", git_sha="abc1234")
            for a, v in (("softmax", 3.0), ("lssar", 2.5)) for s in (0, 1, 2) for n in (64, 256)]
    store.write(rows, key="t4-rows")
    table = "attnlab results table --study t4 --digits 2"
    family = "attnlab results compare --study t4 --a softmax --b lssar --at 1x --at 4x --unpaired --digits 3"
    two = "attnlab results table --study t4 --where eval_len=64 --digits 2 ; attnlab results compare --study t4 " \
          "--a softmax --b lssar --at 4x"
    page = tmp_path / "page.md"
    marked = [("t4", c, "| stale |") for c in (table, family, two)] + [
        ("absent", "attnlab results table --study absent", "| kept |")]
    page.write_text("# A page\n" + "".join(f"\n<!-- table study={s}: {c} -->\n{body}\n<!-- end table -->\n"
                                            for s, c, body in marked))
    tables = _load(ROOT / "docs" / "tables.py")
    assert tables.main(["--store", store.uri, "--check", str(page)]) == 1
    assert tables.main(["--store", store.uri, str(page)]) == 0
    written = page.read_text()
    assert "| stale |" not in written and "| kept |" in written

    def out(command):
        capsys.readouterr()
        assert main(tables.argv_of(command) + ["--store", store.uri]) == 0
        return capsys.readouterr().out.rstrip("\n")

    first, second = tables.commands(two)
    assert [b["body"] for b in tables.blocks(written)[:3]] == [
        out(table) + "\n",
        "```text\n" + out(family) + "\n```\n",
        out(first) + "\n\n```text\n" + out(second) + "\n```\n",
    ]
    assert "family of 2 comparison(s)" in written and "Holm" in written
    assert tables.main(["--store", store.uri, "--check", str(page)]) == 0


def test_every_result_table_is_a_block_that_names_its_study_and_a_command():
    """A result table of docs/ sits in a ``<!-- table study=NAME: COMMAND -->`` block (docs/tables.py writes it from a
    store): each of its commands (`` ; `` between two) parses with attnlab's own parser, is a results table, compare
    or laws, and reads that study, and a ``--pairs`` file it names is the repository's and lists comparisons;
    docs/findings.md has no table outside a block, so none is retyped."""
    from attnlab.cli import build_parser
    from attnlab.results.reports import read_pairs

    tables = _load(ROOT / "docs" / "tables.py")
    seen = 0
    for path in sorted((ROOT / "docs").glob("*.md")):
        text = path.read_text(encoding="utf-8")
        for block in tables.blocks(text):
            seen += 1
            for command in tables.commands(block["command"]):
                try:
                    argv = tables.argv_of(command)
                    args = build_parser().parse_args(argv)
                except (SystemExit, ValueError) as exc:
                    pytest.fail(f"{path.name}: a table's command does not parse ({exc}): {command}")
                assert args.results_command in tables.REPORTS and args.study == block["study"], (path.name, command)
                pairs = tables.pairs_file(argv)
                if pairs is not None:
                    assert pairs.is_file() and read_pairs(str(pairs)), (path.name, command)
        assert text.count("<!-- table study=") == len(tables.blocks(text)), f"{path.name}: a malformed table marker"
    findings = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    outside = re.sub(tables.BLOCK.pattern, "", findings, flags=tables.BLOCK.flags)
    assert not re.findall(r"^\|", outside, re.M), "docs/findings.md has a table outside a marked block"
    assert seen


def _rows_shaped_as(study: str) -> list[dict]:
    """Rows of every metric the docs' blocks read, in the shape ``studies/<study>.yaml`` writes them (its grid's
    points and their knobs, its evaluation lengths, p_eval and RoPE settings), with made-up values."""
    import random

    from attnlab.study.spec import load_spec
    from attnlab.study.trial import knob_label

    spec = load_spec(ROOT / "studies" / f"{study}.yaml")
    train_len, rng = spec.train.seq_len, random.Random(study)
    return [dict(study=study, trial=f"t{i}", attention=point["attention"], scale="s", p_train=None, p_eval=p_eval,
                 rope_scaling=rope, step=100, tokens=1000, eval_len=int(m * train_len), train_len=train_len,
                 window_mode="nonoverlap", metric=metric, value=rng.random(), seed=point["seed"],
                 knobs=knob_label(spec, point), train_key=f"k{i}", git_sha="abc1234")
            for i, point in enumerate(spec.search_space().grid()) for p_eval in spec.eval.p_eval
            for rope in spec.eval.rope_scaling for m in spec.eval.multiples
            for metric in ("val_loss", "acc", "coord_err_au")]


@pytest.mark.parametrize("study", ["proxy_text", "baselines", "plugins_proxy", "probe_copy", "orbits"])
def test_a_studys_blocks_in_findings_are_written_from_a_store_of_its_shape(study, tmp_path, monkeypatch):
    """The commands of the shipped blocks run as written (their pins pick one configuration each, a --pairs file is
    found from any folder) against a store shaped as the study writes its rows; only that study's blocks change."""
    from attnlab.results import ResultsStore

    store = ResultsStore(str(tmp_path / "store"))
    store.write(_rows_shaped_as(study), key="rows")
    page = tmp_path / "findings.md"
    shutil.copy(ROOT / "docs" / "findings.md", page)
    monkeypatch.chdir(tmp_path)
    tables = _load(ROOT / "docs" / "tables.py")
    before = page.read_text(encoding="utf-8")
    assert tables.main(["--store", store.uri, str(page)]) == 0
    after = page.read_text(encoding="utf-8")
    mine = [(b["study"], b["command"]) for b in tables.blocks(before)]
    assert [(b["study"], b["command"]) for b in tables.blocks(after)] == mine
    changed = [b["command"] for b, a in zip(tables.blocks(before), tables.blocks(after)) if b["body"] != a["body"]]
    assert changed == [c for s, c in mine if s == study] and changed
    assert tables.BLOCK.sub("", before) == tables.BLOCK.sub("", after)
    assert tables.main(["--store", store.uri, "--check", str(page)]) == 0
