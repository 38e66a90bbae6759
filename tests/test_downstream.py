"""Downstream tasks through lm-evaluation-harness: tasks of the harness's own YAML format read from a local
folder (tests/downstream_tasks, data written here as JSONL), scored by attnlab's harness model class, stored as
rows with ``task`` and ``stderr``, shown by ``attnlab results table --where task=...``, in a study as one more
evaluation cell kind; a missing folder or an unknown task is one line.

The scores checked are known: a tiny model trained on the demo corpus prefers English to random GPT-2 tokens,
so a multiple-choice task whose gold answer is the English continuation in 9 of 12 documents (and the random
tokens in 3) scores acc 0.75 exactly; the last-word and perplexity tasks are recomputed here token by token
from the model's own per-token losses (not through the harness class)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.errors import UserError
from attnlab.evaluate import EvalConfig, evaluate_checkpoint
from attnlab.validation import parse

pytest.importorskip("lm_eval")

from conftest_downstream import MC_GOLD_ENGLISH, N_MC  # noqa: E402
from conftest_downstream import passages as _passages  # noqa: E402


@pytest.fixture(scope="module")
def trained(demo_data_dir, tmp_path_factory):
    """A tiny softmax model (train_len 64) trained 20 steps on the demo corpus with the local loop."""
    from attnlab.train import load_train_config
    from attnlab.train.loop import LocalSession, train_worker

    run_dir = tmp_path_factory.mktemp("downstream-run") / "tiny-run"
    cfg = load_train_config(dict(preset="tiny", data=str(demo_data_dir), steps=20, tokens_per_step=1024,
                                 micro_batch=16, val_every=20, val_tokens=1024, log_every=20,
                                 checkpoint_every=20, warmup_steps=4, lr=3e-3))
    train_worker(cfg, LocalSession(run_dir, device="cpu"), run_dir)
    return run_dir


# ------------------------------------------------------------------------------------------ by hand
def _model(run_dir):
    from attnlab.model.checkpoint import load_model

    model, _, _ = load_model(run_dir, device="cpu")
    return model.eval()


# The harness scores in padded batches, the helpers below one sequence at a time: the same log-likelihoods to float32
# rounding, not bit for bit. An accuracy (an argmax) is then compared exactly only where every decision it counts is
# won by more than DECIDED: a choice's log-likelihood over the next one's, a continuation token's logit over the
# best other token's.
DECIDED = 1e-4


def _logprob(model, context_tokens: list[int], continuation_tokens: list[int]) -> tuple[float, bool, float]:
    """Sum of log p(continuation | context), whether every continuation token is the argmax, and the smallest
    distance between a continuation token's logit and the best other logit, from the model's logits on the one full
    sequence (no batching, no padding, no truncation): one forward, its losses computed as ``token_stats`` does."""
    seq = torch.tensor([context_tokens + continuation_tokens])
    n, target = len(continuation_tokens), torch.tensor(continuation_tokens)
    with torch.no_grad():
        logits = model(seq[:, :-1])[0][0, -n:].float()
    loss = F.cross_entropy(logits, target, reduction="none")
    logits = logits.double()
    chosen = logits.gather(1, target[:, None])[:, 0]
    others = logits.scatter(1, target[:, None], float("-inf")).max(-1).values
    return (-float(loss.double().sum()), bool((logits.argmax(-1) == target).all()),
            float((chosen - others).abs().min()))


def _decided(values) -> float:
    """How far the largest of ``values`` leads the next."""
    top = sorted(values, reverse=True)
    return top[0] - top[1]


def _pair(context: str, continuation: str) -> tuple[list[int], list[int]]:
    from attnlab.data.tokenizer import get_encoding

    enc = get_encoding()
    ctx = enc.encode_ordinary(context)
    return ctx, enc.encode_ordinary(context + continuation)[len(ctx):]


def _expected_mc(model, docs) -> tuple[float, float, list[bool]]:
    acc, acc_norm, prefers = [], [], []
    for doc in docs:
        lls = [_logprob(model, *_pair(doc["context"], " " + c))[0] for c in doc["choices"]]
        norm = [ll / len(c) for ll, c in zip(lls, doc["choices"])]  # per character of the choice
        assert min(_decided(lls), _decided(norm)) > DECIDED, (doc, lls)  # see DECIDED
        prefers.append(int(np.argmax(lls)) == doc["english"])
        acc.append(int(np.argmax(lls)) == doc["label"])
        acc_norm.append(int(np.argmax(norm)) == doc["label"])
    return float(np.mean(acc)), float(np.mean(acc_norm)), prefers


def _expected_lastword(model, texts) -> tuple[float, float]:
    lls, greedy = [], []
    for text in texts:
        words = text.split(" ")
        ll, is_greedy, margin = _logprob(model, *_pair(" ".join(words[:-1]), " " + words[-1]))
        assert margin > DECIDED, (text, margin)  # see DECIDED
        lls.append(ll)
        greedy.append(is_greedy)
    return math.exp(-float(np.mean(lls))), float(np.mean(greedy))


def _expected_bpb(model, texts) -> float:
    from attnlab.data.tokenizer import EOT_ID, get_encoding

    enc = get_encoding()
    total, n_bytes = 0.0, 0
    for text in texts:
        tokens = enc.encode_ordinary(text)
        assert len(tokens) <= 64  # one window at the training length
        total += _logprob(model, [EOT_ID], tokens)[0]
        n_bytes += len(text.encode("utf-8"))
    return -total / math.log(2) / n_bytes


def _value(rows, task, metric, length=64):
    found = [r for r in rows if r.get("task") == task and r["metric"] == metric and r["eval_len"] == length]
    assert len(found) == 1, (task, metric, length, rows)
    return found[0]


# ------------------------------------------------------------------------------------------ tests
def test_known_scores_land_in_the_store_and_the_table(trained, downstream_tasks, tmp_path, capsys, monkeypatch):
    import multiprocessing

    from attnlab.cli import main
    from attnlab.results import ResultsStore

    def no_fork(*args, **kwargs):
        raise AssertionError("the harness forked a multiprocessing pool (its bootstrap must run in this process)")

    monkeypatch.setattr(multiprocessing, "Pool", no_fork)  # a fork of a process with Ray's threads can hang

    folder, mc, lastword, rolling = downstream_tasks
    model = _model(trained)
    acc, acc_norm, prefers = _expected_mc(model, mc)
    assert all(prefers), "the trained model prefers the English continuation in every document"
    assert acc == MC_GOLD_ENGLISH / N_MC  # 0.75: what the task's labels make of that preference

    config = parse(EvalConfig, {"downstream": {"tasks": ["attnlab_mc", "attnlab_lastword", "attnlab_rolling"],
                                               "data": str(folder)}, "windows": False}, prefix="eval")
    store = tmp_path / "results"
    rows = evaluate_checkpoint(trained, config, store=str(store), device="cpu", context={"study": "down"})
    assert _value(rows, "attnlab_mc", "acc")["value"] == pytest.approx(0.75, abs=1e-12)
    assert _value(rows, "attnlab_mc", "acc_norm")["value"] == pytest.approx(acc_norm, abs=1e-12)
    stderr = _value(rows, "attnlab_mc", "acc")["stderr"]
    assert stderr == pytest.approx(math.sqrt(0.75 * 0.25 / (N_MC - 1)), rel=1e-9)  # the harness's sample stderr
    perplexity, greedy = _expected_lastword(model, lastword)
    assert _value(rows, "attnlab_lastword", "perplexity")["value"] == pytest.approx(perplexity, rel=1e-4)
    assert _value(rows, "attnlab_lastword", "perplexity")["stderr"] > 0  # bootstrapped, in one process
    assert _value(rows, "attnlab_lastword", "acc")["value"] == pytest.approx(greedy, abs=1e-12)
    assert _value(rows, "attnlab_rolling", "bpb")["value"] == pytest.approx(_expected_bpb(model, rolling), rel=1e-4)
    assert {r["window_mode"] for r in rows} == {"downstream"} and {r["rope_scaling"] for r in rows} == {"ntk"}

    stored = ResultsStore(str(store)).read(study="down")
    assert len(stored) == len(rows) and set(stored["task"]) == {"attnlab_mc", "attnlab_lastword", "attnlab_rolling"}

    assert main(["results", "table", "--store", str(store), "--metric", "acc", "--where", "task=attnlab_mc"]) == 0
    table = capsys.readouterr().out
    assert "0.7500" in table and "attnlab_lastword" not in table

    # evaluated again with the stored cells skipped: nothing is measured, nothing written
    skip = ResultsStore(str(store)).stored_eval_keys("down", rows[0]["train_key"])
    assert evaluate_checkpoint(trained, config, store=str(store), device="cpu", context={"study": "down"},
                               skip=skip) == []
    assert len(ResultsStore(str(store)).read(study="down")) == len(rows)


def test_cli_scores_beyond_the_training_length(trained, downstream_tasks, tmp_path, capsys):
    """--lengths 64,256 --rope both: at 256 the last-word contexts are no longer cut to 64 tokens; with rope none
    the scores are those of the whole sequence, recomputed here."""
    from attnlab.cli import main

    folder = tmp_path / "tasks"
    shutil.copytree(downstream_tasks[0], folder)
    long_texts = [_passages(1, 160, offset=200 + i)[0] for i in range(3)]
    (folder / "data" / "lastword.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in long_texts))
    code = main(["eval", str(trained), "--downstream", "attnlab_lastword", "--tasks-dir", str(folder),
                 "--lengths", "64,256", "--rope", "both", "--format", "csv", "--quiet", "--device", "cpu"])
    assert code == 0
    out = capsys.readouterr().out
    import io

    import pandas as pd

    section = out.split("# perplexity\n")[1].split("#")[0]
    frame = pd.read_csv(io.StringIO(section))
    assert len(frame) == 2  # rope ntk and none
    model = _model(trained)
    full, _ = _expected_lastword(model, long_texts)
    assert all(len(_pair(*t.rsplit(" ", 1))[0]) > 150 for t in long_texts)
    none_row = frame[frame.iloc[:, 0] == "none"]
    columns = [c for c in frame.columns if c.startswith("mean@")]
    assert columns == ["mean@64", "mean@256"]
    assert float(none_row["mean@256"].iloc[0]) == pytest.approx(full, rel=1e-4)
    assert float(none_row["mean@64"].iloc[0]) != pytest.approx(full, rel=1e-4)  # cut to 64 tokens of context


def test_a_missing_folder_or_an_unknown_task_is_one_line(trained, downstream_tasks, tmp_path):
    from attnlab.evaluate.downstream import check_tasks

    folder = downstream_tasks[0]
    with pytest.raises(UserError, match=r"eval.downstream.data: .*nowhere is not a folder") as missing:
        check_tasks(["attnlab_mc"], str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=r"task 'attnlab_nope' is not in .*attnlab_lastword, attnlab_mc") as unknown:
        check_tasks(["attnlab_mc", "attnlab_nope"], str(folder))
    for exc in (missing, unknown):
        assert "\n" not in str(exc.value)
    config = parse(EvalConfig, {"downstream": {"tasks": ["attnlab_nope"], "data": str(folder)}, "windows": False},
                   prefix="eval")
    with pytest.raises(UserError, match="attnlab_nope"):
        evaluate_checkpoint(trained, config, device="cpu")
    with pytest.raises(UserError, match="eval.downstream"):
        parse(EvalConfig, {"downstream": []}, prefix="eval")


def test_tasks_in_a_bucket_are_copied_and_scored(trained, downstream_tasks, s3_bucket):
    """A task folder in a bucket (an S3 server): copied to a local temporary folder, scored as from disk."""
    from attnlab.location import Location

    Location.parse(s3_bucket).upload(str(downstream_tasks[0]), "lm-tasks")
    config = parse(EvalConfig, {"downstream": {"tasks": ["attnlab_mc"], "data": f"{s3_bucket}/lm-tasks"},
                                "windows": False}, prefix="eval")
    rows = evaluate_checkpoint(trained, config, device="cpu")
    assert _value(rows, "attnlab_mc", "acc")["value"] == pytest.approx(MC_GOLD_ENGLISH / N_MC, abs=1e-12)
    with pytest.raises(UserError, match="lm-tasks-missing is not a folder"):
        evaluate_checkpoint(trained, config.model_copy(update={"downstream": config.downstream.model_copy(
            update={"data": f"{s3_bucket}/lm-tasks-missing"})}), device="cpu")


def test_a_diverged_runs_downstream_cell_is_a_nan_acc_row_of_its_task():
    from attnlab.evaluate.cell_rows import nan_rows
    from attnlab.results.schema import validate_row

    cells = parse(EvalConfig, {"downstream": ["hellaswag", "piqa"], "windows": False}, prefix="eval").cells(64)
    base = dict(study="s", trial="t", attention="softmax", scale="inv_sqrt_d", p_train=None, step=3, tokens=96,
                train_len=64, seed=0, train_key="abc", git_sha="unknown")
    rows = [validate_row(row) for cell in cells for row in nan_rows(base, cell, cell.key("abc", 3, "fp"))]
    assert [(r["task"], r["metric"], r["window_mode"]) for r in rows] == [("hellaswag", "acc", "downstream"),
                                                                         ("piqa", "acc", "downstream")]
    assert all(math.isnan(r["value"]) for r in rows) and rows[0]["eval_key"] != rows[1]["eval_key"]


def test_synthetic_vocabulary_models_are_refused(tmp_path):
    from attnlab.evaluate.harness_lm import AttnlabLM
    from attnlab.model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16, train_len=32))
    with pytest.raises(UserError, match="GPT-2 tokenised text"):
        AttnlabLM(model)


@pytest.mark.cuda_proxy
def test_a_compiled_model_scores_requests_with_one_graph_per_width_bucket():
    # Requests of 8 lengths, 2 per batch: each batch used to be padded to its longest request, one compiled graph per
    # distinct width (4 here, one per batch); now to a power of two (the model reads 39, 29, 19, 11 tokens: 64,
    # 32, 32, 16) with the last batch's rows filled up too, so graphs = width buckets (3). The scores are the
    # unpadded ones.
    from torch._dynamo.testing import CompileCounter

    from attnlab.evaluate.harness_lm import AttnlabLM, padded_width
    from attnlab.model import GPT, compile_model, preset
    from attnlab.names import GPT2_VOCAB

    assert [padded_width(n, 64) for n in (2, 17, 18, 33, 34, 65)] == [17, 17, 33, 33, 65, 65]
    assert padded_width(16385, 16384) == 16385 and padded_width(3000, 3000) == 3001
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=GPT2_VOCAB, n_layer=1)).eval()
    eager = GPT(preset("tiny", vocab_size=GPT2_VOCAB, n_layer=1)).eval()
    eager.load_state_dict(model.state_dict())
    counter = CompileCounter()
    compile_model(model, True, backend=counter)
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 1000, n - 3).tolist(), rng.integers(0, 1000, 3).tolist())
             for n in (40, 38, 30, 28, 20, 18, 12, 9)]
    try:
        got = AttnlabLM(model, batch_size=2)._score(pairs)
        assert counter.frame_count == 3, counter.frame_count
    finally:
        torch._dynamo.reset()
    decided = 0
    for (ctx, cont), (logprob, greedy) in zip(pairs, got):
        want, want_greedy, margin = _logprob(eager, ctx, cont)
        assert logprob == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy or margin <= DECIDED  # see DECIDED
        decided += margin > DECIDED
    assert decided >= len(pairs) // 2  # most flags are compared (all of them here: the smallest margin is 0.5)


@pytest.mark.ray
def test_study_downstream_cells_run_once_and_a_new_task_trains_nothing(ray_session, demo_data_dir, downstream_tasks,
                                                                       tmp_path, capsys):
    from attnlab.cli import main
    from attnlab.results import ResultsStore
    from attnlab.study.runner import run_study, study_state
    from attnlab.study.spec import load_spec

    folder, mc, lastword, _ = downstream_tasks
    train = {"preset": "tiny", "data": str(demo_data_dir), "steps": 4, "tokens_per_step": 512, "micro_batch": 8,
             "lr": 3.0e-3, "warmup_steps": 1, "log_every": 4, "val_every": 4, "val_tokens": 1024,
             "checkpoint_every": 4, "keep_checkpoints": 1, "max_failures": 0, "cpus_per_worker": 0.5}
    study = {"name": "down", "train": train, "search": {"engine": "grid"}, "space": {"attention": ["softmax"]},
             "objective": "val_loss@1x",
             "eval": {"multiples": [1], "max_tokens": 1024,
                      "downstream": {"tasks": ["attnlab_mc"], "data": str(folder)}}}
    store_uri, runs = str(tmp_path / "results"), str(tmp_path / "runs")
    first = run_study(load_spec(study), store=store_uri, runs=runs, verbose=0)
    assert first.trained == 1 and [t["status"] for t in first.trials] == ["complete"]
    key = first.trials[0]["train_key"]
    store = ResultsStore(store_uri)
    rows = store.read(study="down", task="attnlab_mc")
    assert sorted(rows["metric"]) == ["acc", "acc_norm"]
    assert set(rows["window_mode"]) == {"downstream"} and set(rows["eval_len"]) == {64}
    model = _model(study_state(load_spec(study), runs).run(key).path)
    acc, acc_norm, _ = _expected_mc(model, mc)  # the study's 4-step model, scored here token by token
    assert rows.set_index("metric")["value"].to_dict() == pytest.approx({"acc": acc, "acc_norm": acc_norm})

    assert main(["results", "table", "--store", store_uri, "--metric", "acc", "--where", "task=attnlab_mc"]) == 0
    assert f"{acc:.4f}" in capsys.readouterr().out
    n_rows = len(store.read(study="down"))
    again = run_study(load_spec(study), store=store_uri, runs=runs, verbose=0)
    assert again.trained == 0 and again.evaluated == 0 and len(store.read(study="down")) == n_rows

    grown = {**study, "eval": {**study["eval"], "downstream": {"tasks": ["attnlab_mc", "attnlab_lastword"],
                                                             "data": str(folder)}}}
    third = run_study(load_spec(grown), store=store_uri, runs=runs, verbose=0)
    assert third.trained == 0 and third.evaluated == 1  # the one new cell: the new task on the old checkpoint
    after = store.read(study="down")
    assert len(after) == n_rows + 2  # perplexity and acc of the new task; nothing else rewritten
    perplexity, greedy = _expected_lastword(model, lastword)
    new = after[after["task"] == "attnlab_lastword"].set_index("metric")["value"].to_dict()
    assert new == pytest.approx({"perplexity": perplexity, "acc": greedy}, rel=1e-4)

    # an unknown task: the study refuses it with one line naming it, before any trial starts or anything is written
    bad = {**study, "name": "down-bad", "space": {"attention": ["lssa"]},
           "eval": {**study["eval"], "downstream": {"tasks": ["attnlab_nope"], "data": str(folder)}}}
    with pytest.raises(UserError, match="task 'attnlab_nope' is not in") as refused:
        run_study(load_spec(bad), store=store_uri, runs=runs, verbose=0)
    assert "\n" not in str(refused.value) and not (tmp_path / "runs" / "down-bad").exists()
