"""The readers the trainer and evaluator use: ``TokenShards`` and ``TrainSampler`` (the reader contract)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.data import EOT_ID, TokenShards, TrainSampler, get_encoding, prepare
from attnlab.data.readers.tokens import ConcatTokens
from attnlab.errors import UserError
from conftest_data import demo_data_dir, small_text_corpus  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def one_and_many(tmp_path_factory, small_text_corpus):  # noqa: F811
    """The same corpus and seed prepared as one big shard per split and as many 1,500-token shards."""
    folder, _ = small_text_corpus
    base = tmp_path_factory.mktemp("reader")
    kw = dict(val_tokens=6000, seed=11, workers=1, progress=False)
    prepare("text", str(folder), str(base / "one"), shard_tokens=10**8, **kw)
    prepare("text", str(folder), str(base / "many"), shard_tokens=1500, **kw)
    return TokenShards.open(base / "one"), TokenShards.open(base / "many")


def test_demo_data_dir_is_big_enough_for_the_trainer(demo_data_dir):  # noqa: F811
    ds = TokenShards.open(demo_data_dir)
    assert ds.num_tokens("train") >= 300_000 and 0 < ds.num_tokens("val") <= 200_000
    assert ds.vocab_size == 50257 and ds.eot_id == 50256 and len(ds.manifest_sha256) == 64
    assert ds.manifest["source"]["kind"] == "demo" and "public-domain" in ds.manifest["source"]["license"].lower()
    assert isinstance(ds.tokens("train"), np.ndarray) and ds.tokens("train").dtype == np.uint16
    assert ds.num_tokens("train") + ds.num_tokens("val") > 2_000_000


def test_doc_offsets_point_at_every_eot_and_splits_hold_whole_documents(one_and_many, small_text_corpus):  # noqa: F811
    one, many = one_and_many
    _, docs = small_text_corpus
    enc = get_encoding()
    for ds in (one, many):
        for split in ("train", "val"):
            tokens = np.asarray(ds.tokens(split))
            assert len(tokens) == ds.num_tokens(split)
            # no document contains the literal EOT id, so the EOT positions are exactly the document starts
            assert ds.doc_offsets(split).tolist() == np.flatnonzero(tokens == EOT_ID).tolist()
        assert len(ds.doc_offsets("train")) + len(ds.doc_offsets("val")) == len(docs)
    # every validation document is a whole document of the corpus
    val = np.asarray(one.tokens("val"))
    pieces = np.split(val, one.doc_offsets("val")[1:])
    originals = {tuple([EOT_ID] + enc.encode_ordinary(d)) for d in docs}
    assert all(tuple(p.tolist()) in originals for p in pieces)
    assert sum(len(p) for p in pieces) <= 6000


def test_many_shards_read_exactly_like_one(one_and_many):
    one, many = one_and_many
    assert isinstance(many.tokens("train"), ConcatTokens) and len(many.manifest["shards"]) > 10
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(many.tokens(split)), one.tokens(split))
        assert many.doc_offsets(split).tolist() == one.doc_offsets(split).tolist()
    t = many.tokens("train")
    assert np.array_equal(t[1490:1510], one.tokens("train")[1490:1510])  # a slice across a shard end
    assert t[1500] == one.tokens("train")[1500] and t[-1] == one.tokens("train")[-1]
    for L in (7, 64, 1000):
        assert np.array_equal(many.eval_windows("val", L), one.eval_windows("val", L))
        assert np.array_equal(many.eval_windows("train", L, long_docs=True), one.eval_windows("train", L, long_docs=True))


@pytest.mark.parametrize("L", [1, 5, 128, 1024])
def test_eval_windows_predict_every_val_token_exactly_once(one_and_many, L):
    one, _ = one_and_many
    tokens = one.tokens("val").astype(np.int64)
    w = one.eval_windows("val", seq_len=L)
    n = (len(tokens) - 1) // L
    assert w.shape == (n, L + 1) and w.dtype == np.int64
    assert np.array_equal(w[:, :-1].reshape(-1), tokens[: n * L])  # inputs tile the stream
    assert np.array_equal(w[:, 1:].reshape(-1), tokens[1 : n * L + 1])  # each target exactly once
    assert np.array_equal(w[1:, 0], w[:-1, -1])
    capped = one.eval_windows("val", seq_len=L, max_tokens=3 * L + L // 2)
    assert np.array_equal(capped, w[:3])


def test_long_doc_windows_stay_inside_long_documents(one_and_many):
    one, _ = one_and_many
    L = 150
    tokens = np.asarray(one.tokens("train")).astype(np.int64)
    starts, lengths = one.doc_offsets("train"), one.doc_lengths("train")
    w = one.eval_windows("train", seq_len=L, long_docs=True)
    expected = [tokens[s + k * L : s + k * L + L + 1] for s, n in zip(starts, lengths) for k in range((n - 1) // L)]
    assert len(expected) > 5 and np.array_equal(w, np.stack(expected))
    assert (w[:, 1:] != EOT_ID).all()  # no window crosses into the next document
    assert one.eval_windows("train", seq_len=10**6, long_docs=True).shape == (0, 10**6 + 1)


def test_sampler_ranks_are_disjoint_and_cover_the_global_batch(demo_data_dir):  # noqa: F811
    ds = TokenShards.open(demo_data_dir)
    T, G = 64, 16
    sampler = TrainSampler(ds, seq_len=T, global_batch=G, seed=5)
    x_all, y_all = sampler.batch(step=3, rank=0, world_size=1, micro=0, micro_batch=G)
    assert x_all.shape == (G, T) and x_all.dtype == torch.long
    assert torch.equal(x_all[:, 1:], y_all[:, :-1])
    tokens = ds.tokens("train")
    for row, s in enumerate(sampler.step_starts(3)):  # the windows are the real tokens at the drawn starts
        assert x_all[row].tolist() == tokens[s : s + T].tolist() and y_all[row, -1] == int(tokens[s + T])
    rows = {}
    for world, micro_batch in ((2, 4), (4, 2), (8, 1)):
        parts = []
        for m in range(G // (world * micro_batch)):
            for r in range(world):
                x, y = sampler.batch(3, rank=r, world_size=world, micro=m, micro_batch=micro_batch)
                parts.append(((m * world + r) * micro_batch, x, y))
        got = torch.cat([x for _, x, _ in sorted(parts, key=lambda p: p[0])])
        assert torch.equal(got, x_all)  # ranks x micro-steps tile the global batch, no overlap
        rows[world] = parts
    a = sampler.batch(3, rank=0, world_size=2, micro=0, micro_batch=4)[0]
    b = sampler.batch(3, rank=1, world_size=2, micro=0, micro_batch=4)[0]
    assert not torch.equal(a, b)


def test_sampler_resume_gives_the_same_batches(demo_data_dir):  # noqa: F811
    ds = TokenShards.open(demo_data_dir)
    first = TrainSampler(ds, seq_len=32, global_batch=8, seed=1)
    run = [first.batch(s, rank=1, world_size=2)[0] for s in range(6)]
    resumed = TrainSampler(TokenShards.open(demo_data_dir), seq_len=32, global_batch=8, seed=1)
    assert all(torch.equal(run[s], resumed.batch(s, rank=1, world_size=2)[0]) for s in range(3, 6))
    assert not torch.equal(run[3], run[4])
    other_seed = TrainSampler(ds, seq_len=32, global_batch=8, seed=2)
    assert not torch.equal(run[3], other_seed.batch(3, rank=1, world_size=2)[0])


def test_sampler_bad_arguments_are_user_errors(demo_data_dir, one_and_many):  # noqa: F811
    ds = TokenShards.open(demo_data_dir)
    with pytest.raises(UserError, match="exceeds"):
        TrainSampler(ds, seq_len=ds.num_tokens("train"), global_batch=1)
    sampler = TrainSampler(ds, seq_len=8, global_batch=4)
    with pytest.raises(UserError, match="global_batch is 4"):
        sampler.batch(0, rank=1, world_size=2, micro=1, micro_batch=2)
    with pytest.raises(UserError, match="split 'test' is unknown"):
        ds.num_tokens("test")
    many = one_and_many[1]  # windows across shard ends work with the concatenated view
    s = TrainSampler(many, seq_len=3000, global_batch=2, seed=0)
    x, y = s.batch(0, micro_batch=2)
    for row, start in enumerate(s.step_starts(0)):
        assert x[row].tolist() == many.tokens("train")[start : start + 3000].tolist()


def test_opening_reads_the_manifest_only_and_each_split_on_first_use(tmp_path, small_text_corpus):  # noqa: F811
    """Opening needs the manifest alone (the study driver and `attnlab train`'s check read no shard); evaluation reads
    the val split only; a missing shard is named when its split is first used."""
    import shutil

    folder, _ = small_text_corpus
    out = tmp_path / "data"
    prepare("text", str(folder), str(out), shard_tokens=1500, val_tokens=6000, seed=11, workers=1, progress=False)
    full = TokenShards.open(out)
    expected_val = full.eval_windows("val", seq_len=64)
    train_total = full.num_tokens("train")
    missing = tmp_path / "missing"
    shutil.copytree(out, missing)
    for f in missing.glob("train-*.arrow"):
        f.unlink()
    ds = TokenShards.open(missing)
    assert ds.num_tokens("train") == train_total  # from the manifest
    assert (ds.eval_windows("val", seq_len=64) == expected_val).all()
    with pytest.raises(UserError, match=r"shard train-00000\.arrow is missing"):
        ds.tokens("train")
