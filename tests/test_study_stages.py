"""A study's stages (docs/stages.md): context extension as a fine-tune that starts from a parent run's final weights.

Real local Ray studies (the session's ``ray_session`` cluster) on a tiny model and a small synthetic copy probe
(vocabulary 64: a step costs milliseconds): a parent trained once for three children and reused by a second study,
a child-only retrain after an edit, the lineage columns of the rows, a killed fine-tune resumed from its own
checkpoint, training-time RoPE tables equal to the formulas, and every bad input refused in one line with nothing
written.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from attnlab.errors import UserError
from attnlab.results import ResultsStore
from attnlab.study.spec import load_spec

DATA = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16}
TRAIN = {"preset": "tiny", "data": DATA, "steps": 8, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3,
         "warmup_steps": 2, "log_every": 4, "val_every": 4, "val_tokens": 1024, "checkpoint_every": 8,
         "keep_checkpoints": 1, "max_failures": 0, "cpus_per_worker": 0.5, "threads_per_worker": 1}
EXTEND = {"name": "extend", "from": "pretrain",
          "train": {"seq_len": 128, "steps": 4, "warmup_steps": 1, "lr": 1.0e-3, "micro_batch": 2,
                    "checkpoint_every": 4},
          "space": {"rope_scaling": {"values": ["none", "pi", "yarn"], "when": ["softmax"]}}}
EVAL = {"multiples": [1, 4], "p_eval": ["none"], "rope_scaling": ["none"], "max_tokens": 1024}


def _study(name: str, stages: list[dict], **extra) -> dict:
    return {"name": name, "train": TRAIN, "space": {"attention": ["softmax"], "seeds": [0]}, "stages": stages,
            "eval": EVAL, **extra}


def _write(tmp_path: Path, study: dict) -> Path:
    path = tmp_path / f"{study['name']}.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def _by_stage(summary) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for trial in summary.trials:
        out.setdefault((trial.get("point") or {}).get("stage", "pretrain"), []).append(trial)
    return out


# ------------------------------------------------------------------------------------------ studies on Ray
@pytest.mark.ray
def test_a_parent_trains_once_for_three_children_and_a_second_study_reuses_it(ray_session, tmp_path, capsys):
    from attnlab.study.runner import run_study

    runs, store_uri = str(tmp_path / "runs"), str(tmp_path / "results")
    spec = load_spec(_write(tmp_path, _study("ext-a", [EXTEND])))
    summary = run_study(spec, store=store_uri, runs=runs)
    out = capsys.readouterr().out
    assert "plan: stages: pretrain: 1 parent run(s), 1 to train, 0 reused; extend: 3 child run(s), 3 to train" in out
    stages = _by_stage(summary)
    assert len(stages["pretrain"]) == 1 and len(stages["extend"]) == 3
    assert summary.trained == 4  # the parent once, each child once
    assert {t["status"] for t in summary.trials} == {"complete"}, summary.trials
    parent_key = stages["pretrain"][0]["train_key"]
    for child in stages["extend"]:
        assert child["config"]["init_from"]["train_key"] == parent_key
        assert child["config"]["original_len"] == 64 and child["config"]["seq_len"] == 128

    # the lineage columns: a child's rows name its parent, its method, its length and tokens; multiples count from 64
    rows = ResultsStore(store_uri).read(study="ext-a", metric="val_loss")
    assert sorted(set(rows["eval_len"])) == [64, 256] and set(rows["train_len"]) == {64}
    children = rows[rows["stage"] == "extend"]
    assert set(children["parent_key"]) == {parent_key}
    assert sorted(set(children["extension"])) == ["none", "pi", "yarn"]
    assert set(children["ext_len"]) == {128} and set(children["ext_tokens"]) == {4 * 256}
    assert set(children["lineage_tokens"]) == {8 * 256 + 4 * 256}
    parents = rows[rows["stage"].isna()]  # the root's rows: as a run trained once writes them
    assert len(parents) and parents["parent_key"].isna().all() and parents["extension"].isna().all()
    # the methods differ where they should: inside the fine-tune every child is its own model
    assert children.groupby("extension")["value"].first().nunique() == 3

    # results table and compare select and label by the lineage fields
    from attnlab.results import reports

    table = reports.to_markdown(reports.table(rows, metric="val_loss"))
    assert "extension" in table and "yarn" in table and "pi" in table
    result = reports.compare(rows, a="softmax,stage=none", b="softmax,extension=yarn", metric="val_loss", at="4x")
    assert "extension" in reports.format_comparison(result)

    # a second study (another name, the same root) reuses the parent by key and trains only its own child
    second = dict(EXTEND, name="ntk", space={"rope_scaling": ["ntk"]})
    spec2 = load_spec(_write(tmp_path, _study("ext-b", [second])))
    summary2 = run_study(spec2, store=store_uri, runs=runs)
    out = capsys.readouterr().out
    assert "pretrain: 1 parent run(s), 0 to train, 1 reused; ntk: 1 child run(s), 1 to train, 0 reused" in out
    assert summary2.trained == 1
    stages2 = _by_stage(summary2)
    assert stages2["pretrain"][0]["train_key"] == parent_key and stages2["pretrain"][0]["run_dir"].startswith(
        str(tmp_path / "runs" / "ext-a"))  # the first study's run, not a copy

    # the study page shows each child's stage and parent, and reads the reused parent where it is (ext-a's folder)
    from attnlab.serve.app import create_app
    from attnlab.serve.data import open_sources
    from serve_util import get, serving

    with serving(create_app(open_sources(store_uri, runs))) as base:
        status, _, page = get(base + "/study/ext-b")
    assert status == 200 and f'data-parent="{parent_key}"' in page and "stage ntk, from" in page
    parent_row = page[page.index(f'<tr id="run-{parent_key}"'):].split("</tr>")[0]
    assert "complete" in parent_row or "cached" in parent_row
    assert parent_row.count("–") < 4, parent_row  # its losses are read from ext-a's run folder

    # re-running trains nothing; editing a child's setting retrains the children only
    again = run_study(spec, store=store_uri, runs=runs)
    assert again.trained == 0 and {t["status"] for t in again.trials} <= {"cached", "complete"}
    edited = dict(EXTEND, train={**EXTEND["train"], "lr": 5.0e-4})
    spec3 = load_spec(_write(tmp_path, _study("ext-a", [edited])))
    summary3 = run_study(spec3, store=store_uri, runs=runs, resume=False)
    assert summary3.trained == 3
    children = {t["train_key"] for t in summary3.trials if t.get("point", {}).get("stage") == "extend"}
    assert len(children - {t["train_key"] for t in stages["extend"]}) == 3  # three new keys beside the old three

    # a parent that finished without its final checkpoint (deleted, or moved away): refused, nothing written
    run = Path(stages["pretrain"][0]["run_dir"])
    final = next(run.glob("checkpoints/step_*"))
    kept = run / "checkpoints" / "step_0000004"
    shutil.copytree(final, kept)
    (kept / "meta.json").write_text(json.dumps({**json.loads((kept / "meta.json").read_text()), "step": 4}))
    shutil.rmtree(final)
    spec4 = load_spec(_write(tmp_path, _study("ext-c", [second])))
    with pytest.raises(UserError, match=r"finished without its final checkpoint \(step 8; kept: 4\)"):
        run_study(spec4, store=store_uri, runs=runs)
    assert not (tmp_path / "runs" / "ext-c").exists()


@pytest.mark.ray
def test_a_child_of_a_failed_parent_is_skipped_not_trained_from_scratch(ray_session, tmp_path, monkeypatch):
    from attnlab.study.runner import run_study

    monkeypatch.setenv("ATTNLAB_FAIL_AT_STEP", "2")  # every run fails at step 2: the parent never finishes
    spec = load_spec(_write(tmp_path, _study("ext-fail", [dict(EXTEND, space={})])))
    summary = run_study(spec, store=str(tmp_path / "results"), runs=str(tmp_path / "runs"))
    stages = _by_stage(summary)
    assert stages["pretrain"][0]["status"] == "failed"
    child = stages["extend"][0]
    assert child["status"] == "skipped" and "parent run" in child["reason"] and "failed" in child["reason"]
    assert summary.trained == 1  # the parent's attempt only
    assert not (tmp_path / "runs" / "ext-fail" / "runs" / child["train_key"]).exists()


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("change, needle", [
    (dict(stages=[dict(EXTEND, **{"from": "nowhere"})]), "stages[0].from: 'nowhere' is not a stage"),
    (dict(stages=[dict(EXTEND, name="a", **{"from": "b"}), dict(EXTEND, name="b", **{"from": "a"})]),
     "a -> b start from each other (a cycle)"),
    (dict(stages=[dict(EXTEND, train={**EXTEND["train"], "seq_len": 64, "micro_batch": 4})]),
     "stages.extend.train.seq_len=64 is not above its parent's (64"),
    (dict(stages=[dict(EXTEND, train={**EXTEND["train"], "rope_scaling": "yarn"}, space={})],
          space={"attention": ["softmax"], "seeds": [0], "model.position": ["nope"]}),
     "rope_scaling='yarn' in training needs RoPE"),
    (dict(stages=[dict(EXTEND, train={"seed": 3})]), "seed cannot be set in a stage"),
    (dict(stages=[dict(EXTEND, when=["lssar"])]), "stages[0].when names 'lssar'"),
    (dict(stages=[EXTEND], search={"engine": "random", "num_samples": 2}), "use search.engine: grid"),
    (dict(space={"attention": ["softmax"], "rope_scaling": ["pi"]}), "stages[].space.rope_scaling"),
])
def test_bad_stages_are_one_line_before_anything_runs(tmp_path, change, needle):
    study = {**_study("bad", [EXTEND]), **change}
    with pytest.raises(UserError) as err:
        load_spec(_write(tmp_path, study))
    message = str(err.value)
    assert "\n" not in message and needle in message, message


# ------------------------------------------------------------------------------------------ training
def _child_config(parent_run: Path, scaling: str, **extra):
    from attnlab.train import load_train_config
    from attnlab.train.config import InitFrom

    fields = {**TRAIN, "seq_len": 128, "steps": 6, "warmup_steps": 1, "micro_batch": 2, "checkpoint_every": 3,
              "keep_checkpoints": 2, "original_len": 64, "rope_scaling": scaling, **extra}
    cfg = load_train_config(fields)
    return cfg.model_copy(update={"init_from": InitFrom(train_key="p" * 16, run=str(parent_run), step=8)})


@pytest.fixture(scope="module")
def parent_run(tmp_path_factory):
    from attnlab.train import load_train_config
    from attnlab.train.loop import train_here

    run = tmp_path_factory.mktemp("parent") / "run"
    train_here(load_train_config(TRAIN), run, device="cpu")
    return run


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_fine_tune_resumes_from_its_own_checkpoint(tmp_path, parent_run, monkeypatch):
    import attnlab.faults
    from attnlab.model.checkpoint import load_model
    from attnlab.train.loop import LocalSession, train_worker

    cfg = _child_config(parent_run, "yarn", log_every=1)
    reference, crashed = tmp_path / "ref", tmp_path / "crashed"
    train_worker(cfg, LocalSession(reference, keep=2), reference)

    def crash(step, rank):
        if step == 4:
            raise RuntimeError("injected failure at step 4")
    monkeypatch.setattr(attnlab.faults, "before_train_step", crash)
    with pytest.raises(RuntimeError, match="injected failure"):
        train_worker(cfg, LocalSession(crashed, keep=2), crashed)
    monkeypatch.setattr(attnlab.faults, "before_train_step", lambda step, rank: None)
    assert [m["step"] for m in _metrics(crashed)] == [1, 2, 3, 4]
    train_worker(cfg, LocalSession(crashed, keep=2), crashed)
    a, b = _metrics(reference), _metrics(crashed)
    # resumed at step 3 from its own checkpoint (the lost step 4 replaced); from the parent's it would have restarted
    # at step 1, and the losses of steps 4-6 would be those of a 3-step fine-tune
    assert [m["step"] for m in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b):
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-6, abs=1e-7)
    ref_model, _, _ = load_model(reference)
    crashed_model, _, _ = load_model(crashed)
    for (name, x), (_, y) in zip(ref_model.state_dict().items(), crashed_model.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def test_a_fine_tune_starts_from_the_parent_weights_only(tmp_path, parent_run):
    from attnlab.model.checkpoint import load_model, load_state
    from attnlab.train.loop import LocalSession
    from attnlab.train.parts import build_parts

    cfg = _child_config(parent_run, "pi")
    parts = build_parts(cfg, LocalSession(tmp_path / "child"), __import__("attnlab").location.Location.parse(
        tmp_path / "child"))
    parent, _, _ = load_model(parent_run)
    for (name, x), (_, y) in zip(parts.model.model.state_dict().items(), parent.state_dict().items()):
        assert torch.equal(x, y), name  # a copy of the weights: the same bits
    assert parts.start == 0 and not parts.model.optimizer.state  # a fresh optimiser, step 0 of its own schedule
    assert parts.model.model.cfg.trained_scaling == ("pi", 64, None)
    del load_state


# ------------------------------------------------------------------------------------------ RoPE in training
def _formula(method: str, d: int, L_orig: int, L_new: int, base: float = 10000.0):
    """docs/protocol.md's formulas written out again, from scratch: inverse frequencies and the logit multiplier."""
    s = L_new / L_orig
    m = torch.arange(0, d, 2, dtype=torch.float64)
    theta = base ** (-m / d)
    if method == "pi":
        return theta / s, 1.0
    if method == "ntk":
        return (base * s ** (d / (d - 2))) ** (-m / d), 1.0
    if method == "yarn":  # the reference code's: a ramp in the pair index i between floor(i(32)) and ceil(i(1))
        def pair(rotations):  # the pair whose wavelength turns `rotations` times over L_orig
            return d * math.log(L_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(math.floor(pair(32)), 0), min(math.ceil(pair(1)), d - 1)
        interpolated = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        return interpolated * theta / s + (1 - interpolated) * theta, (0.1 * math.log(s) + 1) ** 2
    r = L_orig / (2 * math.pi / theta)  # yarn_paper: the paper's ramp in the rotation count r
    gamma = ((r - 1) / (32 - 1)).clamp(0, 1)
    return (1 - gamma) * theta / s + gamma * theta, (0.1 * math.log(s) + 1) ** 2


@pytest.mark.parametrize("method", ["pi", "ntk", "yarn", "yarn_paper"])
def test_a_fine_tune_steps_rope_tables_are_the_formulas(method, monkeypatch):
    """The tables a fine-tune's forward uses (captured from the model during a training step) at every length."""
    import attnlab.model.gpt as gpt_module
    from attnlab.model import GPTConfig, build_model

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=128, vocab_size=64, train_len=256, original_len=64,
                    rope_scaling=method)
    model = build_model(cfg)
    seen = []
    real = gpt_module.scaled_rope_tables

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out)
        return out
    monkeypatch.setattr(gpt_module, "scaled_rope_tables", spy)
    for T in (32, 256):  # inside and at the fine-tune's length: one static scaling
        x = torch.randint(0, 64, (2, T))
        _, loss = model(x, x)
        loss.backward()
        inv_freq, multiplier = _formula(method, 64, 64, 256)
        angles = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = seen[-1]
        torch.testing.assert_close(cos.double(), (angles.cos() * math.sqrt(multiplier)).float().double(),
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(sin.double(), (angles.sin() * math.sqrt(multiplier)).float().double(),
                                   rtol=0, atol=1e-6)


def _frequencies_before_stages(scaling, head_dim, seq_len, train_len, base=10000.0, device=None):
    """attnlab.model.rope.rope_frequencies as it was before training-time scalings existed (commit df7dff9),
    verbatim but for its helpers' module."""
    from attnlab.model.rope import YARN_ALPHA, YARN_BETA, inverse_frequencies, ntk_base, yarn_temperature

    if scaling == "ntk":
        return inverse_frequencies(ntk_base(base, head_dim, seq_len, train_len), head_dim, device), 1.0
    inv_freq = inverse_frequencies(base, head_dim, device)
    if scaling == "none" or seq_len <= train_len:
        return inv_freq, 1.0
    s = seq_len / train_len
    if scaling == "pi":
        return inv_freq / s, 1.0
    ratio = train_len * inv_freq / (2 * math.pi)
    gamma = ((ratio - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)
    return (1 - gamma) * inv_freq / s + gamma * inv_freq, yarn_temperature(s) ** 2


def test_evaluation_only_scalings_of_a_run_trained_once_are_unchanged(monkeypatch):
    """A model trained once: every evaluation-time scaling gives what it gave before stages existed, to the last
    bit: the frequencies, and the model's logits at 4x (the same forward, with the old function patched in)."""
    import attnlab.model.rope as rope
    from attnlab.model import GPTConfig, build_model

    # the function before stages called the paper's ramp yarn: it is yarn_paper now
    older = {"yarn_paper": "yarn"}
    for scaling in ("none", "ntk", "pi", "yarn_paper"):
        for seq_len, train_len in ((1024, 128), (100, 128), (96, 64), (4096, 1024)):
            new = rope.rope_frequencies(scaling, 64, seq_len, train_len)
            old = _frequencies_before_stages(older.get(scaling, scaling), 64, seq_len, train_len)
            assert torch.equal(new[0], old[0]) and new[1] == old[1], (scaling, seq_len, train_len)
        want_freq, want_mult = (_formula(scaling, 64, 128, 1024) if scaling != "none"
                                else (_formula("pi", 64, 128, 128)[0], 1.0))
        got_freq, got_mult = rope.rope_frequencies(scaling, 64, 1024, 128)
        torch.testing.assert_close(got_freq, want_freq, rtol=1e-14, atol=0)
        assert got_mult == pytest.approx(want_mult, rel=1e-14)
    torch.manual_seed(0)
    model = build_model(GPTConfig(n_layer=1, n_head=2, n_embd=128, vocab_size=64, train_len=32)).eval()
    x = torch.randint(0, 64, (1, 128))
    with torch.no_grad():
        now = {s: model(x, rope_scaling=s)[0] for s in ("none", "ntk", "pi", "yarn_paper")}
        def before_stages(scaling, *args, trained=None, **kwargs):
            assert trained is None  # a model trained once has no training-time scaling
            return _frequencies_before_stages(older.get(scaling, scaling), *args, **kwargs)
        monkeypatch.setattr(rope, "rope_frequencies", before_stages)
        before = {s: model(x, rope_scaling=s)[0] for s in ("none", "ntk", "pi", "yarn_paper")}
    for s in now:
        assert torch.equal(now[s], before[s]), s


def test_studies_written_before_stages_keep_their_search_fingerprint():
    """The fields stages added hash only when set: a study's Tune state from before them still resumes."""
    root = Path(__file__).resolve().parents[1] / "studies"
    pinned = {"proxy_text": "e17e431a9a553553", "smoke": "eff44938855a44e7", "paper_table4": "944631d7a00272dc"}
    for name, fingerprint in pinned.items():
        assert load_spec(root / f"{name}.yaml").search_fingerprint() == fingerprint, name


# ------------------------------------------------------------------------------------------ the factor apart (part 3)
FACTOR_SPEC = """
name: factor_keys
train: {preset: tiny, model: {n_layer: 2}, data: demo-bytes, seq_len: 128, steps: 40, tokens_per_step: 4096,
        micro_batch: 32}
search: {engine: grid}
scheduler: none
space: {attention: [softmax], seeds: [0]}
stages:
  - name: extend
    from: pretrain
    train: {seq_len: 512, steps: 10, micro_batch: 8}
    space:
      rope_scaling: [none, pi, ntk, yarn, yarn_paper, "yarn:16", {method: dynamic, factor: 2}, dynamic]
eval: {multiples: [1, 4]}
"""
# The keys these points had before the factor existed (computed by main at 800bc34, parent key 0123456789abcdef at
# step 40): only yarn, whose meaning changed, has a new one; the paper's ramp keeps yarn's old key.
KEYS_BEFORE = {None: "ba5468834eaabcc5", "pi": "8a65912f15ee02b9", "ntk": "de1d516ef1905c1d",
               "yarn_paper": "19dd38b9b261b9c0"}


def _factor_space(tmp_path):
    path = tmp_path / "factor.yaml"
    path.write_text(FACTOR_SPEC)
    space = load_spec(path).search_space()
    out = {}
    for point in space.grid():
        if point.get("stage"):
            cfg = space.with_parent(space.config(point), "0123456789abcdef", "/runs/parent", 40, 163840)
            rope = point["extend.rope_scaling"]
            out[rope if not isinstance(rope, dict) else f"{rope['method']}:{rope['factor']:g}"] = cfg
    return out


def test_a_stage_sets_the_factor_apart_from_its_length_and_only_those_keys_change(tmp_path):
    configs = _factor_space(tmp_path)
    keys = {name: cfg.train_key("pinned-fingerprint", 257) for name, cfg in configs.items()}
    assert {name: keys[name] for name in KEYS_BEFORE} == KEYS_BEFORE
    assert len(set(keys.values())) == len(keys)  # yarn (the reference's ramp), yarn:16, dynamic:2, dynamic: new keys
    factors = {name: (cfg.rope_scaling, cfg.rope_factor, cfg.gpt_config(257).trained_scaling)
               for name, cfg in configs.items()}
    assert factors["yarn:16"][:2] == ("yarn", 16.0) and factors["yarn:16"][2].scale(512) == 16.0
    assert factors["yarn"][:2] == ("yarn", None) and factors["yarn"][2].scale(512) == 4.0  # seq_len / original_len
    assert factors["dynamic:2"][:2] == ("dynamic", 2.0) and factors["dynamic"][2].scale(512) == 4.0
    assert factors[None][2] is None


def test_lineage_rows_record_the_factor_and_an_older_yarn_is_the_papers_ramp(tmp_path):
    from attnlab.evaluate.extrapolation import lineage_columns

    configs = _factor_space(tmp_path)
    columns = {name: lineage_columns(cfg.model_dump(mode="json"), 10) for name, cfg in configs.items()}
    assert {name: (c["extension"], c["ext_factor"]) for name, c in columns.items()} == {
        None: ("none", None), "pi": ("pi", 4.0), "ntk": ("ntk", 4.0), "yarn": ("yarn", 4.0),
        "yarn_paper": ("yarn_paper", 4.0), "yarn:16": ("yarn", 16.0), "dynamic:2": ("dynamic", 2.0),
        "dynamic": ("dynamic", 4.0)}
    older = configs["yarn"].model_dump(mode="json")
    del older["rope_factor"]  # a run recorded before the factor existed: its yarn was the paper's ramp
    assert lineage_columns(older, 10)["extension"] == "yarn_paper"
    rows = [dict(study="s", trial="t", attention="softmax", scale="inv_sqrt_d", rope_scaling="none", step=10,
                 tokens=40960, eval_len=512, train_len=128, window_mode="nonoverlap", metric="val_loss", value=2.0,
                 seed=0, train_key=f"k{i}", git_sha="abc", **columns[name]) for i, name in enumerate(columns)]
    store = ResultsStore(tmp_path / "store")
    store.write(rows, key=("s", "t"))
    back = store.read(study="s")
    assert sorted(zip(back["extension"], back["ext_factor"].fillna(0))) == sorted(
        (c["extension"], c["ext_factor"] or 0) for c in columns.values())


@pytest.mark.parametrize("axis, message", [
    ("[none, 'yarn:0.5']", "rope_scaling.factor='0.5' is not allowed: use none or a number >= 1"),
    ("['none:2']", "rope_scaling='none:2': none (plain RoPE) takes no factor"),
    ("[{method: pi, factor: 0.9}]", "rope_scaling.factor=0.9 is not allowed: use none or a number >= 1"),
    ("[{method: pi, size: 2}]", "use a name or {method: NAME, factor: F}"),
])
def test_a_bad_factor_is_one_line_before_anything_runs(tmp_path, axis, message):
    path = tmp_path / "bad.yaml"
    path.write_text(FACTOR_SPEC.replace(
        '[none, pi, ntk, yarn, yarn_paper, "yarn:16", {method: dynamic, factor: 2}, dynamic]', axis))
    with pytest.raises(UserError) as error:
        load_spec(path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_two_stages_from_one_parent_each_carry_their_own_axis(tmp_path):
    """Sibling stages (two budgets from pretrain): a child point carries its own stage's axis only (the check once
    made children of children, so one stage's point reached the other with a foreign axis and was refused)."""
    path = tmp_path / "siblings.yaml"
    path.write_text(FACTOR_SPEC.replace("eval: {multiples: [1, 4]}", """  - name: extend_short
    from: pretrain
    train: {seq_len: 512, steps: 2, micro_batch: 8}
    space:
      rope_scaling: [none, pi]
eval: {multiples: [1, 4]}"""))
    space = load_spec(path).search_space()
    for point in space.checked_points():
        stage = point.get("stage")
        assert all(not k.endswith("rope_scaling") or k == f"{stage}.rope_scaling" for k in point), point
    assert space.stage_sizes() == {"pretrain": 1, "extend": 8, "extend_short": 2}


@pytest.mark.parametrize("study, train_len", [("extend_proxy", 128), ("extend_gpu", 1024)])
def test_the_extension_studys_verdicts_are_one_family_of_48_paired_comparisons(tmp_path, study, train_len):
    """studies/extend_proxy.verdicts (and extend_gpu's), fixed with the protocol before the study ran: on rows shaped
    as the study writes them (its every run, its lineage columns), each line picks one configuration a side, paired
    by seed, and the 48 make one Holm family."""
    import numpy as np

    from attnlab.evaluate.extrapolation import lineage_columns
    from attnlab.results import reports

    root = Path(__file__).resolve().parents[1]
    spec = load_spec(root / "studies" / f"{study}.yaml")
    space = spec.search_space()
    rng = np.random.default_rng(0)
    rows = []
    for i, point in enumerate(space.grid()):
        cfg = space.config(point)
        key = f"run{i}"
        if point.get("stage"):
            cfg = space.with_parent(cfg, f"parent-{cfg.attention}-{cfg.seed}", "/runs/p", 400, 1)
        else:
            key = f"parent-{cfg.attention}-{cfg.seed}"
        lineage = lineage_columns(cfg.model_dump(mode="json"), cfg.steps)
        for length in spec.eval.eval_lengths(train_len):
            rows.append(dict(study=study, trial=key, attention=cfg.attention, scale="s", rope_scaling="none",
                             step=cfg.steps, tokens=cfg.steps * 4096, eval_len=length, train_len=train_len,
                             window_mode="nonoverlap", metric="val_loss", value=2 + rng.normal(0, 0.01), seed=cfg.seed,
                             train_key=key, git_sha="abc", stage=point.get("stage"), **lineage))
    store = ResultsStore(tmp_path / "store")
    store.write(rows, key=(study, 0))
    pairs = reports.read_pairs(str(root / "studies" / f"{study}.verdicts"))
    results = reports.compare_family(store.read(study=study), pairs)
    assert len(results) == 48 and {r.family_size for r in results} == {48}
    assert {r.pairing for r in results} == {"seed"} and {r.paired.n_pairs for r in results} == {5}
    assert {r.eval_len for r in results} == {4 * train_len, 16 * train_len}
    assert len({(r.a, r.b, r.at) for r in results}) == 48


def test_data_seed_seed_draws_each_runs_batches_with_its_own_seed(tmp_path):
    """``data_seed: seed`` (the redone extension study's parents and children): each run's batches are drawn with its
    seed, its key is that number's (seed 0 keeps data_seed 0's key, proxy_text's), and the recorded config reads back
    resolved."""
    from attnlab.runfolder import TrainRecord
    from attnlab.train.config import load_train_config
    from attnlab.train.parts import TrainData

    base = {"preset": "tiny", "data": "x", "seq_len": 128, "tokens_per_step": 4096, "micro_batch": 32}
    by_seed = load_train_config({**base, "data_seed": "seed", "seed": 3})
    assert by_seed.data_order_seed == 3 and by_seed.data_seed == "seed"
    assert by_seed.train_key("fp", 257) == load_train_config({**base, "data_seed": 3, "seed": 3}).train_key("fp", 257)
    assert load_train_config({**base, "data_seed": "seed", "seed": 0}).train_key("fp", 257) == \
        load_train_config({**base, "seed": 0}).train_key("fp", 257)
    assert TrainRecord.parse(by_seed).data_seed == 3

    class Source:
        seeds = []

        def train_batch(self, *args, seed, **kwargs):
            self.seeds.append(seed)
            return torch.zeros(1, 1), torch.zeros(1, 1), None

    list(TrainData(Source(), by_seed, 0, 1, torch.device("cpu")).micro_batches(0))
    assert Source.seeds == [3]
    with pytest.raises(UserError, match="data_seed='x': .*is not allowed: use an integer >= 0, or seed"):
        load_train_config({**base, "data_seed": "x"})
