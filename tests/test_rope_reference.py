"""YaRN and dynamic NTK as the field runs them: attnlab's ``yarn`` and ``dynamic`` against the installed transformers'
``_compute_yarn_parameters`` and ``_compute_dynamic_ntk_parameters`` (transformers' YaRN is the reference code's,
jquesnelle/yarn ``LlamaYaRNScaledRotaryEmbedding.yarn``: the same correction range, ramp and ``get_mscale``), at
evaluation and in training, over a grid of head dims, original lengths and factors.

transformers computes in float32 and attnlab in float64: the frequencies agree to float32's rounding (2e-6 relative,
about 16 ulps of float32; the largest difference measured over the grid is 3.4e-7), the attention factor exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab.model.rope import TrainedScaling, inverse_frequencies, rope_frequencies

transformers = pytest.importorskip("transformers")  # the hf extra (make setup-test installs it)
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters, _compute_yarn_parameters  # noqa: E402

FLOAT32_RTOL = 2e-6
HEAD_DIMS, ORIGINAL_LENS, FACTORS = (32, 64, 128), (128, 1024, 4096), (2, 4, 16, 32)


def _llama(head_dim: int, max_positions: int, **rope) -> LlamaConfig:
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_positions,
                       rope_parameters={"rope_theta": 10000.0, **rope})


def _yarn(head_dim: int, original_len: int, factor: float):
    """transformers' YaRN, beta_fast = 32 and beta_slow = 1 as attnlab sets them (YaRN's Llama values)."""
    cfg = _llama(head_dim, int(original_len * factor), rope_type="yarn", factor=float(factor),
                 original_max_position_embeddings=original_len, beta_fast=32.0, beta_slow=1.0)
    return _compute_yarn_parameters(cfg)


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs.double()).abs() / theirs.double()).max().item()


@pytest.mark.parametrize("head_dim, original_len, factor", list(itertools.product(HEAD_DIMS, ORIGINAL_LENS, FACTORS)))
def test_yarn_at_evaluation_is_transformers_yarn(head_dim, original_len, factor):
    inv_freq, attention_factor = _yarn(head_dim, original_len, factor)
    ours, multiplier = rope_frequencies("yarn", head_dim, original_len * factor, original_len)
    assert _close(ours, inv_freq) < FLOAT32_RTOL
    assert multiplier ** 0.5 == pytest.approx(attention_factor, rel=1e-15)  # 0.1 ln s + 1, on cos and sin


@pytest.mark.parametrize("head_dim, original_len, factor", [(64, 128, 4), (64, 128, 16), (128, 1024, 32)])
def test_yarn_in_training_is_transformers_yarn_at_every_length(head_dim, original_len, factor):
    """A fine-tune at 4x with factor s (YaRN's recipe sets the factor for the target): the frequencies of
    transformers' YaRN with that factor at every length, as trained, and the attention factor of s."""
    inv_freq, attention_factor = _yarn(head_dim, original_len, factor)
    trained = TrainedScaling("yarn", original_len, float(factor))
    for seq_len in (original_len, 4 * original_len, 16 * original_len):
        ours, multiplier = rope_frequencies("none", head_dim, seq_len, 4 * original_len, trained=trained)
        assert _close(ours, inv_freq) < FLOAT32_RTOL
        assert multiplier ** 0.5 == pytest.approx(attention_factor, rel=1e-15)


@pytest.mark.parametrize("head_dim, original_len, factor",
                         list(itertools.product(HEAD_DIMS, ORIGINAL_LENS, (1, 2, 4, 8))))
def test_dynamic_at_evaluation_is_transformers_dynamic(head_dim, original_len, factor):
    for seq_len in (original_len // 2, original_len, 2 * original_len, 16 * original_len):
        cfg = _llama(head_dim, original_len, rope_type="dynamic", factor=float(factor))
        inv_freq, attention_factor = _compute_dynamic_ntk_parameters(cfg, seq_len=seq_len)
        ours, multiplier = rope_frequencies(f"dynamic:{factor}", head_dim, seq_len, original_len)
        assert _close(ours, inv_freq) < FLOAT32_RTOL, seq_len
        assert multiplier == attention_factor == 1.0


def test_dynamic_in_training_follows_the_length_as_transformers_does():
    """LCEG's fine-tune (factor ceil(s / 2) = 2 at 4x): at every length, as trained, transformers' dynamic NTK of
    the original length; at the fine-tune's own length the base it trained with."""
    trained = TrainedScaling("dynamic", 128, 2.0)
    cfg = _llama(64, 128, rope_type="dynamic", factor=2.0)
    for seq_len in (64, 128, 512, 2048):
        inv_freq, _ = _compute_dynamic_ntk_parameters(cfg, seq_len=seq_len)
        ours, multiplier = rope_frequencies("none", 64, seq_len, 512, trained=trained)
        assert _close(ours, inv_freq) < FLOAT32_RTOL and multiplier == 1.0


def test_dynamic_with_factor_1_is_ntk():
    for seq_len in (256, 2048):
        assert torch.equal(rope_frequencies("dynamic:1", 64, seq_len, 128)[0], rope_frequencies("ntk", 64, seq_len, 128)[0])


@pytest.mark.parametrize("head_dim, original_len, new_len, largest, pair0", [
    (64, 128, 512, 0.48, 0.72),     # extend_proxy: 128 -> 512 bytes
    (64, 1024, 4096, 0.41, 1.00),   # extend_gpu: 1,024 -> 4,096 tokens
    (64, 1024, 16384, 0.66, 1.00),
])
def test_yarn_paper_is_the_papers_ramp_far_from_the_reference(head_dim, original_len, new_len, largest, pair0):
    """The measured difference docs/protocol.md#yarn reports: the largest relative difference in inverse frequency,
    and the share of its frequency pair 0 keeps under the paper's ramp (the reference keeps 1.0 in every row)."""
    ref, ref_multiplier = rope_frequencies("yarn", head_dim, new_len, original_len)
    paper, paper_multiplier = rope_frequencies("yarn_paper", head_dim, new_len, original_len)
    plain = inverse_frequencies(10000.0, head_dim)
    assert ((ref - paper).abs() / ref).max().item() == pytest.approx(largest, abs=0.005)
    assert (paper[0] / plain[0]).item() == pytest.approx(pair0, abs=0.005)
    assert ref[0].item() == plain[0].item()
    assert ref_multiplier == paper_multiplier  # the temperature is the same
