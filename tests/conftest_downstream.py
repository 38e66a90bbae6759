"""The offline downstream task folder (loaded from tests/conftest.py via ``pytest_plugins``), shared by the files that
score tasks with lm-evaluation-harness: tests/test_downstream.py (attnlab's own harness model) and tests/test_export.py
(the harness's ``hf`` model on an exported folder).

- ``downstream_tasks``: tests/downstream_tasks (three tasks in the harness's YAML format) copied once per session with
  their data written as JSONL from the demo corpus: ``(folder, mc docs, last-word texts, rolling texts)``. A tiny model
  trained on the demo corpus prefers English to random GPT-2 tokens, so the multiple-choice task, whose gold answer is
  the English continuation in 9 of 12 documents (and the random tokens in 3), scores acc 0.75 exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

TASKS = Path(__file__).parent / "downstream_tasks"
MC_GOLD_ENGLISH = 9  # of 12 documents; the other 3 name the random tokens as the answer
N_MC = 12


def passages(n: int, words: int, offset: int = 0) -> list[str]:
    """``n`` passages of ``words`` words from the demo corpus."""
    from attnlab.data.pipeline.demo_corpus import ensure_demo_corpus

    texts = sorted(ensure_demo_corpus().glob("*.txt"))
    out = []
    for i in range(n):
        body = " ".join(texts[i % len(texts)].read_text(encoding="utf-8").split())
        start = (2000 + 977 * (i + offset)) % (len(body) - 4000)
        passage = body[start:].split(" ")[1:words + 1]
        assert len(passage) == words
        out.append(" ".join(passage))
    return out


def gibberish(rng, n_tokens: int) -> str:
    from attnlab.data.tokenizer import get_encoding

    enc = get_encoding()
    return enc.decode([int(t) for t in rng.integers(1000, 50000, size=n_tokens)]).strip()


@pytest.fixture(scope="session")
def downstream_tasks(tmp_path_factory):
    """The three test tasks with their data: (folder, mc docs, last-word texts, rolling texts). Read-only: a test
    that changes the data copies the folder first."""
    folder = tmp_path_factory.mktemp("tasks") / "tasks"
    shutil.copytree(TASKS, folder)
    (folder / "data").mkdir()
    rng = np.random.default_rng(0)
    mc = []
    for i, passage in enumerate(passages(N_MC, 26)):
        words = passage.split(" ")
        english, noise = " ".join(words[20:]), gibberish(rng, 8)
        choices = [english, noise] if i % 2 == 0 else [noise, english]
        gold = choices.index(english) if i < MC_GOLD_ENGLISH else choices.index(noise)
        mc.append({"context": " ".join(words[:20]), "choices": choices, "label": gold,
                   "english": choices.index(english)})
    lastword = [{"text": t} for t in passages(6, 30, offset=50)]
    rolling = [{"text": t} for t in passages(4, 25, offset=90)]
    for name, docs in (("mc", mc), ("lastword", lastword), ("rolling", rolling)):
        (folder / "data" / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return folder, mc, [d["text"] for d in lastword], [d["text"] for d in rolling]
