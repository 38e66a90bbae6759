"""attnlab's model class for lm-evaluation-harness: an attnlab GPT (GPT-2 tokens) answering the harness's
``loglikelihood`` and ``loglikelihood_rolling`` requests with the platform's scoring code
(:func:`attnlab.model.scoring.window_token_stats`, the function validation and ``attnlab eval`` use).

- ``max_length``: the context the model sees (default its training length); a longer request keeps its last
  ``max_length`` tokens (loglikelihood) or is scored in rolling windows of ``max_length`` tokens (rolling);
- ``rope_scaling`` (``ntk`` / ``none``) and ``attention`` (a p_eval spec) go to every forward, so a task can be
  scored beyond the training length exactly as ``attnlab eval`` scores windows there;
- requests are sorted by length and scored ``batch_size`` at a time, right-padded with the end-of-text token (the
  models are causal: padding after a request never changes its scores; only a variant whose scores depend on the
  window length itself, ``sigmoid_ramapuram``'s ``-ln T``, sees the padded length) to one of a few widths
  (:func:`padded_width`: powers of two), and the last batch is filled up with end-of-text rows, so a compiled
  model builds one graph per width, not one per distinct request length.

Generation tasks (``generate_until``) are refused with a one-line error. Imports lm_eval (the ``downstream``
extra); no Ray here.
"""

from __future__ import annotations

import numpy as np
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from attnlab.errors import UserError
from attnlab.model.scoring import window_token_stats

# The narrowest padded width (tokens a model reads); wider batches take the next power of two.
MIN_WIDTH = 16


def padded_width(longest: int, max_length: int) -> int:
    """The tokens a batch is padded to when its longest sequence (inputs and the last target) has ``longest``:
    the model reads ``longest - 1`` of them, rounded up to a power of two (at least :data:`MIN_WIDTH`, at most
    ``max_length``), plus the last target. At 16K tokens that is at most 11 widths: one compiled graph each."""
    reads = max(1, longest - 1)
    return min(max_length, max(MIN_WIDTH, 1 << (reads - 1).bit_length())) + 1


class AttnlabLM(LM):
    """An attnlab model for ``lm_eval.simple_evaluate(model=AttnlabLM(...))``."""

    def __init__(self, model, *, max_length: int | None = None, rope_scaling: str = "none", attention=None,
                 device=None, precision: str = "auto", batch_size: int = 8):
        super().__init__()
        from attnlab.data.tokenizer import EOT_ID, get_encoding
        from attnlab.names import GPT2_VOCAB

        if model.cfg.vocab_size != GPT2_VOCAB:
            raise UserError("eval.downstream: needs a model trained on GPT-2 tokenised text (the tasks are "
                            f"English); this model has a vocabulary of {model.cfg.vocab_size}")
        self.model = model
        self.max_length = int(max_length or model.cfg.train_len)
        self.forward_kwargs = dict(rope_scaling=rope_scaling, attention=attention)
        self.torch_device = device
        self.precision = precision
        self.batch_size = max(1, int(batch_size))
        self.enc = get_encoding()
        self.eot = EOT_ID

    # ------------------------------------------------------------------------------------------ tokens
    def tok_encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation tokens, the context's trailing spaces moved to the continuation (as the
        harness's own models do), the continuation's tokens cut from the encoding of the whole string."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation, context = context[-spaces:] + continuation, context[:-spaces]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx):]

    # ------------------------------------------------------------------------------------------ scoring
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), continuation is the greedy one)`` for ``(context, continuation)``
        token lists; the context is cut from the left to fit ``max_length`` (at least one token is kept)."""
        sequences = []
        for ctx, cont in pairs:
            if not cont:
                raise UserError("eval.downstream: a request has an empty continuation (check the task's "
                                "doc_to_target / doc_to_choice)")
            tokens = (list(ctx) or [self.eot]) + list(cont)
            tokens = tokens[-(self.max_length + 1):]
            sequences.append((tokens, min(len(cont), len(tokens) - 1)))
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(sequences)
        for b0 in range(0, len(order), self.batch_size):
            batch = order[b0:b0 + self.batch_size]
            width = padded_width(max(len(sequences[i][0]) for i in batch), self.max_length)
            # batch_size rows whatever the batch holds: the last batch's shape is that of the others
            windows = np.full((self.batch_size, width), self.eot, dtype=np.int64)
            for row, i in enumerate(batch):
                windows[row, :len(sequences[i][0])] = sequences[i][0]
            for _, loss, correct, _ in window_token_stats(self.model, windows, batch_size=self.batch_size,
                                                          device=self.torch_device, precision=self.precision,
                                                          **self.forward_kwargs):
                for row, i in enumerate(batch):
                    tokens, n_cont = sequences[i]
                    end = len(tokens) - 1  # targets are tokens[1:]: position end - 1 predicts the last token
                    span = slice(end - n_cont, end)
                    out[i] = (-float(loss[row, span].double().sum()), bool(correct[row, span].all()))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        results = self._score([self._encode_pair(*req.args) for req in requests])
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each string's total log-likelihood after the end-of-text token, in disjoint windows of up to
        ``max_length`` tokens (every token predicted exactly once, each with as much context as fits)."""
        pieces, owner = [], []
        for n, req in enumerate(requests):
            (text,) = req.args
            for window in get_rolling_token_windows(self.tok_encode(text), prefix_token=self.eot,
                                                    max_seq_len=self.max_length, context_len=1):
                pieces.append(make_disjoint_window(window))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._score(pieces)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests) -> list[str]:
        raise UserError("eval.downstream: generation tasks (output_type generate_until) are not supported; "
                        "use loglikelihood, multiple_choice or loglikelihood_rolling tasks")


__all__ = ["AttnlabLM", "padded_width"]
