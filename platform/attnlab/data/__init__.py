"""Data pipeline: GPT-2 tokeniser, document sources, Arrow token shards, and the readers the trainer uses.

Public API (no Ray needed to import any of it; only ``prepare(..., workers>1)`` starts Ray tasks):

- ``prepare(source, path, out, shard_tokens=..., val_tokens=..., seed=0, workers=None)``: build shards.
- ``verify(dir)``: re-check every shard's sha256 and counts.
- ``TokenShards.open(dir)``, ``TrainSampler(shards, seq_len, global_batch, seed)``: read them.
- ``open_data(spec)`` -> a ``DataSource`` (a prepared folder, or ``{synthetic: TASK, ...}``): what training
  and evaluation read.
- ``get_encoding()``, ``seed_tiktoken_cache()``, ``encode_document(text)``, ``EOT_ID``, ``GPT2_VOCAB``.
- ``make_source(kind, ...)``, ``SOURCE_KINDS``; ``ensure_demo_corpus()`` (the offline demo texts).
"""

from attnlab.data.demo_corpus import ensure_demo_corpus
from attnlab.data.prepare import prepare
from attnlab.data.reader import TokenShards, TrainSampler
from attnlab.data.shards import verify
from attnlab.data.source import DataSource, open_data
from attnlab.data.corpora import SOURCE_KINDS, make_source
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
