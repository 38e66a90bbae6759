"""What training and evaluation need from a data source, and ``open_data``: the one way to get one.

A data source is either real text (a folder made by ``attnlab data prepare``: :class:`TextData`), a
generated probe task (``{synthetic: TASK, ...}``: :class:`attnlab.data.generators.synthetic.SyntheticData`) or
simulated orbits (``{synthetic: orbits, ...}``: :class:`attnlab.data.generators.orbits.OrbitData`, whose tokens
are (x, y) bin pairs).
All implement :class:`DataSource`, so training, validation and evaluation never ask which kind they hold; a
source's ``model_kind`` (default ``gpt``) says which model reads its tokens (``orbit``: two coordinates per token).

Both cut batches by one rule, :func:`attnlab.data.batching.micro_batch_rows`.

No Ray here.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from attnlab.errors import UserError


@runtime_checkable
class DataSource(Protocol):
    """The interface of a data source.

    - ``vocab_size``: the model's vocabulary must be at least this;
    - ``fingerprint``: a content hash (the manifest's sha256, or the task's parameters): a training run's
      identity uses it, never the path;
    - ``train_batch(...)`` -> ``(x, y, loss_mask or None)`` tensors ``(B, T)``: rank ``rank``'s rows of
      micro-step ``micro`` of optimizer step ``step`` (see :func:`micro_batch_rows`);
    - ``eval_set(seq_len, max_tokens, long_docs=False, seed=0)`` -> ``(windows (n, L + 1) int64,
      target_mask (n, L) bool or None)``: for text, non-overlapping windows over the validation split; for a
      probe, generated sequences at that length whose mask marks the scored positions.
    """

    vocab_size: int
    fingerprint: str

    def describe(self) -> str: ...
    def min_tokens(self) -> int: ...
    def train_batch(self, step: int, rank: int, world_size: int, micro: int, micro_batch: int, *, seq_len: int,
                    global_batch: int, seed: int): ...
    def eval_set(self, seq_len: int, max_tokens: int | None, long_docs: bool = False, seed: int = 0): ...


DEMO = "demo"  # the offline demo corpus, prepared once into the attnlab cache (GPT-2 tokens)
DEMO_BYTES = "demo-bytes"  # the same corpus as UTF-8 bytes (the real-text CPU proxy's data)
# what `data: demo` / `data: demo-bytes` prepare: folder name, tokeniser, validation budget (~10% of the corpus)
_DEMO_DATA = {DEMO: ("demo-v1", "gpt2", 200_000), DEMO_BYTES: ("demo-bytes-v1", "bytes", 800_000)}
ORBITS = "orbits"  # {synthetic: orbits, ...}: simulated planetary orbits (attnlab.data.generators.orbits)


def model_kind(source) -> str:
    """Which model reads the source's tokens: ``gpt`` (one token id per position) or ``orbit`` (x, y bins)."""
    return getattr(source, "model_kind", "gpt")


def demo_data_location(name: str = DEMO) -> str:
    from attnlab.cache import cache_dir

    return str(cache_dir() / "prepared" / _DEMO_DATA[name][0])


def resolve_data(spec: str | dict[str, Any], *, log=print) -> str | dict[str, Any]:
    """What a user wrote for ``data`` as what every worker can open: ``demo`` / ``demo-bytes`` -> the demo corpus
    prepared with GPT-2 tokens / UTF-8 bytes (built on first use); a relative path -> absolute (against the
    current directory, or inside a Ray job below ``$ATTNLAB_STORAGE``: :func:`attnlab.location.user_input`); a URI
    as it is; a probe mapping as it is."""
    if isinstance(spec, dict):
        return spec
    if spec in _DEMO_DATA:
        out = demo_data_location(spec)
        _folder, tokenizer, val_tokens = _DEMO_DATA[spec]
        from attnlab.location import Location

        if not Location.parse(out).exists("manifest.json"):
            from attnlab.data.pipeline.prepare import prepare

            log(f"attnlab: building the demo corpus ({tokenizer} tokens) into {out} (once)")
            prepare("demo", out=out, val_tokens=val_tokens, seed=0, workers=1, progress=False, tokenizer=tokenizer)
        return out
    from attnlab.location import user_input

    return user_input(spec, field="data").uri


def check_prepared(spec: str | dict[str, Any], field: str = "train.data") -> None:
    """A local folder named as prepared data that holds none: one line now, before anything runs, instead of a
    failure in every trial. Generated sources, the demo corpora (built on first use) and object-store URIs (read
    by the workers, checked when the study opens them) pass."""
    if isinstance(spec, dict) or spec in _DEMO_DATA:
        return
    from attnlab.location import user_input

    loc = user_input(spec, field=field)
    if loc.is_local and not loc.exists("manifest.json"):
        what = "does not exist" if not loc.exists() else "holds no manifest.json"
        raise UserError(f"{field}={spec!r}: {loc.uri} {what}; prepare it first (attnlab data prepare --out {spec}), "
                        "or check a cluster's study with --cluster")


def data_label(spec: str | dict[str, Any]) -> str:
    """A short name for the results' ``data`` column: ``synthetic:TASK``, or a folder's last component."""
    if isinstance(spec, dict):
        return f"synthetic:{spec.get('synthetic')}"
    return str(spec).rstrip("/").rsplit("/", 1)[-1]


def check_data(spec: str | dict[str, Any], field: str = "data") -> None:
    """What a user wrote for ``data``, checked from the text alone, as a study or config is validated: a generated
    source's parameters (nothing is generated), a location's form (a bucket URI names its bucket). Nothing is
    opened, read or asked of the network; UserError (one line naming ``field``) on bad input."""
    if isinstance(spec, dict):
        if spec.get("synthetic") == ORBITS:
            from attnlab.data.generators.orbits import orbit_task

            orbit_task(spec)
        else:
            from attnlab.data.generators.synthetic import synthetic_task

            synthetic_task(spec)
        return
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"{field}={spec!r} is not allowed: use a folder made by `attnlab data prepare` or "
                        "{synthetic: TASK, ...}")
    from attnlab.location import check_bucket

    check_bucket(spec, field)


def open_data(spec: str | dict[str, Any]) -> DataSource:
    """A prepared folder (path or URI) -> :class:`TextData`; ``{synthetic: TASK, ...}`` -> the probe task."""
    if isinstance(spec, dict):
        if spec.get("synthetic") == ORBITS:
            from attnlab.data.generators.orbits import open_orbits

            return open_orbits(spec)
        from attnlab.data.generators.synthetic import open_task

        return open_task(spec)
    from attnlab.data.readers.tokens import TextData

    if not isinstance(spec, str) or not spec:
        raise UserError(f"data={spec!r} is not allowed: use a folder made by `attnlab data prepare` or "
                        "{synthetic: TASK, ...}")
    return TextData(spec)


__all__ = ["DEMO", "DEMO_BYTES", "ORBITS", "DataSource", "check_data", "check_prepared", "data_label", "model_kind",
           "open_data", "resolve_data"]
