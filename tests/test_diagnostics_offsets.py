"""The offset-profile diagnostic (where attention lands, by how far back the key is) against full weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.attention import attention_weights
from attnlab.evaluate.diagnostics import offset_profile
from attnlab.model import GPT, preset


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(preset("tiny", vocab_size=64, train_len=16)).eval()


def _full_weights(model, window):
    captured = {}

    def capture(layer, q, k, qk_gain=None):
        captured[layer] = attention_weights(q, k, model.spec)[0]  # (H, T, T)

    model.hidden_states(torch.as_tensor(window[None, :-1]), on_attention=capture)
    return captured


def test_offset_profile_matches_the_full_weights(model):
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 64, size=(2, 41))  # L = 40 > max_offset = train_len = 16
    rows = np.zeros((2, 40), dtype=bool)
    rows[0, [3, 20, 39]] = True  # row 3 has only 4 keys: offsets 4.. are absent, not zero-weight keys
    rows[1, 30:] = True
    whole = offset_profile(model, windows, rows)
    chunked = offset_profile(model, windows, rows, chunk_bytes=1)  # one query row at a time
    assert len(whole) == model.cfg.n_layer * model.cfg.n_head
    expected, gaps = {}, []
    for window, mask in zip(windows, rows):
        for layer, w in _full_weights(model, window).items():
            w = w.abs() / w.abs().sum(-1, keepdim=True)
            for i in np.nonzero(mask)[0]:
                for head in range(w.shape[0]):
                    e = expected.setdefault((layer, head), dict(profile=np.zeros(16), beyond=0.0, sink=0.0,
                                                                top=np.zeros(17)))
                    e["top"][min(16, i - int(w[head, i, : i + 1].argmax()))] += 1 / rows.sum()
                    if i > 0:
                        best = w[head, i, : i + 1].topk(2).values
                        gaps.append(float((best[0] - best[1]) / best[0]))
                    for d in range(16):
                        if i - d >= 0:
                            e["profile"][d] += float(w[head, i, i - d]) / rows.sum()
                    e["beyond"] += float(w[head, i, : max(0, i - 15)].sum()) / rows.sum()
                    e["sink"] += float(w[head, i, 0]) / rows.sum()
    # The top-offset counts are compared exactly: every row's largest weight leads the next by far more than float32
    # rounding (1e-4 of it, measured; 1e-5 asked), so the whole, the chunked and the full weights pick the same key
    # whatever shapes the BLAS runs.
    assert min(gaps) > 1e-5, min(gaps)
    for a, b in zip(whole, chunked):
        key = (a["layer"], a["head"])
        assert (b["layer"], b["head"]) == key and a["n_rows"] == b["n_rows"] == 13
        np.testing.assert_allclose(a["profile"], expected[key]["profile"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(b["profile"], a["profile"], rtol=1e-5, atol=1e-7)
        assert a["beyond"] == pytest.approx(expected[key]["beyond"], abs=1e-6)
        assert a["sink_mass"] == pytest.approx(expected[key]["sink"], abs=1e-6)
        assert a["profile"].sum() + a["beyond"] == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_allclose(a["top"], expected[key]["top"][:16], atol=1e-12)
        assert a["top_beyond"] == pytest.approx(expected[key]["top"][16]) and b["top_beyond"] == a["top_beyond"]
        assert a["top"].sum() + a["top_beyond"] == pytest.approx(1.0)
    # Row 3 sees keys 0..3 only: its offsets 4..15 contribute nothing, and its key 0 is 3 back, not beyond.
    single = offset_profile(model, windows[:1], rows[:1] & (np.arange(40) == 3))
    assert all(np.all(r["profile"][4:] == 0) and r["beyond"] == pytest.approx(0.0, abs=1e-7) for r in single)


def test_offset_profile_rejects_a_mask_of_the_wrong_shape(model):
    with pytest.raises(ValueError, match=r"rows mask has shape \(1, 5\); expected \(1, 8\)"):
        offset_profile(model, np.zeros((1, 9), dtype=np.int64), np.ones((1, 5), dtype=bool))
