"""Passkey retrieval: the prompt builder's lengths and depths in GPT-2 tokens, and the likelihood scorer on a
model that copies (induction) versus one that knows nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnlab.errors import UserError
from attnlab.evaluate.passkey import (
    FILLER,
    QUESTION,
    TASK,
    answer_tokens,
    build_prompt,
    draw_keys,
    info_sentence,
    min_prompt_length,
    passkey_accuracy,
    true_key_rank,
)

VOCAB = 50257


@pytest.fixture(scope="module")
def enc():
    from attnlab.data import get_encoding

    return get_encoding()


@pytest.mark.parametrize("length", [100, 300, 1025])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_has_the_requested_length_and_depth(enc, length, depth):
    prompt = build_prompt(length, depth, 31415, reserve=3)
    assert len(prompt.tokens) == length - 3
    text = enc.decode(prompt.tokens.tolist())
    assert text.startswith(TASK + "\n") and text.endswith("\n" + QUESTION)
    assert enc.decode(prompt.tokens[prompt.key_start:prompt.key_end].tolist()) == "\n" + info_sentence(31415) + "\n"
    filler = prompt.filler_before + prompt.filler_after
    assert prompt.filler_before == round(depth * filler)
    # the filler before the key is the start of the repeated paragraph, cut in tokens
    before = enc.decode(prompt.tokens[prompt.key_start - prompt.filler_before:prompt.key_start].tolist())
    assert (" ".join([FILLER] * 64)).startswith(before)
    # the key sits at the requested fraction of the filler
    head = prompt.key_start - prompt.filler_before
    assert (prompt.key_start - head) / max(filler, 1) == pytest.approx(depth, abs=1.0 / max(filler, 1))


def test_prompt_too_short_and_bad_depth_are_user_errors():
    assert min_prompt_length() > 50
    with pytest.raises(UserError, match="too short"):
        build_prompt(min_prompt_length() - 5, 0.5, 12345, reserve=3)
    with pytest.raises(UserError, match="depth"):
        build_prompt(500, 1.5, 12345)


def test_keys_are_seeded_and_distinct():
    keys = draw_keys(0, 1, 2)
    assert keys == draw_keys(0, 1, 2) and keys != draw_keys(1, 1, 2)
    assert len(set(keys)) == 10 and all(10_000 <= k <= 50_000 for k in keys)


def test_rank_counts_ties_against_the_true_key():
    assert true_key_rank(np.array([-1.0, -2.0, -3.0])) == 0
    assert true_key_rank(np.array([-1.0, -1.0, -3.0])) == 1
    assert true_key_rank(np.array([-5.0, -1.0, -2.0])) == 2


class InductionCopyModel(torch.nn.Module):
    """A hand-written "copy" model: at each position it finds the most recent earlier occurrence of the longest
    suffix (up to ``max_k`` tokens) ending there and puts 0.9 of its mass on the token that followed it
    (induction heads, generalised to n-grams: "... The pass key is" must match the key sentence, not the
    question's "What is"). Elsewhere the distribution is uniform."""

    def __init__(self, max_k: int = 6, vocab: int = VOCAB):
        super().__init__()
        self.max_k, self.vocab = max_k, vocab

    def predictions(self, seq: list[int]) -> np.ndarray:
        pred = np.full(len(seq), -1)
        for k in range(1, self.max_k + 1):
            last: dict[tuple, int] = {}
            for t in range(k - 1, len(seq)):
                gram = tuple(seq[t - k + 1:t + 1])
                if gram in last:
                    pred[t] = seq[last[gram] + 1]  # the longest match wins (k grows)
                last[gram] = t
        return pred

    def forward(self, tokens) -> torch.Tensor:
        tokens = np.asarray(tokens)
        out = np.empty((tokens.shape[0], tokens.shape[1] - 1))
        hit, miss, none = math.log(0.9), math.log(0.1 / (self.vocab - 1)), -math.log(self.vocab)
        for b, seq in enumerate(tokens.tolist()):
            pred = self.predictions(seq)[:-1]
            target = np.asarray(seq[1:])
            out[b] = np.where(pred < 0, none, np.where(pred == target, hit, miss))
        return torch.as_tensor(out)


def test_copy_model_ranks_the_planted_key_first():
    model = InductionCopyModel()
    records = passkey_accuracy(model, [120, 400], depths=(0.0, 0.5, 1.0), trials=3, seed=7)
    acc = {(r["length"], r["depth"], r["metric"]): r["value"] for r in records}
    for length in (120, 400):
        for depth in (0.0, 0.5, 1.0):
            assert acc[(length, depth, "passkey_acc")] == 1.0
        assert acc[(length, None, "passkey_acc")] == 1.0 and acc[(length, None, "passkey_rank")] == 0.0
    assert all(r["n_prompts"] == (3 if r["depth"] is not None else 9) for r in records)


def test_a_model_that_cannot_copy_fails():
    def uniform(tokens):
        return torch.full((len(tokens), len(tokens[0]) - 1), -math.log(VOCAB))

    records = passkey_accuracy(uniform, [200], depths=(0.5,), trials=6, seed=0)
    overall = [r for r in records if r["depth"] is None and r["metric"] == "passkey_acc"][0]
    # with no information a key only wins by having strictly fewer tokens than every distractor; ties lose
    wins = []
    for trial in range(6):
        true, *others = draw_keys(0, 0, trial)
        wins.append(len(answer_tokens(true)) < min(len(answer_tokens(k)) for k in others))
    assert overall["value"] == pytest.approx(np.mean(wins)) and overall["value"] < 0.5


def test_candidates_share_one_length_and_padding_does_not_leak():
    from attnlab.evaluate.passkey import candidate_batch

    prompt = build_prompt(101, 0.5, 12345, reserve=3)
    rows, spans = candidate_batch(prompt, [12345, 23456, 50000], total=101)
    assert rows.shape == (3, 101)
    for row, (a, b), key in zip(rows, spans, [12345, 23456, 50000]):
        assert tuple(row[a + 1:b + 1]) == answer_tokens(key)  # output position t predicts token t + 1
        np.testing.assert_array_equal(row[:len(prompt.tokens)], prompt.tokens)
