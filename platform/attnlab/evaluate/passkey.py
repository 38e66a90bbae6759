"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention"), in GPT-2 tokens, scored by likelihood.

Prompt (the reference generator's format, docs/protocol.md#passkey-retrieval)::

    <TASK>\\n<filler ...>\\nThe pass key is 12345. Remember it. 12345 is the pass key.\\n<filler ...>
    \\nWhat is the pass key? The pass key is    (one line)

The filler (the "grass is green" paragraph repeated) is cut in **tokens**, so a prompt has exactly the
requested number of tokens, and the key sentence sits after ``round(depth * filler)`` filler tokens
(depth 0 = right after the instruction, 1 = right before the question).

Scoring: tiny models cannot be judged on greedy generation, so each prompt is followed in turn by the true
key and by ``n_distractors`` other keys (``" 12345"`` in GPT-2 tokens); the prompt is a success when the
true key's summed log-likelihood is strictly the highest (ties count against it). Every candidate sequence
is padded with EOT to the same ``length + 1`` tokens (the model sees exactly ``length`` input tokens; the
padding comes after the answer, so causal scores are unaffected). Keys are five-digit numbers drawn with
``numpy.random.default_rng([seed, depth_index, trial])``: the same keys at every length and for every model.

The scorer takes any ``logprob(tokens (B, L + 1)) -> (B, L)`` callable (``model_logprob`` wraps a GPT).
No Ray here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnlab.errors import UserError

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"
KEY_LOW, KEY_HIGH = 10_000, 50_000  # five-digit keys, inclusive
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_DISTRACTORS = 9

LogProb = Callable[[np.ndarray], "np.ndarray | torch.Tensor"]


def info_sentence(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def _encode(text: str) -> list[int]:
    from attnlab.data.tokenizer import get_encoding

    return get_encoding().encode_ordinary(text)


@functools.lru_cache(maxsize=None)
def answer_tokens(key: int) -> tuple[int, ...]:
    """The answer after "... The pass key is": ``" " + str(key)`` in GPT-2 tokens."""
    return tuple(_encode(f" {int(key)}"))


@functools.lru_cache(maxsize=8)
def _filler_tokens(repeats: int) -> np.ndarray:
    return np.asarray(_encode(" ".join([FILLER] * repeats)), dtype=np.int64)


def filler_tokens(n: int) -> np.ndarray:
    """The first ``n`` tokens of the repeated filler paragraph (24 tokens per repetition)."""
    repeats = 64
    while True:
        tokens = _filler_tokens(repeats)
        if len(tokens) >= n:
            return tokens[:n]
        repeats *= 2


@functools.lru_cache(maxsize=1)
def _fixed_parts() -> tuple[np.ndarray, np.ndarray]:
    head = np.asarray(_encode(TASK + "\n"), dtype=np.int64)
    tail = np.asarray(_encode("\n" + QUESTION), dtype=np.int64)
    return head, tail


def _key_part(key: int) -> np.ndarray:
    return np.asarray(_encode("\n" + info_sentence(key) + "\n"), dtype=np.int64)


@functools.lru_cache(maxsize=1)
def _longest_key_tokens() -> tuple[int, int]:
    """(the most tokens an answer can take, the most tokens a key sentence can take) over all keys.

    GPT-2 pre-tokenises `` 12345`` on its own (`` ?\\p{N}+``), so a key sentence is its key-free tokens plus
    twice the answer's tokens.
    """
    from attnlab.data.tokenizer import get_encoding

    enc = get_encoding()
    answer = max(len(t) for t in enc.encode_ordinary_batch([f" {k}" for k in range(KEY_LOW, KEY_HIGH + 1)]))
    fixed = len(_key_part(KEY_LOW)) - 2 * len(answer_tokens(KEY_LOW))
    return answer, fixed + 2 * answer


def min_prompt_length() -> int:
    """The shortest eval length that fits a passkey prompt (no filler) plus any answer."""
    head, tail = _fixed_parts()
    answer, key_part = _longest_key_tokens()
    return len(head) + key_part + len(tail) + answer


@dataclass(frozen=True)
class PasskeyPrompt:
    """A prompt in GPT-2 tokens: ``tokens[key_start:key_end]`` is the key sentence (with its newlines)."""

    tokens: np.ndarray
    key: int
    depth: float
    key_start: int
    key_end: int
    filler_before: int
    filler_after: int


def build_prompt(length: int, depth: float, key: int, *, reserve: int = 0) -> PasskeyPrompt:
    """A prompt of exactly ``length - reserve`` tokens (``reserve``: room left for the answer) with the key
    sentence after ``round(depth * filler)`` of its filler tokens. UserError if it cannot fit."""
    if not 0.0 <= float(depth) <= 1.0:
        raise UserError(f"passkey depth {depth!r} is not allowed: use a number in [0, 1]")
    if not KEY_LOW <= int(key) <= KEY_HIGH:
        raise UserError(f"passkey key {key!r} is not allowed: use a number in [{KEY_LOW}, {KEY_HIGH}]")
    head, tail = _fixed_parts()
    middle = _key_part(int(key))
    filler = int(length) - int(reserve) - len(head) - len(middle) - len(tail)
    if filler < 0:
        raise UserError(f"passkey length {length} is too short: the prompt needs at least "
                        f"{int(length) - filler} tokens with {reserve} reserved for the answer")
    before = int(round(float(depth) * filler))
    after = filler - before
    pad = filler_tokens(max(before, after))
    tokens = np.concatenate([head, pad[:before], middle, pad[:after], tail])
    key_start = len(head) + before
    return PasskeyPrompt(tokens=tokens, key=int(key), depth=float(depth), key_start=key_start,
                         key_end=key_start + len(middle), filler_before=before, filler_after=after)


def draw_keys(seed: int, depth_index: int, trial: int, n_distractors: int = DEFAULT_DISTRACTORS) -> list[int]:
    """``[true key, distractor, ...]``: distinct five-digit keys, a pure function of the arguments."""
    rng = np.random.default_rng([int(seed), int(depth_index), int(trial)])
    picks = rng.choice(KEY_HIGH - KEY_LOW + 1, size=n_distractors + 1, replace=False)
    return [int(KEY_LOW + k) for k in picks]


def candidate_batch(prompt: PasskeyPrompt, candidates: Sequence[int], total: int,
                    pad_id: int | None = None) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Sequences ``(len(candidates), total)``: the prompt, a candidate answer, EOT padding; and for each row
    the ``(start, stop)`` slice of *target* positions (indexes of ``logprob``'s output) holding its answer."""
    from attnlab.data.tokenizer import EOT_ID

    pad_id = EOT_ID if pad_id is None else pad_id
    n = len(prompt.tokens)
    rows = np.full((len(candidates), total), pad_id, dtype=np.int64)
    spans = []
    for i, key in enumerate(candidates):
        answer = answer_tokens(int(key))
        if n + len(answer) > total:
            raise UserError(f"passkey: prompt ({n}) + answer ({len(answer)}) exceed {total} tokens")
        rows[i, :n] = prompt.tokens
        rows[i, n:n + len(answer)] = answer
        spans.append((n - 1, n - 1 + len(answer)))  # token t is predicted at output position t - 1
    return rows, spans


def score_candidates(logprob: LogProb, prompt: PasskeyPrompt, candidates: Sequence[int],
                     total: int) -> np.ndarray:
    """Summed log-likelihood of each candidate answer after ``prompt`` (sequences of ``total`` tokens)."""
    rows, spans = candidate_batch(prompt, candidates, total)
    lp = logprob(rows)
    lp = lp.detach().float().cpu().numpy() if isinstance(lp, torch.Tensor) else np.asarray(lp, dtype=np.float64)
    if lp.shape != (rows.shape[0], rows.shape[1] - 1):
        raise ValueError(f"logprob must return (B, T - 1) = {(rows.shape[0], rows.shape[1] - 1)}, got {lp.shape}")
    return np.array([lp[i, a:b].sum(dtype=np.float64) for i, (a, b) in enumerate(spans)])


def true_key_rank(scores: np.ndarray) -> int:
    """How many distractors (``scores[1:]``) score at least as high as the true key (``scores[0]``)."""
    return int(np.sum(scores[1:] >= scores[0]))


def passkey_accuracy(logprob: LogProb, lengths: Iterable[int], *, depths: Sequence[float] = DEFAULT_DEPTHS,
                     trials: int = 4, n_distractors: int = DEFAULT_DISTRACTORS, seed: int = 0) -> list[dict]:
    """Passkey accuracy by length and depth.

    ``lengths`` are model input lengths (each candidate sequence has ``length + 1`` tokens). Returns records
    ``{"length", "depth" (None = all depths), "metric" ("passkey_acc" | "passkey_rank"), "value",
    "n_prompts"}``: accuracy per depth, then accuracy and mean rank over all depths, per length.
    """
    if int(trials) < 1:
        raise UserError(f"passkey trials={trials!r} is not allowed: use a positive integer")
    if int(n_distractors) < 1:
        raise UserError(f"passkey distractors={n_distractors!r} is not allowed: use a positive integer")
    longest_answer = _longest_key_tokens()[0]
    records = []
    for length in lengths:
        total = int(length) + 1
        all_ranks = []
        for d_index, depth in enumerate(depths):
            ranks = []
            for trial in range(int(trials)):
                keys = draw_keys(seed, d_index, trial, n_distractors)
                prompt = build_prompt(total, depth, keys[0], reserve=longest_answer)
                ranks.append(true_key_rank(score_candidates(logprob, prompt, keys, total)))
            records.append(dict(length=int(length), depth=float(depth), metric="passkey_acc",
                                value=float(np.mean(np.array(ranks) == 0)), n_prompts=len(ranks)))
            all_ranks += ranks
        ranks = np.array(all_ranks)
        records.append(dict(length=int(length), depth=None, metric="passkey_acc", value=float(np.mean(ranks == 0)),
                            n_prompts=len(ranks)))
        records.append(dict(length=int(length), depth=None, metric="passkey_rank", value=float(np.mean(ranks)),
                            n_prompts=len(ranks)))
    return records


def model_logprob(model, *, rope_scaling: str = "none", attention=None, device=None, precision: str = "auto",
                  batch_size: int = 8) -> LogProb:
    """``logprob(tokens (B, T + 1)) -> (B, T)`` log-probabilities of ``tokens[:, 1:]`` under a GPT (no grad)."""
    from attnlab.model.scoring import window_token_stats

    def logprob(tokens: np.ndarray) -> torch.Tensor:
        parts = [loss for _, loss, _, _ in window_token_stats(model, np.asarray(tokens), batch_size=batch_size,
                                                           device=device, precision=precision,
                                                           rope_scaling=rope_scaling, attention=attention)]
        return -torch.cat(parts, dim=0)

    return logprob
