"""The orbit GPT: pair embedding, per-coordinate heads, and that training/evaluation code written for the text
GPT runs on it unchanged (every attention variant, RoPE/NTK, p_eval, diagnostics, checkpoint config)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.data.generators.orbits import open_orbits
from attnlab.errors import UserError
from attnlab.model.scoring import mean_window_loss
from attnlab.evaluate.diagnostics import attention_diagnostics
from attnlab.model import GPT, GPTConfig
from attnlab.model.orbit import OrbitGPT, OrbitGPTConfig, build_model, config_from_dict, with_kind

SMALL = {"synthetic": "orbits", "size": "cpu", "block_systems": 10, "n_train_systems": 40, "n_val_systems": 20}


@pytest.fixture(scope="module")
def data():
    return open_orbits(SMALL)


def tiny(vocab: int, attention: str = "softmax", **kw) -> OrbitGPT:
    torch.manual_seed(0)
    return OrbitGPT(OrbitGPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=vocab, train_len=32,
                                   attention=attention, **kw))


def test_forward_loss_is_the_mean_of_the_coordinate_cross_entropies(data):
    model = tiny(data.vocab_size)
    x, y, mask = data.train_batch(0, 0, 1, 0, 4, seq_len=32, global_batch=4, seed=0)
    logits, loss = model(x, y, loss_mask=mask)
    assert logits.shape == (4, 32, 2, data.vocab_size)
    ce_x = F.cross_entropy(logits[:, :, 0].reshape(-1, data.vocab_size), y[..., 0].reshape(-1))
    ce_y = F.cross_entropy(logits[:, :, 1].reshape(-1, data.vocab_size), y[..., 1].reshape(-1))
    torch.testing.assert_close(loss, (ce_x + ce_y) / 2)
    token_loss, correct = model.token_stats(x, y)
    assert token_loss.shape == correct.shape == (4, 32) and correct.dtype == torch.bool
    torch.testing.assert_close(token_loss.mean(), loss.detach())
    # a mask keeps only its positions
    keep = torch.zeros(4, 32, dtype=torch.bool)
    keep[:, 5] = True
    _, masked = model(x, y, loss_mask=keep)
    torch.testing.assert_close(masked, token_loss[:, 5].mean())


def test_coord_stats_measures_the_distance_of_the_argmax_bins(data):
    model = tiny(data.vocab_size)
    x, y, _ = data.train_batch(0, 0, 1, 0, 2, seq_len=16, global_batch=2, seed=0)
    loss, correct, dist = model.coord_stats(x, y, chunk=5)  # chunking must not change anything
    logits, _ = model(x)
    guess = logits.argmax(-1)
    expect = (guess - y).float().pow(2).sum(-1).sqrt()
    # the head in chunks of 5 positions vs all at once: logits equal to float32 rounding, not bit for bit, so an
    # argmax bin may differ only where a coordinate's top two logits (nearly) tie
    top2 = logits.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1] > 1e-4).all(-1)
    assert decisive.float().mean() > 0.9, decisive.float().mean()
    torch.testing.assert_close(dist[decisive], expect[decisive])
    assert torch.equal(correct[decisive], (guess == y).all(-1)[decisive])
    assert torch.equal(correct, dist == 0)
    torch.testing.assert_close(loss, model.token_stats(x, y)[0])


@pytest.mark.parametrize("attention", ["softmax", "lssa", "lssar"])
def test_every_attention_variant_trains_and_extrapolates_with_ntk(data, attention):
    model = tiny(data.vocab_size, attention)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(25):
        x, y, _ = data.train_batch(step, 0, 1, 0, 8, seq_len=32, global_batch=8, seed=0)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 1.0  # from ~ln(258) = 5.55 nats: it learns something about the bins
    windows, _ = data.eval_set(128, max_tokens=128 * 3)  # 4x the training length
    for rope in ("none", "ntk"):
        total, count, right = mean_window_loss(model, windows, batch_size=2, rope_scaling=rope,
                                               attention=model.cfg.attention_spec(p=3.0))
        assert count == 3 * 128 and np.isfinite(total) and 0 <= right <= count


def test_evaluation_and_diagnostics_code_runs_unchanged_on_pair_windows(data):
    model = tiny(data.vocab_size, "lssar")
    windows, mask = data.eval_set(32, max_tokens=32 * 4)
    total, count, _ = mean_window_loss(model, windows, target_mask=mask, batch_size=3)
    x = torch.as_tensor(windows)
    _, loss = model(x[:, :-1], x[:, 1:])
    assert count == 4 * 32
    assert total / count == pytest.approx(float(loss.detach()), rel=1e-5)
    stats = attention_diagnostics(model, windows[:2], rope_scaling="ntk")
    assert [s["layer"] for s in stats] == [0, 1] and all(np.isfinite(s["entropy"]) for s in stats)


def test_configs_round_trip_and_pick_the_model_class():
    cfg = OrbitGPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=258, train_len=64, attention="lssar")
    fields = dataclasses.asdict(cfg)
    assert fields["model_kind"] == "orbit"
    again = config_from_dict(fields)
    assert again == cfg and isinstance(build_model(again), OrbitGPT)
    plain = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=100, train_len=64)
    assert isinstance(build_model(config_from_dict(dataclasses.asdict(plain))), GPT)
    assert with_kind(plain, "orbit").model_kind == "orbit" and with_kind(cfg, "gpt") == dataclasses.replace(
        plain, vocab_size=258, attention="lssar")
    assert cfg.replace(p_train=3.0).attention_spec().p == 3.0
    model = build_model(cfg)
    n = model.num_params()
    assert model.flops_per_token(64) == 6.0 * n + 12.0 * 2 * 2 * 64 * 64
    with pytest.raises(UserError, match="model_kind"):
        config_from_dict({**fields, "model_kind": "rnn"})
    with pytest.raises(UserError, match="channels"):
        OrbitGPTConfig(channels=0)


def test_wrong_token_shape_is_a_user_error(data):
    model = tiny(data.vocab_size)
    with pytest.raises(UserError, match=r"\(B, T, 2\)"):
        model(torch.zeros(2, 8, dtype=torch.long))
