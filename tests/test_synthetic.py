"""Synthetic probe tasks: layouts checked on hand-built examples, determinism, rank/micro slicing, masked
loss and accuracy by hand, and a short real training run that reports target accuracy."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.data.generators.synthetic import EVAL_STREAM, SYNTHETIC_TASKS, PasskeyTokens, open_task
from attnlab.errors import UserError
from attnlab.model.scoring import mean_window_loss
from attnlab.model import GPT, preset
from attnlab.data.source import open_data


def one_window(spec: dict, length: int, row: int = 0, seed: int = 0):
    data = open_task(spec)
    tokens, mask = data.windows(EVAL_STREAM, seed, length, range(row, row + 1), length)
    return tokens[0], mask[0]


# ---------------------------------------------------------------- copy_distractors


def test_copy_distractors_hand_built_small():
    # L = 12, copy_len 4: 13 tokens = 5 distractors, block at 5..8, repeat at 9..12; targets predict 9..12.
    tokens, mask = one_window({"synthetic": "copy_distractors", "vocab": 16, "copy_len": 4}, 12)
    assert tokens.shape == (13,) and mask.shape == (12,)
    assert tokens.dtype == np.int64 and mask.dtype == bool
    assert list(tokens[9:13]) == list(tokens[5:9])
    assert np.flatnonzero(mask).tolist() == [8, 9, 10, 11]
    assert tokens.min() >= 0 and tokens.max() < 16


def test_copy_distractors_with_a_gap():
    # copy_len 3, distance 5, L = 12: block at 13 - 3 - 5 = 5..7, gap 8..9, repeat 10..12.
    data = open_task({"synthetic": "copy_distractors", "vocab": 16, "copy_len": 3, "distance": 5})
    assert data.task.num_distractors(12) == 5
    tokens, mask = one_window({"synthetic": "copy_distractors", "vocab": 16, "copy_len": 3, "distance": 5}, 12)
    assert list(tokens[10:13]) == list(tokens[5:8])
    assert np.flatnonzero(mask).tolist() == [9, 10, 11]


@pytest.mark.parametrize("length, distractors", [(64, 1), (128, 65), (256, 193), (512, 449), (1024, 961)])
def test_copy_distractors_distance_stays_32_and_distractors_grow(length, distractors):
    spec = {"synthetic": "copy_distractors", "vocab": 512, "copy_len": 32}
    data = open_task(spec)
    assert data.task.num_distractors(length) == distractors
    windows, masks = data.eval_set(length, max_tokens=4 * length)
    assert windows.shape == (4, length + 1) and masks.shape == (4, length)
    for tokens, mask in zip(windows, masks):
        targets = np.flatnonzero(mask)
        assert targets.tolist() == list(range(length - 32, length))  # the last 32 predictions
        # each target token (tokens[t + 1]) equals the token exactly 32 before it: the copy distance
        assert np.array_equal(tokens[targets + 1], tokens[targets + 1 - 32])
        assert distractors + 64 == length + 1


# ---------------------------------------------------------------- mqar


def test_mqar_hand_built_small():
    # L = 12, vocab 16: 3 pairs (12 // 4), 1 filler token, pairs at 1..6, queries at 7, 9, 11 answered at 8, 10, 12.
    tokens, mask = one_window({"synthetic": "mqar", "vocab": 16}, 12)
    filler, pairs, queries = tokens[:1], tokens[1:7], tokens[7:]
    assert filler[0] >= 8
    keys, values = pairs[0::2], pairs[1::2]
    assert len(set(keys.tolist())) == 3 and keys.max() < 8 and values.min() >= 8
    lookup = dict(zip(keys.tolist(), values.tolist()))
    assert sorted(queries[0::2].tolist()) == sorted(keys.tolist())  # each key queried once
    assert [lookup[q] for q in queries[0::2].tolist()] == queries[1::2].tolist()
    assert np.flatnonzero(mask).tolist() == [7, 9, 11]  # the query positions predict their values


@pytest.mark.parametrize("length, pairs", [(64, 16), (256, 64), (1024, 256), (2048, 256)])
def test_mqar_pairs_grow_with_length_up_to_half_the_vocab(length, pairs):
    data = open_task({"synthetic": "mqar", "vocab": 512})
    assert data.task.num_pairs(length) == pairs
    tokens, mask = one_window({"synthetic": "mqar", "vocab": 512}, length)
    assert int(mask.sum()) == pairs
    assert len(set(tokens[length + 1 - 4 * pairs:length + 1 - 2 * pairs:2].tolist())) == pairs


# ---------------------------------------------------------------- passkey_tokens


@pytest.mark.parametrize("depth, key_at", [(0, 0), (0.5, 4), (1, 7), (0.25, 2)])
def test_passkey_key_depth(depth, key_at):
    # L = 12, key_len 2: 13 tokens = 7 filler + [KEY_MARK k1 k2] + [QUERY_MARK k1 k2]; depth d puts
    # floor(7 d + 1/2) filler tokens before KEY_MARK.
    tokens, mask = one_window({"synthetic": "passkey_tokens", "vocab": 16, "key_len": 2, "depth": depth}, 12)
    assert np.flatnonzero(tokens == PasskeyTokens.KEY_MARK).tolist() == [key_at]
    assert np.flatnonzero(tokens == PasskeyTokens.QUERY_MARK).tolist() == [10]
    assert list(tokens[key_at + 1:key_at + 3]) == list(tokens[11:13])
    assert np.flatnonzero(mask).tolist() == [10, 11]
    assert tokens[tokens > 1].min() >= 2


def test_passkey_uniform_depth_covers_the_filler():
    data = open_task({"synthetic": "passkey_tokens", "vocab": 64, "key_len": 1})
    windows, _ = data.eval_set(16, max_tokens=None)  # 2048 targets of 1 token: 2048 rows
    assert windows.shape == (2048, 17)
    depths = [int(np.flatnonzero(w == PasskeyTokens.KEY_MARK)[0]) for w in windows]
    assert sorted(set(depths)) == list(range(0, 14))  # 17 - 4 = 13 filler tokens: 0..13 before the key


# ---------------------------------------------------------------- determinism and slicing


def test_determinism_from_the_seed():
    spec = {"synthetic": "copy_distractors", "vocab": 512, "copy_len": 32}
    a, b = open_task(spec), open_task(dict(reversed(list(spec.items()))))
    assert a.fingerprint == b.fingerprint
    kw = dict(seq_len=64, global_batch=8, seed=3)
    xa, ya, ma = a.train_batch(5, 0, 1, 0, 8, **kw)
    xb, yb, mb = b.train_batch(5, 0, 1, 0, 8, **kw)
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(ma, mb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])  # y is x shifted by one
    assert xa.dtype == torch.long and ma.dtype == torch.bool and xa.shape == ma.shape == (8, 64)
    assert not torch.equal(xa, a.train_batch(6, 0, 1, 0, 8, **kw)[0])  # another step
    assert not torch.equal(xa, a.train_batch(5, 0, 1, 0, 8, seq_len=64, global_batch=8, seed=4)[0])
    wa, _ = a.eval_set(64, max_tokens=None, seed=3)
    wb, _ = b.eval_set(64, max_tokens=None, seed=3)
    assert np.array_equal(wa, wb)
    assert not np.array_equal(wa, a.eval_set(64, max_tokens=None, seed=4)[0])
    train_rows = {tuple(r) for r in torch.cat([xa, ya[:, -1:]], 1).tolist()}
    assert not train_rows & {tuple(r) for r in wa.tolist()}  # evaluation never repeats training windows
    # a smaller budget gives a prefix of the same set
    small, _ = a.eval_set(64, max_tokens=640, seed=3)
    assert np.array_equal(small, wa[:10])


def test_fingerprint_is_pinned_and_changes_with_params():
    spec = {"synthetic": "copy_distractors", "vocab": 512, "copy_len": 32}
    # same data, spelt three ways: defaults filled in, distance defaulting to copy_len
    assert open_task(spec).fingerprint == open_task({"synthetic": "copy_distractors"}).fingerprint
    assert open_task(spec).fingerprint == open_task({**spec, "distance": 32}).fingerprint
    assert open_task(spec).fingerprint != open_task({**spec, "vocab": 256}).fingerprint
    assert open_task(spec).fingerprint.startswith("809ec1fd")
    assert open_data(spec).describe() == \
        "synthetic copy_distractors(vocab=512, eval_targets=2048, copy_len=32, distance=32)"


def test_rank_and_micro_rows_are_disjoint_and_match_one_worker():
    data = open_task({"synthetic": "mqar", "vocab": 64})
    kw = dict(seq_len=32, global_batch=8, seed=0)
    whole = data.train_batch(2, 0, 1, 0, 8, **kw)[0]
    pieces = {}
    for micro in range(2):
        for rank in range(2):
            x, _, _ = data.train_batch(2, rank, 2, micro, 2, **kw)
            lo = (micro * 2 + rank) * 2
            assert torch.equal(x, whole[lo:lo + 2])
            pieces[(micro, rank)] = x
    rows = [tuple(r) for x in pieces.values() for r in x.tolist()]
    assert len(set(rows)) == 8
    with pytest.raises(UserError, match="global_batch is 8"):
        data.train_batch(2, 1, 2, 2, 2, **kw)


@pytest.mark.parametrize("spec, length, max_tokens, rows", [
    ({"synthetic": "copy_distractors"}, 64, None, 64),              # 2048 targets / 32 per row
    ({"synthetic": "copy_distractors"}, 1024, None, 64),            # the same targets at 16x
    ({"synthetic": "copy_distractors"}, 1024, 10 * 1024, 10),       # capped by the token budget
    ({"synthetic": "copy_distractors"}, 1024, 100, 1),              # at least one row
    ({"synthetic": "mqar"}, 64, None, 128),                         # 16 targets per row
    ({"synthetic": "mqar"}, 1024, None, 8),                         # 256 targets per row
    ({"synthetic": "passkey_tokens", "eval_targets": 100}, 64, None, 25),
])
def test_eval_size_is_a_target_budget(spec, length, max_tokens, rows):
    windows, mask = open_task(spec).eval_set(length, max_tokens)
    assert windows.shape == (rows, length + 1) and mask.shape == (rows, length)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("spec, message", [
    ({"synthetic": "copy"},
     "data.synthetic='copy' is not a known task: use one of copy_distractors, mqar, passkey_tokens"),
    ({"synthetic": "mqar", "pairs": 3}, "data.pairs=3: is not a known field"),
    ({"synthetic": "copy_distractors", "copy_len": 0}, "data.copy_len=0"),
    ({"synthetic": "copy_distractors", "copy_len": "32"}, "data.copy_len='32'"),
    ({"synthetic": "copy_distractors", "copy_len": 8, "distance": 4}, "distance=4 must be >= copy_len=8"),
    ({"synthetic": "mqar", "max_pairs": 300}, "use max_pairs <= 256"),
    ({"synthetic": "passkey_tokens", "depth": 1.5}, "data.depth=1.5"),
    ({"synthetic": "passkey_tokens", "depth": "middle"}, "or 'uniform'"),
    ({"synthetic": "mqar", "vocab": 2}, "data.vocab=2"),
])
def test_bad_specs_raise_one_line_user_errors(spec, message):
    with pytest.raises(UserError) as info:
        open_task(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_too_short_and_bad_seed():
    data = open_task({"synthetic": "copy_distractors", "copy_len": 32})
    with pytest.raises(UserError, match="seq_len=32 is too short .* use seq_len >= 63"):
        data.eval_set(32, None)
    data.eval_set(63, 63)  # exactly fits: no distractor at all
    with pytest.raises(UserError, match="data_seed=-1"):
        data.eval_set(64, None, seed=-1)
    assert set(SYNTHETIC_TASKS) == {"copy_distractors", "mqar", "passkey_tokens"}


# ---------------------------------------------------------------- masked loss and accuracy


class NextTokenGuesser(torch.nn.Module):
    """Puts probability 1/2 on (input + 1) mod V and spreads 1/2 evenly over the other V - 1 tokens."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def token_stats(self, idx, targets, **kwargs):
        guess = (idx + 1) % self.vocab
        probs = torch.full((*idx.shape, self.vocab), 0.5 / (self.vocab - 1))
        probs.scatter_(-1, guess.unsqueeze(-1), 0.5)
        logits = probs.log()
        loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        return loss, logits.argmax(-1) == targets


def test_masked_mean_window_loss_by_hand():
    # V = 4. Window [0, 1, 2, 0, 3]: inputs 0 1 2 0, targets 1 2 0 3, guesses 1 2 3 1 -> right, right, wrong, wrong.
    # A right guess costs ln 2, a wrong one ln(2 * 3) = ln 6.
    windows = np.array([[0, 1, 2, 0, 3], [3, 0, 0, 1, 2]])  # second: targets 0 0 1 2, guesses 0 1 1 2 -> R W R R
    mask = np.array([[False, True, True, False], [True, True, False, False]])
    total, count, correct = mean_window_loss(NextTokenGuesser(4), windows, target_mask=mask, batch_size=1)
    assert count == 4 and correct == 2  # row 1: R W; row 2: R W
    assert total == pytest.approx(2 * math.log(2) + 2 * math.log(6))
    total_all, count_all, correct_all = mean_window_loss(NextTokenGuesser(4), windows)
    assert (count_all, correct_all) == (8, 5)
    assert total_all == pytest.approx(5 * math.log(2) + 3 * math.log(6))


def test_gpt_forward_loss_mask_by_hand():
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=16))
    data = open_task({"synthetic": "copy_distractors", "vocab": 16, "copy_len": 4})
    x, y, mask = data.train_batch(0, 0, 1, 0, 3, seq_len=12, global_batch=3, seed=0)
    with torch.no_grad():
        logits, loss = model(x, y, loss_mask=mask)
    logp = torch.log_softmax(logits.double(), -1)
    picked = [-float(logp[b, t, y[b, t]]) for b in range(3) for t in range(12) if mask[b, t]]
    assert len(picked) == 12  # 3 rows x 4 targets
    assert float(loss) == pytest.approx(sum(picked) / 12, rel=1e-5)
    # an unscored target can be anything: the loss does not move
    y2 = y.clone()
    y2[~mask] = (y2[~mask] + 1) % 16
    with torch.no_grad():
        loss2 = model(x, y2, loss_mask=mask)[1]
    assert float(loss2) == pytest.approx(float(loss), rel=1e-6)
    # and mean_window_loss agrees with the same masked positions
    windows = torch.cat([x, y[:, -1:]], 1).numpy()
    total, count, correct = mean_window_loss(model, windows, target_mask=mask.numpy(), precision="fp32")
    assert count == 12 and total / count == pytest.approx(float(loss), rel=1e-5)
    argmax_right = sum(int(logits[b, t].argmax() == y[b, t]) for b in range(3) for t in range(12) if mask[b, t])
    # mean_window_loss runs its own batches and LM-head chunks: logits equal to float32 rounding, not bit for bit,
    # so an argmax may differ only at a masked position whose top two logits (nearly) tie
    top2 = logits.topk(2, dim=-1).values
    near_ties = int(((top2[..., 0] - top2[..., 1] <= 1e-4) & mask).sum())
    assert near_ties <= 1 and abs(correct - argmax_right) <= near_ties, (correct, argmax_right, near_ties)


# ---------------------------------------------------------------- a short real training run


def test_tiny_training_on_copy_distractors_reports_target_accuracy(tmp_path):
    from attnlab.model.checkpoint import load_model
    from attnlab.train.config import TrainConfig
    from attnlab.train.loop import LocalSession, train_worker

    spec = {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 32, "eval_targets": 256}
    cfg = TrainConfig(preset="tiny", data=spec, seq_len=64, steps=20, tokens_per_step=64 * 8, micro_batch=8,
                      lr=3e-3, warmup_steps=5, log_every=10, val_every=10, checkpoint_every=20, val_batch=8,
                      precision="fp32", threads_per_worker=1, data_seed=7)
    train_worker(cfg, LocalSession(tmp_path, device="cpu"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if "val_acc" in r]
    assert [r["step"] for r in measured] == [10, 20]
    for r in measured:
        assert r["val_tokens"] == 256  # 8 sequences x 32 targets, not 8 x 64 positions
        assert 0.0 <= r["val_acc"] <= 1.0 and (r["val_acc"] * 256) == pytest.approx(round(r["val_acc"] * 256))
        assert math.isfinite(r["val_loss"])
    provenance = json.loads((tmp_path / "provenance.json").read_text())
    assert provenance["data"]["vocab_size"] == 64 and provenance["data"]["fingerprint"] == open_task(spec).fingerprint
    model, _, meta = load_model(tmp_path)
    assert meta["step"] == 20 and model.cfg.vocab_size == 64  # the model's vocab follows the data
    windows, mask = open_task(spec).eval_set(64, cfg.val_tokens, seed=7)
    total, count, correct = mean_window_loss(model, windows, target_mask=mask, precision="fp32")
    assert count == 256
    assert total / count == pytest.approx(measured[-1]["val_loss"], rel=1e-5)
    assert correct / count == pytest.approx(measured[-1]["val_acc"])


# ---------------------------------------------------------------- the probe through a real study


@pytest.mark.ray
def test_probe_study_writes_acc_for_every_trial_length_p_eval_and_rope(ray_session, tmp_path):
    from attnlab.results import ResultsStore
    from attnlab.study.runner import run_study
    from attnlab.study.spec import load_spec

    study = {
        "name": "probe-tiny",
        "train": {"preset": "tiny",
                  "data": {"synthetic": "copy_distractors", "vocab": 64, "copy_len": 16, "eval_targets": 64},
                  "seq_len": 64, "steps": 6, "tokens_per_step": 256, "micro_batch": 4, "lr": 3.0e-3,
                  "warmup_steps": 2, "log_every": 3, "val_every": 3, "val_tokens": 256, "checkpoint_every": 6,
                  "keep_checkpoints": 1, "max_failures": 0, "precision": "fp32", "threads_per_worker": 1,
                  "cpus_per_worker": 0.5},
        "resources": {"trial_cpus": 0.5}, "search": {"engine": "grid"},
        "space": {"attention": ["softmax", "lssar"]},
        "objective": {"metric": "acc@2x,rope=none", "mode": "max"},
        "eval": {"multiples": [1, 2], "p_eval": ["none", 15], "rope_scaling": ["none", "ntk"]},
    }
    summary = run_study(load_spec(study), store=str(tmp_path / "results"), runs=str(tmp_path / "runs"), verbose=0)
    assert [t["status"] for t in summary.trials] == ["complete", "complete"]
    acc = ResultsStore(str(tmp_path / "results")).read(study="probe-tiny", metric="acc")
    cells = sorted((r.attention, int(r.eval_len), "none" if r.p_eval != r.p_eval else f"{r.p_eval:g}", r.rope_scaling)
                   for r in acc.itertuples())
    assert cells == sorted((a, L, p, rope) for a in ("softmax", "lssar") for L in (64, 128)
                           for p in ("none", "15") for rope in ("none", "ntk"))
    assert set(acc.n_tokens) == {64}  # 4 sequences x 16 targets at both lengths: the same target budget
    assert ((acc.value >= 0) & (acc.value <= 1)).all()
    assert set(acc.data) == {"synthetic:copy_distractors"}
