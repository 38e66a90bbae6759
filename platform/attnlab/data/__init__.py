"""Data: what training and evaluation read, in three places and the pieces they share.

- ``pipeline/``: the prepare pipeline (document sources in, token shards out);
- ``readers/``: batches from a prepared folder, local or in a bucket;
- ``generators/``: sources that make their tokens on the fly (synthetic probes, simulated orbits);
- shared: ``source`` (``open_data``, the one entry to any of them), ``shards`` (the prepared format both sides
  agree on), ``tokenizer`` (GPT-2 and bytes), ``batching`` (one rule for cutting batches); ``cli``.

Public API (no Ray needed to import any of it; only ``prepare(..., workers>1)`` starts Ray tasks):

- ``prepare(source, path, out, shard_tokens=..., val_tokens=..., seed=0, workers=None)``: build shards.
- ``verify(dir)``: re-check every shard's sha256 and counts.
- ``TokenShards.open(dir)``, ``TrainSampler(shards, seq_len, global_batch, seed)``: read them.
- ``open_data(spec)`` -> a ``DataSource`` (a prepared folder, or ``{synthetic: TASK, ...}``): what training
  and evaluation read.
- ``get_encoding()``, ``seed_tiktoken_cache()``, ``encode_document(text)``, ``EOT_ID``, ``GPT2_VOCAB``.
- ``make_source(kind, ...)``, ``SOURCE_KINDS``; ``ensure_demo_corpus()`` (the offline demo texts).
"""

from attnlab.data.pipeline.corpora import SOURCE_KINDS, make_source
from attnlab.data.pipeline.demo_corpus import ensure_demo_corpus
from attnlab.data.pipeline.prepare import prepare
from attnlab.data.readers.tokens import TokenShards, TrainSampler
from attnlab.data.shards import verify
from attnlab.data.source import DataSource, open_data
from attnlab.data.tokenizer import EOT_ID, GPT2_VOCAB, encode_document, get_encoding, seed_tiktoken_cache

__all__ = [
    "DataSource",
    "EOT_ID",
    "GPT2_VOCAB",
    "SOURCE_KINDS",
    "TokenShards",
    "TrainSampler",
    "encode_document",
    "ensure_demo_corpus",
    "get_encoding",
    "make_source",
    "open_data",
    "prepare",
    "seed_tiktoken_cache",
    "verify",
]
