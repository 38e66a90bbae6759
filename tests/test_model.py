"""The GPT model: preset sizes, RoPE/NTK behaviour, long forward passes, initial loss."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.attention import get_variant
from attnlab.errors import UserError
from attnlab.model import GPT, ntk_base, preset
from attnlab.model.rope import apply_rope, rope_tables
from attnlab.names import ROPE_SCALINGS


@pytest.mark.parametrize("name, expected", [
    ("gpt2-small", 124_439_808 - 1024 * 768),     # llm.c GPT-2 124M less its 0.8M position table
    ("gpt2-medium", 354_823_168 - 1024 * 1024),   # GPT-2 medium 355M less its position table
    ("gpt2-45m", 44_646_912),
    ("llama-45m", 45_005_824),                    # the same size with the Llama block (docs/protocol.md#presets)
    ("tiny-llama", 6_859_520),
])
def test_preset_parameter_counts(name, expected):
    with torch.device("meta"):
        model = GPT(preset(name))
    assert model.num_params() == expected
    assert model.cfg.head_dim == 64


def test_presets_keep_head_dim_64_and_tie_embeddings():
    model = GPT(preset("tiny"))
    assert model.cfg.head_dim == 64
    assert model.lm_head.weight is model.wte.weight


def test_ntk_base_formula():
    assert ntk_base(10000.0, 64, 1024, 1024) == 10000.0
    assert ntk_base(10000.0, 64, 2048, 1024) == pytest.approx(10000 * 2 ** (64 / 62))
    assert ntk_base(10000.0, 64, 16384, 1024) == pytest.approx(175_000, rel=0.01)  # docs/protocol.md#ntk-aware-scaling: 174,970


def test_rope_keeps_norms_and_is_relative():
    cos, sin = rope_tables(16, 64, 10000.0, dtype=torch.float64)
    x = torch.randn(1, 1, 16, 64, dtype=torch.float64)
    assert torch.allclose(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))
    # q_i . k_j depends only on i - j
    q = torch.randn(64, dtype=torch.float64).expand(1, 1, 16, 64)
    k = torch.randn(64, dtype=torch.float64).expand(1, 1, 16, 64)
    s = apply_rope(q, cos, sin)[0, 0] @ apply_rope(k, cos, sin)[0, 0].T
    assert torch.allclose(s[5, 2], s[10, 7]) and torch.allclose(s[3, 3], s[12, 12])


def test_rope_scalings_agree_up_to_the_training_length_and_differ_beyond():
    """Every RoPE scaling (ntk, pi, yarn, yarn_paper, dynamic with its factor) is the trained RoPE at lengths <=
    train_len, and each differs from the others beyond it; position 0 sees only itself (no rotation, one key) under
    every one."""
    scalings = [s if s != "dynamic" else "dynamic:2" for s in ROPE_SCALINGS]  # dynamic takes its factor
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=512)).eval()
    T = model.cfg.train_len
    idx = torch.randint(0, 512, (2, 4 * T))
    with torch.no_grad():
        for t in (1, T // 2, T):
            a, _ = model(idx[:, :t], rope_scaling="none")
            for scaling in scalings:
                assert torch.equal(model(idx[:, :t], rope_scaling=scaling)[0], a), (scaling, t)
        long = {scaling: model(idx, rope_scaling=scaling)[0] for scaling in scalings}
    for a in scalings:
        for b in scalings:
            if a < b:
                assert not torch.allclose(long[a], long[b]), (a, b)
    for scaling in scalings:
        assert torch.allclose(long[scaling][:, :1], long["none"][:, :1], atol=1e-5)


def test_tiny_forward_at_16x_training_length():
    torch.manual_seed(0)
    for attention in ("lssar", "softmax"):
        model = GPT(preset("tiny", attention=attention)).eval()
        T = 16 * model.cfg.train_len
        idx = torch.randint(0, model.cfg.vocab_size, (1, T))
        with torch.no_grad():
            loss, correct = model.token_stats(idx[:, :-1], idx[:, 1:], rope_scaling="ntk")
        assert loss.shape == (1, T - 1) and correct.dtype == torch.bool
        assert torch.isfinite(loss).all()


@pytest.mark.parametrize("attention", ["softmax", "lssa", "lssar", "sigmoid_ramapuram", "relu_shen"])
def test_initial_loss_is_near_ln_vocab(attention):
    torch.manual_seed(0)
    model = GPT(preset("tiny", attention=attention))
    idx = torch.randint(0, model.cfg.vocab_size, (4, 65))
    with torch.no_grad():
        _, loss = model(idx[:, :-1], idx[:, 1:])
    assert loss.item() == pytest.approx(math.log(50257), abs=0.15)


def test_token_stats_agree_with_forward_loss_and_masks():
    torch.manual_seed(1)
    model = GPT(preset("tiny", vocab_size=300)).eval()
    idx = torch.randint(0, 300, (3, 41))
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        logits, loss = model(x, y)
        tok_loss, tok_correct = model.token_stats(x, y, chunk=7)
        mask = torch.zeros_like(y, dtype=torch.bool)
        mask[:, 20:] = True
        _, masked = model(x, y, loss_mask=mask)
    assert tok_loss.mean().item() == pytest.approx(loss.item(), rel=1e-5)
    assert masked.item() == pytest.approx(tok_loss[:, 20:].mean().item(), rel=1e-5)
    # token_stats runs the LM head in chunks of 7 positions, the forward over all of them: logits equal to float32
    # rounding, not bit for bit, so an argmax may flip only where the top two logits (nearly) tie
    top2 = logits.topk(2, dim=-1).values
    decisive = top2[..., 0] - top2[..., 1] > 1e-4
    assert decisive.float().mean() > 0.9, decisive.float().mean()
    assert torch.equal(tok_correct[decisive], (logits.argmax(-1) == y)[decisive])


def test_token_stats_give_the_cross_entropy_contiguous_rows(monkeypatch):
    """CUDA's log-softmax copies a transposed input contiguous first: logits given as ``(B, vocab, T)`` cost 4 more
    bytes per logit at evaluation's peak (an H100 measured 3.06 GiB against 2.28 at 4 x 1,024 tokens)."""
    import attnlab.model.gpt as gpt

    seen = []
    real = gpt.F.cross_entropy

    def spy(logits, target, **kwargs):
        seen.append((logits.dim(), logits.is_contiguous()))
        return real(logits, target, **kwargs)

    monkeypatch.setattr(gpt.F, "cross_entropy", spy)
    model = GPT(preset("tiny", vocab_size=300)).eval()
    idx = torch.randint(0, 300, (2, 21))
    loss, _ = model.token_stats(idx[:, :-1], idx[:, 1:], chunk=8)
    assert loss.shape == (2, 20)
    assert seen == [(2, True)] * 3

def test_eval_time_attention_override_leaves_weights_untouched():
    torch.manual_seed(2)
    model = GPT(preset("tiny", attention="lssa")).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 1000, (1, 32))
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(idx, attention=model.cfg.attention_spec(p=15))
    assert not torch.allclose(a, b)
    assert model.cfg.attention_spec(p=15) == get_variant("lssa", p=15)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_gradients_flow_through_sharpened_attention():
    torch.manual_seed(3)
    model = GPT(preset("tiny", attention="lssar", vocab_size=128))
    idx = torch.randint(0, 128, (2, 33))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.blocks[0].attn.c_attn.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("bad, match", [
    (dict(name="gpt5"), "preset='gpt5' is unknown"),
    (dict(name="tiny", n_layers=3), "model.n_layers is not a model field"),
    (dict(name="tiny", attention="softmaxx"), "attention='softmaxx' is unknown"),
    (dict(name="tiny", n_head=3), "not divisible"),
    (dict(name="tiny", p_train=0), "p_train=0 is not allowed: use default"),
    (dict(name="tiny", block="x"), "model.block='x' is not allowed: use one of gpt2, llama"),
    (dict(name="tiny", position="x"), "model.position='x' is not allowed: use one of rope, nope, alibi"),
])
def test_bad_model_config(bad, match):
    name = bad.pop("name")
    with pytest.raises(UserError, match=match):
        preset(name, **bad)


def test_the_token_embedding_is_an_operator_with_nn_embeddings_gradient():
    """Compiled, nn.Embedding's backward became an atomic index_put (two identical GPU steps differed in the last
    bits); as attnlab::embedding it stays one operator whose backward is aten's sorted, deterministic one."""
    from attnlab.model.gpt import embedding

    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    reference = weight.detach().clone().requires_grad_()
    idx = torch.randint(0, 50, (3, 40), generator=torch.Generator().manual_seed(0))
    grad = torch.randn(3, 40, 8, dtype=torch.float64)
    embedding(weight, idx).backward(grad)
    torch.nn.functional.embedding(idx, reference).backward(grad)
    assert torch.equal(weight.grad, reference.grad)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    model = GPT(preset("tiny", attention="softmax", vocab_size=50))
    torch.compile(model.embed, backend=capture, fullgraph=True)(idx)
    assert "attnlab.embedding" in graphs[0] and "aten.embedding" not in graphs[0]
