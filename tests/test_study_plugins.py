"""Plugins in training and studies (docs/plugins.md#plugins-in-training-and-studies): a plugin's bytes are part of
its variant's train key (every built-in key unchanged), a bad plugin is one line before anything is written
(``attnlab study run`` and ``attnlab train``), and a plugin written outside the repository by following
docs/plugins.md trains, evaluates and lands rows in a study on the embedded cluster; editing it retrains only its
variant, an unchanged study trains nothing, and a run evaluates later from the bytes it recorded.

(``ray job submit`` of a study whose plugin lives outside the working directory: tests/test_multinode.py.)
"""

from __future__ import annotations

import json
import pickle
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from attnlab.attention.plugin import PluginError, load_plugin, loaded_plugins, read_source, unload_plugin
from attnlab.cli import main
from attnlab.errors import UserError
from attnlab.study.spec import load_spec
from attnlab.train.config import TrainConfig, load_train_config

ROOT = Path(__file__).resolve().parents[1]
PROBE = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16}
TINY = {"preset": "tiny", "data": PROBE, "steps": 4, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3,
        "warmup_steps": 1, "log_every": 2, "val_every": 4, "val_tokens": 512, "checkpoint_every": 4,
        "keep_checkpoints": 1, "max_failures": 0, "cpus_per_worker": 0.5, "threads_per_worker": 1}


@pytest.fixture
def fresh_plugins():
    """Plugins a test loads (a study's, --plugin's) are forgotten after it, as when its process would end."""
    before = {plugin.source.sha256 for plugin in loaded_plugins()}
    yield
    for plugin in loaded_plugins():
        if plugin.source.sha256 not in before:
            unload_plugin(plugin)


def forget_plugins(keep: set[str]) -> None:
    """What a new process starts with: no plugin but those loaded before the test (``keep``: their sha256)."""
    for plugin in loaded_plugins():
        if plugin.source.sha256 not in keep:
            unload_plugin(plugin)


def worked_example() -> str:
    """The plugin file docs/plugins.md shows in full (its first python block under 'A worked example')."""
    section = (ROOT / "docs" / "plugins.md").read_text().split("## A worked example", 1)[1]
    return textwrap.dedent(re.search(r"```python\n(.*?)```", section, re.S).group(1))


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------------------------------ the train key
def test_builtin_keys_are_unchanged_and_the_plugin_study_shares_proxy_texts(fresh_plugins):
    """Every point of every study shipped before plugins keyed their runs has the key it had then; the plugin
    study's softmax and LSSAR runs are proxy_text's (its runs are reused where a runs folder has them)."""
    pinned = json.loads((ROOT / "tests" / "train_keys.json").read_text())
    fingerprint = pinned["fingerprint"]
    for study, keys in pinned["studies"].items():
        spec = load_spec(ROOT / "studies" / f"{study}.yaml")
        space = spec.search_space()
        points = space.grid() if spec.search.engine == "grid" else space.checked_points()
        now = {json.dumps(p, sort_keys=True): space.config(p).train_key(fingerprint) for p in points}
        assert now == keys, study

    def keys(study):
        space = load_spec(ROOT / "studies" / f"{study}.yaml").search_space()
        return {(p["attention"], p["seed"]): space.config(p).train_key("demo-bytes", 257) for p in space.grid()}

    proxy, plugins = keys("proxy_text"), keys("plugins_proxy")
    shared = {k: v for k, v in plugins.items() if k[0] in ("softmax", "lssar")}
    assert len(shared) == 6 and all(proxy[k] == v for k, v in shared.items())
    assert not set(plugins.values()) - set(shared.values()) & set(proxy.values())


def test_a_plugins_bytes_are_its_variants_key_and_travel_with_the_config(tmp_path, fresh_plugins):
    path = tmp_path / "outside" / "recency.py"
    _write(path, worked_example())
    before = {p.source.sha256 for p in loaded_plugins()}
    loaded = load_plugin(str(path))
    cfg = load_train_config({**TINY, "attention": "recency"})
    assert cfg.plugin.sha256 == loaded.source.sha256 == read_source(str(path)).sha256  # filled in from the plugin
    key = cfg.train_key("fp", 64)
    assert cfg.identity("fp", 64)["model"]["attention"]["plugin"] == loaded.source.sha256
    # The recorded config (provenance, checkpoints, status files) and a pickled one (a Ray worker) carry the bytes.
    record = cfg.model_dump(mode="json")
    assert record["plugin"]["files"] == {"recency.py": path.read_text()}
    assert TrainConfig.model_validate(record).train_key("fp", 64) == key
    assert pickle.loads(pickle.dumps(cfg)).train_key("fp", 64) == key
    builtin = load_train_config({**TINY, "attention": "softmax"})
    assert builtin.plugin is None and "plugin" not in builtin.identity("fp", 64)["model"]["attention"]

    # Editing the plugin (in a new process: here, forgetting it) changes the key; its old bytes give the old key.
    forget_plugins(before)
    path.write_text(path.read_text().replace("-4.0", "-3.0"))
    edited = load_plugin(str(path))
    new = load_train_config({**TINY, "attention": "recency"})
    assert new.train_key("fp", 64) != key
    # A config recording the old bytes, where the user loaded the new ones, is refused naming both hashes.
    with pytest.raises(UserError, match=rf"records plugin .*recency.py \(sha256 {loaded.source.short_hash}\).*"
                                        rf"\(sha256 {edited.source.short_hash}\)"):
        load_train_config(record)
    forget_plugins(before)  # a worker: nothing loaded by a user; the recorded bytes load and key as before
    assert TrainConfig.model_validate(record).train_key("fp", 64) == key


# ------------------------------------------------------------------------------------------ bad plugins
SOFTMAX_REFERENCE = '''
import math, torch
from attnlab.attention.plugin import Variant

def reference(q, k, rows, ctx):
    s = q @ k.transpose(-1, -2) / math.sqrt(ctx.head_dim)
    return torch.softmax(s.masked_fill(~rows.visible, float("-inf")), dim=-1)
'''
BAD = {  # case: ({file: text}, the plugin references given, the variant the study and --attention name, fragment)
    "missing file": ({}, ["outside/nope.py"], "nope", r"plugin file .*outside/nope.py does not exist"),
    "missing module": ({}, ["no_such_attnlab_plugin"], "nope", r"plugin module 'no_such_attnlab_plugin' cannot be "
                                                               r"imported"),
    "syntax error": ({"broken.py": "import torch\n\ndef f(:\n    pass\n"}, ["outside/broken.py"], "broken",
                     r"plugin .*outside/broken.py:3: SyntaxError"),
    "import error": ({"imports.py": "import torch\nimport not_a_module_attnlab_x\n"}, ["outside/imports.py"],
                     "imports", r"plugin .*outside/imports.py:2: ModuleNotFoundError: No module named "
                                r"'not_a_module_attnlab_x'"),
    "built-in name": ({"mine.py": SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='softmax', reference=reference)]\n"},
                      ["outside/mine.py"], "softmax", r"variant 'softmax' collides with the built-in variant"),
    "two plugins, one name": (
        {"one.py": SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='twin', reference=reference)]\n",
         "two.py": SOFTMAX_REFERENCE + "\n# another file\nVARIANTS = [Variant(name='twin', reference=reference)]\n"},
        ["outside/one.py", "outside/two.py"], "twin", r"plugin .*outside/two.py: variant 'twin' collides with 'twin' "
                                                      r"loaded from .*outside/one.py"),
    "no reference form": ({"noref.py": SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='noref')]\n"},
                          ["outside/noref.py"], "noref", r"plugin .*outside/noref.py:8: variant 'noref' has no "
                                                         r"reference form"),
    "unknown field": ({"field.py": SOFTMAX_REFERENCE + "VARIANTS = [Variant(name='field', reference=reference, "
                                                       "scale=2.0)]\n"},
                      ["outside/field.py"], "field", r"plugin .*outside/field.py:8: Variant field 'scale' is unknown"),
}


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab: error: "), err
    return err[0]


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_plugin_is_one_line_before_anything_is_written(case, tmp_path, monkeypatch, capsys, fresh_plugins):
    files, refs, name, fragment = BAD[case]
    for file, text in files.items():
        _write(tmp_path / "outside" / file, text)
    monkeypatch.chdir(tmp_path)
    runs, store = tmp_path / "runs", tmp_path / "results"

    study = {"name": "bad", "plugins": refs, "train": TINY, "space": {"attention": [name]}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(study))
    assert main(["study", "run", "bad.yaml", "--runs", str(runs), "--store", str(store)]) == 2
    assert re.search(fragment, _one_error_line(capsys)), case
    assert not runs.exists() and not store.exists()  # no runs folder, no Tune state, no results

    forget_plugins(set())  # `attnlab train` in a new process
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(TINY))
    out = tmp_path / "run"
    plugin_flags = [flag for ref in refs for flag in ("--plugin", ref)]
    assert main(["train", "--config", "train.yaml", *plugin_flags, "--attention", name, "--out", str(out)]) == 2
    assert re.search(fragment, _one_error_line(capsys)), case
    assert not out.exists()


def test_a_relative_plugin_path_is_the_working_directorys_and_ambiguity_is_refused(tmp_path, monkeypatch, capsys,
                                                                                   fresh_plugins):
    folder = tmp_path / "studies"
    _write(folder / "recency.py", worked_example())
    (folder / "s.yaml").write_text(yaml.safe_dump({"name": "s", "plugins": ["recency.py"], "train": TINY,
                                                   "space": {"attention": ["recency"]}}))
    monkeypatch.chdir(tmp_path)
    # Only next to the study: refused, naming the path to write.
    assert main(["study", "validate", "studies/s.yaml"]) == 2
    line = _one_error_line(capsys)
    assert "is not in the working directory" in line and "write studies/recency.py" in line
    # A different file of that name in the working directory too: ambiguous, refused.
    _write(tmp_path / "recency.py", worked_example().replace("-4.0", "-3.0"))
    assert main(["study", "validate", "studies/s.yaml"]) == 2
    assert "recency.py is ambiguous" in _one_error_line(capsys)
    # The same bytes in both places mean one plugin: fine (as is the working directory's path written out).
    _write(tmp_path / "recency.py", worked_example())
    assert main(["study", "validate", "studies/s.yaml"]) == 0
    assert "plugins: recency.py (sha256 " in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ on the embedded cluster
@pytest.mark.ray
def test_a_plugin_from_outside_the_repo_trains_evaluates_and_retrains_only_when_edited(ray_session, tmp_path,
                                                                                      monkeypatch, capsys,
                                                                                      fresh_plugins):
    """docs/plugins.md's example saved outside the repository (its `attention check` is
    tests/test_model_plugins.py's) in a study beside softmax: both train and land rows; the same study again
    trains nothing; the edited plugin is refused until --fresh, then only its variant trains again; the old run
    evaluates later from the bytes it recorded, without the file, and is refused with the edited ones."""
    from attnlab.evaluate.extrapolation import evaluate_checkpoint
    from attnlab.evaluate.plan import EvalConfig
    from attnlab.results import ResultsStore, reports
    from attnlab.study.runner import run_study, study_state

    keep = {p.source.sha256 for p in loaded_plugins()}
    plugin = _write(tmp_path / "outside" / "recency.py", worked_example())
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    study = {"name": "plugged", "plugins": ["../outside/recency.py"], "train": TINY, "search": {"engine": "grid"},
             "space": {"attention": ["softmax", "recency"]}, "objective": "val_loss@2x",
             "eval": {"multiples": [1, 2], "p_eval": ["none"], "max_tokens": 512}}
    (work / "plugged.yaml").write_text(yaml.safe_dump(study))
    runs, store = str(work / "runs"), str(work / "results")
    first = run_study(load_spec("plugged.yaml"), store=store, runs=runs)
    assert sorted(t["status"] for t in first.trials) == ["complete", "complete"] and first.trained == 2
    keys = {t["attention"]: t["train_key"] for t in first.trials}
    rows = ResultsStore(store).read(study="plugged", metric="val_loss")
    assert sorted(rows.groupby("attention").size().items()) == [("recency", 2), ("softmax", 2)]
    state = study_state(load_spec("plugged.yaml"), runs)
    provenance = state.run(keys["recency"]).read_json("provenance.json")
    sha = read_source(str(plugin)).sha256
    assert provenance["plugin"]["sha256"] == sha and provenance["config"]["plugin"]["sha256"] == sha
    by_variant = rows.groupby("attention")["plugin_sha256"].apply(lambda s: set(s.fillna("null")))
    assert by_variant.to_dict() == {"recency": {sha}, "softmax": {"null"}}  # the rows carry the plugin's hash

    # Unchanged: nothing trains.
    again = run_study(load_spec("plugged.yaml"), store=store, runs=runs)
    assert again.restored and again.trained == 0

    # Edited (a new process: the old bytes forgotten): refused until --fresh, then only its variant trains.
    forget_plugins(keep)
    plugin.write_text(plugin.read_text().replace("-4.0", "-3.0"))
    edited = load_spec("plugged.yaml")
    with pytest.raises(UserError, match=r"plugin \.\./outside/recency.py changed .*--fresh"):
        run_study(edited, store=store, runs=runs)
    fresh = run_study(edited, store=store, runs=runs, resume=False)
    assert fresh.trained == 1
    new_keys = {t["train_key"] for t in fresh.trials if t["attention"] == "recency"} - {keys["recency"]}
    assert len(new_keys) == 1
    rows = ResultsStore(store).read(study="plugged", metric="val_loss")
    assert set(rows.train_key) == {keys["softmax"], keys["recency"], *new_keys}  # softmax's run reused
    # The two versions are two configurations: never averaged as seeds, never compared as one.
    table = reports.table(rows, metric="val_loss")
    assert "plugin_sha256" in table.attrs["label_columns"] and (table["attention"] == "recency").sum() == 2
    with pytest.raises(UserError, match=r"--b 'recency' matches 2 configurations .*plugin_sha256"):
        reports.compare(rows, "softmax", "recency", at="2x")

    # The old run with the edited plugin loaded: refused in one line naming both hashes.
    old_run = state.run(keys["recency"]).uri
    capsys.readouterr()
    assert main(["eval", old_run, "--plugin", str(plugin), "--lengths", "64", "--max-tokens", "256"]) == 2
    line = _one_error_line(capsys)
    assert sha[:12] in line and read_source(str(plugin)).sha256[:12] in line
    # Later, without the file: the run evaluates from the bytes it recorded.
    forget_plugins(keep)
    plugin.unlink()
    rows = evaluate_checkpoint(old_run, EvalConfig(lengths=[64], p_eval=[None], max_tokens=256), device="cpu")
    assert {r["attention"] for r in rows} == {"recency"} and {r["plugin_sha256"] for r in rows} == {sha}
    assert rows[0]["train_key"] == keys["recency"]
