"""Extrapolation evaluation: windowing arithmetic, bits per byte, agreement with training's validation loss,
p_eval leaving weights untouched, rows in a real ResultsStore, diagnostics, and one-line errors."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.errors import UserError
from attnlab.evaluate import EvalConfig, bits_per_byte, bucket_bounds, evaluate_checkpoint, score_windows
from attnlab.evaluate.diagnostics import attention_diagnostics, row_statistics
from attnlab.data.tokenizer import TOKENIZERS
from attnlab.train import load_train_config
from attnlab.validation import parse


def _cfg(**fields) -> EvalConfig:
    return parse(EvalConfig, fields, prefix="eval")

VAL_TOKENS = 2048


@pytest.fixture(scope="module")
def trained_run(demo_data_dir, tmp_path_factory):
    """A tiny softmax model trained for 10 steps (train_len 64) with the local loop: (run_dir, config)."""
    from attnlab.train import load_train_config
    from attnlab.train.loop import LocalSession, train_worker

    run_dir = tmp_path_factory.mktemp("eval-run") / "tiny-run"
    cfg = load_train_config(dict(preset="tiny", data=str(demo_data_dir), steps=10, tokens_per_step=512,
                                 micro_batch=8, val_every=10, val_tokens=VAL_TOKENS, log_every=5,
                                 checkpoint_every=10, warmup_steps=2, lr=3e-3))
    train_worker(cfg, LocalSession(run_dir, device="cpu"), run_dir)
    return run_dir, cfg


class RecordingModel(torch.nn.Module):
    """Scores every target token with ``loss = table[token]`` and records the targets it was asked about."""

    def __init__(self, table: dict[int, float] | None = None):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.table = table
        self.seen: list[np.ndarray] = []

    def token_stats(self, idx, targets, **kwargs):
        self.seen.append(targets.numpy().copy())
        if self.table is None:
            loss = targets.to(torch.float32)
        else:
            loss = torch.tensor([[self.table[int(t)] for t in row] for row in targets.tolist()])
        return loss, torch.zeros_like(targets, dtype=torch.bool)


# ------------------------------------------------------------------------------------------ windows and bpb
def _hand_documents(tmp_path_factory, name: str, says: str, val_tokens: int, tokenizer: str = "gpt2"):
    """40 short hand-written documents (``Document i says: <says>w0 wi ...``) prepared into a folder."""
    from attnlab.data import prepare

    src = tmp_path_factory.mktemp(f"{name}-docs")
    for i in range(40):
        (src / f"d{i:02d}.txt").write_text(f"Document {i} says: {says}" + " ".join(f"w{i * j}" for j in range(i + 3)))
    out = tmp_path_factory.mktemp(f"{name}-prepared") / "prep"
    prepare("text", path=str(src), out=str(out), val_tokens=val_tokens, seed=0, workers=1, progress=False,
            tokenizer=tokenizer)
    return out


@pytest.fixture(scope="module")
def hand_corpus(tmp_path_factory):
    """A prepared folder from 40 short hand-written documents, most of them held out for validation."""
    from attnlab.data import TokenShards

    out = _hand_documents(tmp_path_factory, "hand", "", val_tokens=600)
    return out, TokenShards.open(out)


def test_windows_score_every_token_exactly_once(hand_corpus):
    from attnlab.data.source import open_data

    folder, shards = hand_corpus
    stream = np.asarray(shards.tokens("val"), dtype=np.int64)
    n_val = len(stream)
    assert n_val >= 400
    data = open_data(str(folder))
    lengths = [16, 32, 64]
    budget = ((n_val - 1) // 64) * 64  # whole windows of the largest length: every length scores these tokens
    for length in lengths:
        windows, mask = data.eval_set(length, max_tokens=budget)
        assert mask is None and windows.shape == (budget // length, length + 1)
        model = RecordingModel()
        scores = score_windows(model, windows, batch_size=3)
        scored = np.concatenate([s.ravel() for s in model.seen])
        # targets are exactly stream[1 .. budget], in order, each once; the inputs are stream[0 .. budget-1]
        np.testing.assert_array_equal(scored, stream[1:budget + 1])
        np.testing.assert_array_equal(windows[:, :-1].ravel(), stream[:budget])
        assert scores.count == budget and sum(scores.bucket_count) == budget
        assert scores.total == float(stream[1:budget + 1].sum())


def test_bucket_bounds_are_thirds():
    assert bucket_bounds(4) == [("early", 0, 1), ("middle", 1, 2), ("late", 2, 4)]
    assert bucket_bounds(1024) == [("early", 0, 341), ("middle", 341, 682), ("late", 682, 1024)]


def test_bits_per_byte_by_hand():
    from attnlab.data import EOT_ID, get_encoding

    hello, world = get_encoding().encode_ordinary("Hello world")  # "Hello" (5 bytes), " world" (6 bytes)
    table = TOKENIZERS["gpt2"].token_bytes()
    assert (table[hello], table[world], table[EOT_ID]) == (5, 6, 0)  # the EOT separator is not text
    windows = np.array([[EOT_ID, hello, world, EOT_ID, hello]])
    losses = {hello: 1.0, world: 2.0, EOT_ID: 3.0}
    scores = score_windows(RecordingModel(losses), windows, token_bytes=table)
    # targets: hello(1 nat, 5 B), world(2, 6 B), EOT(3, 0 B), hello(1, 5 B): 7 nats over 16 bytes
    assert scores.n_bytes == 16 and scores.total == 7.0 and scores.count == 4
    assert bits_per_byte(scores.total, scores.n_bytes) == pytest.approx(7.0 / math.log(2) / 16, rel=1e-12)
    # buckets of L = 4: [0,1) early, [1,2) middle, [2,4) late
    assert scores.bucket_total == [1.0, 2.0, 4.0] and scores.bucket_count == [1, 1, 2]
    mask = np.array([[True, False, True, True]])
    masked = score_windows(RecordingModel(losses), windows, mask, token_bytes=table)
    assert (masked.total, masked.count, masked.n_bytes) == (5.0, 3, 10)


# ------------------------------------------------------------------------------------------ real checkpoint
def _final_val(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [m for m in lines if "val_loss" in m][-1]


def test_eval_at_1x_equals_training_val_loss_and_lands_in_store(trained_run, tmp_path):
    from attnlab.results import ResultsStore

    run_dir, cfg = trained_run
    final = _final_val(run_dir)
    store = ResultsStore(tmp_path / "store")
    config = _cfg(multiples=[1, 2], max_tokens=VAL_TOKENS)
    rows = evaluate_checkpoint(run_dir, config, device="cpu", context={"study": "evaltest"}, store=store)
    val = {(r["eval_len"], r["metric"], r.get("bucket")): r for r in rows}
    one_x = val[(64, "val_loss", None)]
    assert one_x["value"] == pytest.approx(final["val_loss"], rel=1e-9, abs=1e-12)
    assert one_x["n_tokens"] == final["val_tokens"] == VAL_TOKENS
    assert val[(128, "val_loss", None)]["n_tokens"] == VAL_TOKENS  # same budget at every length
    # bucket losses average back to the window loss
    for length in (64, 128):
        buckets = [val[(length, "loss_bucket", b)] for b in ("early", "middle", "late")]
        assert sum(b["n_tokens"] for b in buckets) == VAL_TOKENS
        mean = sum(b["value"] * b["n_tokens"] for b in buckets) / VAL_TOKENS
        assert mean == pytest.approx(val[(length, "val_loss", None)]["value"], rel=1e-9)
        assert 0 < val[(length, "bpb", None)]["value"] < val[(length, "val_loss", None)]["value"]
    assert ("acc" not in {r["metric"] for r in rows})  # text data: no target masks
    for row in rows:
        assert row["trial"] == "tiny-run" and row["study"] == "evaltest" and row["step"] == 10
        assert row["tokens"] == 10 * 512 and row["train_len"] == 64 and row["attention"] == "softmax"
        assert row["scale"] == "inv_sqrt_d" and row["p_eval"] is None and row["rope_scaling"] == "ntk"
        provenance = json.loads((run_dir / "provenance.json").read_text())
        assert row["train_key"] == provenance["train_key"] and row["seed"] == cfg.seed
        assert row["window_mode"] == "nonoverlap" and len(row["eval_key"]) == 16
    back = store.read(study="evaltest")
    assert len(back) == len(rows)
    got = back[(back.metric == "val_loss") & (back.eval_len == 64)]["value"].tolist()
    assert got == [one_x["value"]]
    # a retry of the same evaluation replaces its files instead of duplicating rows
    evaluate_checkpoint(run_dir, config, device="cpu", context={"study": "evaltest"}, store=str(tmp_path / "store"))
    assert len(store.read(study="evaltest")) == len(rows)
    # cells already stored are skipped; a new p_eval value evaluates only its own cells
    done = store.stored_eval_keys("evaltest", provenance["train_key"])
    assert len(done) == 2  # one cell per length
    assert evaluate_checkpoint(run_dir, config, device="cpu", context={"study": "evaltest"}, store=store,
                               skip=done) == []
    grown = _cfg(multiples=[1, 2], max_tokens=VAL_TOKENS, p_eval=["none", 3])
    new = evaluate_checkpoint(run_dir, grown, device="cpu", context={"study": "evaltest"}, store=store, skip=done)
    assert {r["p_eval"] for r in new} == {3.0} and {r["eval_len"] for r in new} == {64, 128}
    assert len(store.stored_eval_keys("evaltest", provenance["train_key"])) == 4


def test_p_eval_sweep_leaves_weights_byte_identical(trained_run):
    from attnlab.model.checkpoint import STATE_FILE, find_latest_checkpoint, load_model

    run_dir, _ = trained_run
    state_file = Path(find_latest_checkpoint(run_dir).child(STATE_FILE).path)
    file_digest = hashlib.sha256(state_file.read_bytes()).hexdigest()
    model, cfg, meta = load_model(run_dir, device="cpu")
    before = {k: v.detach().clone().numpy().tobytes() for k, v in model.state_dict().items()}
    rows = evaluate_checkpoint((model, cfg, meta), _cfg(lengths=[64, 256], p_eval=["none", 3, 15],
                                                        rope_scaling="both", max_tokens=256, diagnostics=True),
                               device="cpu")
    after = {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}
    assert before.keys() == after.keys() and all(before[k] == after[k] for k in before)
    assert hashlib.sha256(state_file.read_bytes()).hexdigest() == file_digest
    loss = {(r["p_eval"], r["rope_scaling"], r["eval_len"]): r["value"] for r in rows if r["metric"] == "val_loss"}
    assert len(loss) == 3 * 2 * 2
    assert loss[(15.0, "ntk", 64)] != loss[(None, "ntk", 64)]  # the sharpening really changed the forward
    assert loss[(None, "ntk", 64)] == loss[(None, "none", 64)]  # NTK is the identity at L <= train_len
    assert loss[(None, "ntk", 256)] != loss[(None, "none", 256)]
    # diagnostics: one entropy and sink_mass per layer and configuration; sharpening lowers the entropy
    ent = {(r["p_eval"], r["rope_scaling"], r["eval_len"], r["layer"]): r["value"] for r in rows
           if r["metric"] == "entropy"}
    assert len(ent) == 3 * 2 * 2 * model.cfg.n_layer
    for layer in range(model.cfg.n_layer):
        assert 0 < ent[(15.0, "ntk", 256, layer)] < ent[(None, "ntk", 256, layer)] <= math.log(256)


def test_a_model_whose_graph_does_not_compile_is_scored_eagerly_with_one_line(trained_run, monkeypatch):
    """torch 2.11's inductor failed to lower LSSAR's compiled evaluation graph on an H100 and an H200
    (bench/RESULTS.md), and evaluation compiles by default on a GPU: the cells are scored with the blocks eager
    instead, with one line naming the cause and eval.compile: false, and the same values as an eager evaluation.
    Here inductor's lowering raises the GPU's assertion (the seam: its ``compile_fx``)."""
    import torch._dynamo
    import torch._inductor.compile_fx

    calls = []

    def lowering_fails(*args, **kwargs):
        calls.append(1)
        raise AssertionError("convert FlexibleLayout to FixedLayout first")

    run_dir, _ = trained_run
    fields = dict(lengths=[64, 128], p_eval=["none", 15], max_tokens=256)
    eager = evaluate_checkpoint(run_dir, _cfg(**fields, compile=False), device="cpu", log=lambda line: None)
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lowering_fails)
    torch._dynamo.reset()
    lines: list[str] = []
    try:
        rows = evaluate_checkpoint(run_dir, _cfg(**fields, compile=True), device="cpu", log=lines.append)
    finally:
        torch._dynamo.reset()
    assert calls, "the compiled graph was never built"
    told = [line for line in lines if "failed to compile" in line]
    assert len(told) == 1 and "convert FlexibleLayout to FixedLayout first" in told[0], lines
    assert "scoring the remaining 4 cell(s) with the blocks eager (eval.compile: false" in told[0]
    value = lambda rs: sorted((r["metric"], r["eval_len"], str(r["p_eval"]), r["value"]) for r in rs)  # noqa: E731
    assert value(rows) == value(eager) and len(rows) == len(eager) > 0


def test_passkey_rows_from_a_real_model(trained_run):
    run_dir, _ = trained_run
    rows = evaluate_checkpoint(run_dir, _cfg(lengths=[128], max_tokens=128, passkey=True, passkey_trials=1),
                               device="cpu")
    pk = [r for r in rows if r["window_mode"] == "passkey"]
    assert {(r["metric"], r.get("bucket")) for r in pk} == {
        *(("passkey_acc", f"depth={d:g}") for d in (0, 0.25, 0.5, 0.75, 1)), ("passkey_acc", None),
        ("passkey_rank", None)}
    for r in pk:
        assert r["eval_len"] == 128 and 0 <= r["value"] <= 9


def test_diagnostics_row_statistics_by_hand():
    weights = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [-0.5, 0.5, 0.0, 0.0]])
    entropy, sink = row_statistics(weights)
    torch.testing.assert_close(entropy, torch.tensor([0.0, math.log(4), math.log(2)]))
    torch.testing.assert_close(sink, torch.tensor([1.0, 0.25, 0.5]))


def test_diagnostics_chunking_is_exact(trained_run):
    from attnlab.attention import attention_weights
    from attnlab.model.checkpoint import load_model

    run_dir, _ = trained_run
    model, _, _ = load_model(run_dir, device="cpu")
    window = np.arange(1, 98, dtype=np.int64)[None, :]  # L = 96
    whole = attention_diagnostics(model, window, rope_scaling="ntk")
    chunked = attention_diagnostics(model, window, rope_scaling="ntk", chunk_bytes=1)  # one row at a time
    captured = {}

    def capture(layer, q, k, qk_gain=None):
        captured[layer] = attention_weights(q, k, model.spec)

    model.hidden_states(torch.as_tensor(window[:, :-1]), rope_scaling="ntk", on_attention=capture)
    for a, b in zip(whole, chunked):
        assert a["layer"] == b["layer"] and a["n_tokens"] == b["n_tokens"] == 96
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-5)
        entropy, sink = row_statistics(captured[a["layer"]])
        assert a["entropy"] == pytest.approx(float(entropy.mean()), rel=1e-5)
        assert a["sink_mass"] == pytest.approx(float(sink.mean()), rel=1e-5)


# ------------------------------------------------------------------------------------------ bad input
def test_eval_config_parses_the_protocol_words():
    config = _cfg(lengths=["1k", 2048], p_eval=["train", 3, "15"], rope_scaling="both")
    assert config.lengths == [1024, 2048] and config.p_eval == [None, 3.0, 15.0]  # train: as trained (none)
    assert config.rope_scaling == ["ntk", "none"] and config.max_tokens == 2**18  # the one default, any device
    cells = _cfg(multiples=[1, 2], p_eval=["none", 3]).cells(64)
    assert [(c.length, c.p_eval) for c in cells] == [(64, None), (64, 3.0), (128, None), (128, 3.0)]
    keys = {c.key("train", 10, "data") for c in cells}
    assert len(keys) == 4 and cells[0].key("train", 10, "data") != cells[0].key("train", 10, "other-data")


@pytest.mark.parametrize("fields, fragment", [
    (dict(lengths=["64", "abc"]), "eval.lengths"),
    (dict(lengths=[0]), "eval.lengths"),
    (dict(rope_scaling=["linear"]), "'linear' is not allowed: use one of ntk, none, pi, yarn"),
    (dict(p_eval=[0.5]), "p_eval=0.5 is not allowed"),
    (dict(multiples=[1], lengths=[64]), "give multiples or lengths, not both"),
])
def test_bad_eval_config_is_one_line(fields, fragment):
    with pytest.raises(UserError) as info:
        _cfg(**fields)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("fields, context, fragment", [
    (dict(lengths=[64]), {"colour": "red"}, "context: 'colour'"),
    (dict(lengths=[10**7], max_tokens=10**8), None, "10000000 does not fit one window"),
    (dict(lengths=[64, 128], max_tokens=100), None, "max_tokens=100"),
])
def test_bad_evaluation_is_one_line(trained_run, fields, context, fragment):
    run_dir, _ = trained_run
    with pytest.raises(UserError) as info:
        evaluate_checkpoint(run_dir, _cfg(**fields), device="cpu", context=context)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_cli_errors_and_table(trained_run, tmp_path, capsys):
    from attnlab.cli import main

    assert main(["eval", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlab: error: checkpoint path") and "\n" not in err
    run_dir, _ = trained_run
    assert main(["eval", str(run_dir), "--rope", "linear"]) == 2
    assert capsys.readouterr().err.strip() == ("attnlab: error: --rope='linear' is not allowed: use one of ntk, none, "
                                               "pi, yarn, yarn_paper, dynamic (or both: ntk,none)")
    assert main(["eval", str(run_dir), "--p-eval", "none,0.5"]) == 2
    assert "--p-eval='0.5' is not allowed" in capsys.readouterr().err
    assert main(["eval", str(run_dir), "--multiples", "1,2", "--max-tokens", "256", "--p-eval", "none,3",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "## val_loss" in out and "| p_eval | 64 (1x) | 128 (2x) |" in out and "## bpb" in out


def test_rows_record_the_power_actually_trained_with(demo_data_dir):
    """lssar trains with p = 15 by default (no explicit p_train): its rows must say p_train = 15, not none."""
    import torch

    from attnlab.model import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset("tiny", attention="lssar")).eval()
    cfg = load_train_config({"preset": "tiny", "attention": "lssar", "data": str(demo_data_dir), "seq_len": 64})
    rows = evaluate_checkpoint((model, cfg, {"step": 0}), _cfg(multiples=[1], max_tokens=128), device="cpu")
    assert rows and all(r["p_train"] == 15.0 for r in rows)
    assert {r["p_eval"] for r in rows} == {None}


@pytest.fixture(scope="module")
def byte_corpus(tmp_path_factory):
    """The hand corpus's kind of documents (with a two-byte character) prepared with --tokenizer bytes."""
    return _hand_documents(tmp_path_factory, "byte", "café ", val_tokens=2400, tokenizer="bytes")


def test_a_gpt2_checkpoint_on_byte_data_is_one_line(trained_run, byte_corpus, tmp_path):
    """A GPT-2-vocabulary model would read byte ids as GPT-2 ids without an error: refused, nothing written."""
    run_dir, _ = trained_run
    store = tmp_path / "store"
    with pytest.raises(UserError) as info:
        evaluate_checkpoint(run_dir, _cfg(lengths=[64], max_tokens=128), device="cpu", data=str(byte_corpus),
                            store=str(store))
    message = str(info.value)
    assert "tokenised with bytes (257 ids) but the model was trained on a 50,257-id vocabulary (gpt2)" in message
    assert "\n" not in message and not store.exists()


def test_a_byte_model_scores_bits_per_byte_and_refuses_gpt2_data(byte_corpus, demo_data_dir):
    """On byte data every token but the separator is one byte: bpb = nats / ln 2 over the non-separator targets."""
    from attnlab.model import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=257)).eval()
    cfg = load_train_config({"preset": "tiny", "attention": "softmax", "data": str(byte_corpus), "seq_len": 64})
    rows = evaluate_checkpoint((model, cfg, {"step": 0}), _cfg(multiples=[1], max_tokens=2048), device="cpu")
    by_metric = {r["metric"]: r["value"] for r in rows if r.get("bucket") is None}
    from attnlab.data import TokenShards

    windows = np.asarray(TokenShards.open(byte_corpus).eval_windows("val", seq_len=64, max_tokens=2048))
    targets = windows[:, 1:]
    n_bytes = int((targets != 256).sum())
    assert by_metric["bpb"] == pytest.approx(by_metric["val_loss"] * targets.size / math.log(2) / n_bytes, rel=1e-5)
    refused = r"tokenised with gpt2 \(50,257 ids\) but the model was trained on a 257-id vocabulary \(bytes\)"
    with pytest.raises(UserError, match=refused):
        evaluate_checkpoint((model, cfg, {"step": 0}), _cfg(multiples=[1], max_tokens=128), device="cpu",
                            data=str(demo_data_dir))


# ------------------------------------------------------------------------------------ PI and YaRN scalings
def test_eval_config_takes_the_four_rope_scalings_and_refuses_others_in_one_line():
    config = _cfg(multiples=[1, 2], rope_scaling=["none", "ntk", "pi", "yarn"])
    cells = config.cells(64)
    assert {c.rope for c in cells} == {"none", "ntk", "pi", "yarn"} and len(cells) == 8
    assert len({c.key("train", 10, "data") for c in cells}) == 8
    with pytest.raises(UserError) as info:
        _cfg(rope_scaling=["none", "x"])
    assert "'x' is not allowed: use one of ntk, none, pi, yarn" in str(info.value) and "\n" not in str(info.value)


def test_eval_cli_rope_flag_takes_pi_and_yarn():
    import argparse

    from attnlab.evaluate.cli import add_parser, eval_config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["eval", "run", "--rope", "none,pi,yarn,both"])
    assert eval_config_from_args(args).rope_scaling == ["none", "pi", "yarn", "ntk"]
    with pytest.raises(UserError) as info:
        eval_config_from_args(parser.parse_args(["eval", "run", "--rope", "linear"]))
    assert str(info.value) == ("--rope='linear' is not allowed: use one of ntk, none, pi, yarn, yarn_paper, dynamic "
                               "(or both: ntk,none)")
    args = parser.parse_args(["eval", "run", "--rope", "yarn_paper,dynamic:2"])
    assert eval_config_from_args(args).rope_scaling == ["yarn_paper", "dynamic:2"]
    with pytest.raises(UserError, match="dynamic takes its factor at evaluation, e.g. dynamic:2"):
        eval_config_from_args(parser.parse_args(["eval", "run", "--rope", "dynamic"]))


def test_pi_and_yarn_cells_are_measured_without_retraining(trained_run):
    """Every scaling is a cell of the same checkpoint; at 1x they all equal none (one forward), beyond they differ."""
    run_dir, _ = trained_run
    rows = evaluate_checkpoint(run_dir, _cfg(multiples=[1, 2], rope_scaling=["none", "ntk", "pi", "yarn"],
                                             max_tokens=256), device="cpu")
    loss = {(r["rope_scaling"], r["eval_len"]): r["value"] for r in rows if r["metric"] == "val_loss"}
    assert {loss[(rope, 64)] for rope in ("none", "ntk", "pi", "yarn")} == {loss[("none", 64)]}
    assert len({loss[(rope, 128)] for rope in ("none", "ntk", "pi", "yarn")}) == 4


def test_diagnostics_of_a_learned_qk_norm_model_use_its_gains():
    """softmax_qknorm's weights depend on each layer's learned gains: the diagnostics recompute them with the gains
    the layer used (the model's own attention output is the reference)."""
    from attnlab.attention import attention_weights
    from attnlab.evaluate.diagnostics import attention_diagnostics
    from attnlab.model import GPT, preset

    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=64, attention="softmax_qknorm")).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_gain.mul_(3.0).add_(torch.rand_like(block.attn.q_gain))
    window = np.random.default_rng(0).integers(0, 64, size=(1, 33))
    seen = {}

    def capture(layer, q, k, qk_gain=None):
        seen[layer] = attention_weights(q, k, model.spec, qk_gain=qk_gain)[0]

    model.hidden_states(torch.as_tensor(window[:, :-1]), on_attention=capture)
    rows = attention_diagnostics(model, window)
    for row in rows:
        w = seen[row["layer"]].double()
        w = w / w.sum(-1, keepdim=True)
        entropy = torch.special.entr(w).sum(-1).mean().item()
        assert row["entropy"] == pytest.approx(entropy, rel=1e-4)
    plain = attention_weights(*(torch.randn(1, 2, 8, 64) for _ in range(2)), model.spec,
                              qk_gain=(torch.ones(64), torch.ones(64)))
    assert plain.shape == (1, 2, 8, 8)


def test_evaluation_reads_the_training_config_as_a_typed_record_with_no_defaults_of_its_own():
    """The fields evaluation reads of a run come from the config the run recorded (every field, TrainConfig's
    defaults applied); a partial one is refused by name rather than completed with restated defaults."""
    from attnlab.runfolder import TrainRecord

    cfg = load_train_config({"preset": "tiny", "data": "x", "val_batch": 3, "precision": "fp32"})
    record = TrainRecord.parse(cfg.model_dump(mode="json"))
    assert (record.val_batch, record.precision, record.data_seed, record.tokens_per_step) == (3, "fp32", 0, 1024)
    assert TrainRecord.parse(cfg) == record
    with pytest.raises(UserError, match="checkpoint: its training config has no 'preset'"):
        TrainRecord.parse({"data": "x"})
    with pytest.raises(UserError, match="has no 'seed'"):
        evaluate_checkpoint((RecordingModel(), {k: v for k, v in record.record.items() if k != "seed"}, {}),
                            _cfg(multiples=[1]))
