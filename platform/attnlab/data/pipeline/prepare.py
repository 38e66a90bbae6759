"""``prepare()``: a document source -> shuffled, tokenised, verified token shards (``attnlab data prepare``).

Owns the preparation of a data folder: two phases of independent work items (tokenise one partition, assemble
one shard), run serially or as Ray tasks through :mod:`attnlab.data.pipeline.parallel`, the only Ray code here;
the work folder (``OUT/_work``, or on this machine's disk for a bucket: :func:`local_work_dir`) and its
``plan.json``, from which a re-run with the same arguments resumes.

It must never let shard bytes depend on the number of workers, leave a half-written file, overwrite a folder
prepared with other arguments, or import Ray at module level.

Details: docs/data.md#preparing-attnlab-data-prepare (the phases, resuming), docs/protocol.md#preparation (the
rule: tokens, order, splits, shards), docs/data.md#preparing-into-a-bucket-attnlab-data-prepare---out-s3.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc

import attnlab.faults as faults
from attnlab.data.shards import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    encode_shard,
    file_sha256,
    manifest_bytes,
    read_shard,
    sha256_hex,
    shard_name,
)
from attnlab.data.pipeline.corpora import Partition, Source, make_source
from attnlab.data.tokenizer import DEFAULT_TOKENIZER, Tokenizer, get_tokenizer
from attnlab.errors import UserError
from attnlab.location import Location, atomic_output

WORK_DIR = "_work"
PLAN = "plan.json"
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VAL_TOKENS = 100_000_000  # capped at 10% of the corpus when val_tokens is None
_PART_BATCH_TOKENS = 4_000_000  # a part file is written in record batches of about this many tokens
_IDENTITY_KEYS = ("tokenizer", "vocab_size", "eot_id", "source", "seed", "shard_tokens", "val_tokens_requested")


def _part_name(index: int) -> str:
    return f"part-{index:05d}.arrow"


# ------------------------------------------------------------------------------------------ phase 1 items
@dataclass(frozen=True)
class TokenizeJob:
    source: Source
    partition: Partition
    work: Location
    host: str | None = None  # work is on this host's disk (output on object storage) ...
    fallback: Location | None = None  # ... a task on another host writes its part here (OUT/_work)
    tokenizer: str = DEFAULT_TOKENIZER  # a key of attnlab.data.tokenizer.TOKENIZERS


def tokenize_partition(job: TokenizeJob) -> tuple[int, int]:
    """Tokenise one partition into ``_work/part-NNNNN.arrow``; return (documents, tokens)."""
    if job.host is not None and job.fallback is not None and (
        socket.gethostname() != job.host or not os.path.isdir(job.work.path)
    ):
        job = TokenizeJob(job.source, job.partition, job.fallback, tokenizer=job.tokenizer)
    schema = pa.schema([pa.field("tokens", pa.large_list(pa.uint16()))])
    final = job.work.join(_part_name(job.partition.index))
    n_docs = n_tokens = 0
    encode = get_tokenizer(job.tokenizer).encode
    with atomic_output(job.work.fs, final) as sink, ipc.new_file(sink, schema) as writer:
        pieces: list[np.ndarray] = []
        size = 0

        def flush():
            nonlocal pieces, size
            if pieces:
                offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
                np.cumsum([len(p) for p in pieces], out=offsets[1:])
                values = pa.array(np.concatenate(pieces), pa.uint16())
                writer.write_batch(pa.record_batch([pa.LargeListArray.from_arrays(offsets, values)], schema=schema))
            pieces, size = [], 0

        for text in job.source.documents(job.partition):
            tokens = encode(text)
            pieces.append(tokens)
            size += len(tokens)
            n_docs += 1
            n_tokens += len(tokens)
            if size >= _PART_BATCH_TOKENS:
                flush()
        flush()
    faults.after_data_item()
    return n_docs, n_tokens


class _PartFile:
    """A part file opened for gathering: per record batch its token values and document offsets."""

    def __init__(self, loc: Location, name: str):
        if loc.is_local:
            reader = ipc.open_file(pa.memory_map(loc.join(name), "r"))
        else:
            reader = ipc.open_file(pa.py_buffer(loc.read_bytes(name)))
        self.values: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        for b in range(reader.num_record_batches):
            column = reader.get_batch(b).column(0)
            self.values.append(column.values.to_numpy(zero_copy_only=True))
            self.offsets.append(column.offsets.to_numpy())
        counts = [len(o) - 1 for o in self.offsets]
        self.batch_ends = np.cumsum(counts, dtype=np.int64)
        self.num_docs = int(self.batch_ends[-1]) if counts else 0

    def doc_lengths(self) -> np.ndarray:
        if not self.offsets:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.diff(o) for o in self.offsets]).astype(np.int64)

    def doc(self, i: int) -> np.ndarray:
        b = int(np.searchsorted(self.batch_ends, i, side="right"))
        row = i - (int(self.batch_ends[b - 1]) if b else 0)
        o = self.offsets[b]
        return self.values[b][o[row] : o[row + 1]]


# ------------------------------------------------------------------------------------------ phase 2 items
@dataclass(frozen=True)
class ShardJob:
    work: Location
    out: Location
    name: str
    num_tokens: int
    doc_ids: np.ndarray  # global document ids, in shard order
    piece_lo: np.ndarray  # first token of each document taken into this shard
    piece_hi: np.ndarray  # one past the last
    first_doc_continues: bool
    part_doc_ends: np.ndarray  # cumulative document count per part file


def assemble_shard(job: ShardJob, parts: dict[int, _PartFile] | None = None) -> dict:
    """Gather one shard's tokens from the part files and write it; return its manifest entry.

    ``parts``: part files already open (kept across shards when they are memory-mapped in this process)."""
    tokens = np.empty(job.num_tokens, dtype=np.uint16)
    starts: list[int] = []
    parts = {} if parts is None else parts
    pos = 0
    for k, (doc, lo, hi) in enumerate(zip(job.doc_ids, job.piece_lo, job.piece_hi)):
        p = int(np.searchsorted(job.part_doc_ends, doc, side="right"))
        if p not in parts:
            parts[p] = _PartFile(job.work, _part_name(p))
        local = int(doc) - (int(job.part_doc_ends[p - 1]) if p else 0)
        piece = parts[p].doc(local)[lo:hi]
        if not (k == 0 and job.first_doc_continues):
            starts.append(pos)
        tokens[pos : pos + len(piece)] = piece
        pos += len(piece)
    assert pos == job.num_tokens, (pos, job.num_tokens)
    data = encode_shard(tokens, np.array(starts, dtype=np.int64), job.first_doc_continues)
    job.out.write_bytes(job.name, data)
    faults.after_data_item()
    return _entry(job.name, sha256_hex(data), job.num_tokens, len(starts), job.first_doc_continues)


def _entry(name: str, sha: str, num_tokens: int, num_docs: int, continues: bool) -> dict:
    split, index = name.split(".")[0].split("-")
    return {
        "name": name,
        "split": split,
        "index": int(index),
        "num_tokens": int(num_tokens),
        "num_docs": int(num_docs),
        "first_doc_continues": bool(continues),
        "sha256": sha,
    }


# ------------------------------------------------------------------------------------------------ planning
def split_documents(lengths: np.ndarray, seed: int, val_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle document ids with ``seed``; return (val ids, train ids), both in shuffled order.

    val = the longest prefix of the shuffled order whose tokens fit in ``val_tokens`` (whole documents);
    if even the first document does not fit, the first one in shuffled order that does.
    """
    order = np.random.Generator(np.random.PCG64(seed)).permutation(len(lengths))
    if val_tokens <= 0:
        return order[:0], order
    cum = np.cumsum(lengths[order])
    k = int(np.searchsorted(cum, val_tokens, side="right"))
    if k > 0:
        return order[:k], order[k:]
    fits = np.flatnonzero(lengths[order] <= val_tokens)
    if len(fits) == 0:
        raise UserError(
            f"--val-tokens {val_tokens} is smaller than every document (shortest: {int(lengths.min())} tokens); "
            f"raise it or pass 0 for no validation split"
        )
    j = int(fits[0])
    return order[j : j + 1], np.delete(order, j)


def plan_shards(split: str, doc_ids: np.ndarray, lengths: np.ndarray, shard_tokens: int) -> list[dict]:
    """Cut a split's token stream (documents ``doc_ids`` in order) into ``shard_tokens``-token shards."""
    doc_len = lengths[doc_ids]
    ends = np.cumsum(doc_len)
    begins = ends - doc_len
    total = int(ends[-1]) if len(ends) else 0
    shards = []
    for k in range((total + shard_tokens - 1) // shard_tokens):
        lo, hi = k * shard_tokens, min((k + 1) * shard_tokens, total)
        a = int(np.searchsorted(ends, lo, side="right"))
        b = int(np.searchsorted(ends, hi, side="left"))
        sel = slice(a, b + 1)
        shards.append(
            {
                "name": shard_name(split, k),
                "num_tokens": hi - lo,
                "doc_ids": doc_ids[sel],
                "piece_lo": np.maximum(0, lo - begins[sel]),
                "piece_hi": np.minimum(doc_len[sel], hi - begins[sel]),
                "first_doc_continues": bool(begins[a] < lo),
            }
        )
    return shards


def _remove_work(loc: Location, work: Location, remote: bool) -> None:
    loc.delete(WORK_DIR)
    if remote and os.path.isdir(work.path):
        shutil.rmtree(work.path, ignore_errors=True)


def local_work_dir(out: Location) -> Location:
    """The work folder of a preparation into object storage: on this machine's disk, named by the output URI
    (``<attnlab cache>/prepare-work/<sha256(uri)[:16]>``), so a re-run resumes from it."""
    from attnlab.cache import cache_dir

    key = hashlib.sha256(out.uri.encode()).hexdigest()[:16]
    return Location.parse(str(cache_dir() / "prepare-work" / key))


def _check_same(existing: dict, wanted: dict, where: str) -> None:
    for key in _IDENTITY_KEYS:
        if existing.get(key) != wanted.get(key):
            raise UserError(
                f"output folder {where} already holds shards prepared with {key}={json.dumps(existing.get(key))} "
                f"(this run: {key}={json.dumps(wanted.get(key))}); choose another --out or delete that folder"
            )


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with datasets
        return None
    return tqdm(total=total, desc=desc, unit="item", file=sys.stderr, dynamic_ncols=True, leave=True)


class _Runner:
    """Runs a phase's work items: in this process when ``workers == 1`` or there is at most one item,
    else as Ray tasks through one :class:`attnlab.data.pipeline.parallel.RayPool` kept for both phases."""

    def __init__(self, workers: int | None):
        self.workers = workers
        self._pool = None

    def __enter__(self) -> _Runner:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.__exit__(*exc)

    def map(self, fn, items):
        if self.workers == 1 or len(items) <= 1:
            for i, item in enumerate(items):
                yield i, fn(item)
            return
        if self._pool is None:
            from attnlab.data.pipeline.parallel import RayPool

            self._pool = RayPool(self.workers).__enter__()
            self.workers = self._pool.workers
        yield from self._pool.map(fn, items)


def resolve_workers(workers: int | None) -> int | None:
    """``None``: every CPU of the Ray cluster (the connected one, or ``RAY_ADDRESS``'s once connected:
    returns None), else of this machine."""
    if workers is not None:
        if int(workers) < 1:
            raise UserError(f"--workers must be >= 1, got {workers}")
        return int(workers)
    from attnlab.data.pipeline.parallel import cluster_cpus

    connected = cluster_cpus()
    if connected is not None:
        return connected
    if os.environ.get("RAY_ADDRESS"):
        return None
    return max(1, os.cpu_count() or 1)


# ------------------------------------------------------------------------------------------------- prepare
@dataclass
class _Job:
    """One ``prepare`` call: where it reads and writes, what it was asked (``wanted``, the identity a finished
    folder must match), and whether it created the output folder (a failure then leaves nothing behind)."""

    src: Source
    tok: Tokenizer
    loc: Location
    work: Location
    remote_work: Location | None
    wanted: dict
    shard_tokens: int
    val_tokens: int | None
    seed: int
    progress: bool
    created_out: bool = False

    @property
    def remote(self) -> bool:
        return self.remote_work is not None

    def discard(self, message: str) -> UserError:
        """Bad input found after tokenising: remove the work folder (and the output folder if this run made it)."""
        _remove_work(self.loc, self.work, self.remote)
        if self.created_out and not self.loc.list_names():
            self.loc.fs.delete_dir(self.loc.path)
        return UserError(message)


def _job(source, path, out, name, text_column, shard_tokens, val_tokens, seed, progress, tokenizer) -> _Job:
    """Check the arguments and say where everything goes (nothing is read or written)."""
    if int(shard_tokens) < 1:
        raise UserError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if val_tokens is not None and int(val_tokens) < 0:
        raise UserError(f"--val-tokens must be >= 0, got {val_tokens}")
    tok = get_tokenizer(tokenizer)
    src = make_source(source, path, name, text_column) if isinstance(source, str) else source
    loc = Location.parse(out, field="--out")
    remote = not loc.is_local
    # into object storage: the intermediate files stay on this machine's disk (read once, never uploaded)
    work = local_work_dir(loc) if remote else loc.child(WORK_DIR)
    wanted = {
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "source": src.describe(),
        "seed": int(seed),
        "shard_tokens": int(shard_tokens),
        "val_tokens_requested": None if val_tokens is None else int(val_tokens),
    }
    return _Job(src, tok, loc, work, loc.child(WORK_DIR) if remote else None, wanted, int(shard_tokens),
                None if val_tokens is None else int(val_tokens), int(seed), progress)


def _already_prepared(job: _Job, t0: float) -> dict | None:
    """Refuse a folder prepared differently; return the summary of one already prepared with these arguments
    (nothing is written either way)."""
    loc, work = job.loc, job.work
    if work.exists(PLAN):
        _check_same(json.loads(work.read_bytes(PLAN)), job.wanted, loc.uri)
    if loc.exists(MANIFEST):
        try:
            existing = json.loads(loc.read_bytes(MANIFEST))
        except json.JSONDecodeError as exc:
            raise UserError(f"{loc.join(MANIFEST)} is not valid JSON ({exc.msg}); delete the folder") from exc
        _check_same(existing, job.wanted, loc.uri)
        total = sum(existing["splits"][s]["num_tokens"] for s in SPLITS)
        return {"manifest": existing, "tokens": total, "seconds": time.perf_counter() - t0, "tokens_per_s": None,
                "skipped_partitions": None, "skipped_shards": len(existing["shards"]), "already_prepared": True,
                "summary": f"{loc.uri} is already prepared with these arguments ({total:,} tokens); nothing to do"}
    if not work.exists(PLAN):
        stray = [n for n in loc.list_names() if n.endswith(".arrow") and n.split("-")[0] in SPLITS]
        if stray:
            raise UserError(
                f"output folder {loc.uri} holds shards ({stray[0]}, ...) without a manifest or plan (unknown "
                f"tokeniser/seed); choose another --out or delete them"
            )
    return None


def _start(job: _Job) -> None:
    """Create the work folder, record the arguments in its plan, and remove what an interrupted run left half
    written (``*.tmp-*``)."""
    loc, work = job.loc, job.work
    job.created_out = not loc.is_dir()
    work.mkdir()
    if not work.exists(PLAN):
        work.write_bytes(PLAN, manifest_bytes(job.wanted))
    for folder in (loc, work) if job.remote else (loc,):
        for stale in folder.list_names() + [WORK_DIR + "/" + n for n in folder.list_names(WORK_DIR)]:
            if ".tmp-" in stale.rsplit("/", 1)[-1]:
                folder.delete(stale)


def _tokenise(job: _Job, partitions: list[Partition], pool: _Runner, workers: int | None) -> int:
    """Phase 1: every partition not tokenised yet becomes a part file; returns how many were already done."""
    work, remote_work = job.work, job.remote_work
    done_parts = set(work.list_names()) | (set(remote_work.list_names()) if job.remote else set())
    todo = [p for p in partitions if _part_name(p.index) not in done_parts]
    skipped_parts = len(partitions) - len(todo)
    if job.progress:
        val = "10% of the corpus" if job.val_tokens is None else f"{job.val_tokens:,}"
        print(f"plan: tokenise ({job.tok.key}) {len(partitions)} partition(s) of {job.src.kind} ({len(todo)} left) "
              f"into {job.loc.uri}: shards of {job.shard_tokens:,} tokens, {val} validation tokens of whole "
              f"documents, seed {job.seed}, "
              f"{'every CPU of the cluster' if workers is None else f'{workers} worker(s)'}", flush=True)
    bar = _progress(len(partitions), "tokenise", job.progress)
    if bar is not None:
        bar.update(skipped_parts)
    host = socket.gethostname() if job.remote else None
    jobs = [TokenizeJob(job.src, p, work, host, remote_work, job.tok.key) for p in todo]
    for _, (_docs, toks) in pool.map(tokenize_partition, jobs):
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"{toks:,} tokens", refresh=False)
    if bar is not None:
        bar.close()
    if job.remote:  # parts a task on another machine left in OUT/_work: fetched once, to this machine's disk
        here = set(work.list_names())
        for p in partitions:
            if _part_name(p.index) not in here:
                pafs.copy_files(remote_work.join(_part_name(p.index)), work.join(_part_name(p.index)),
                                source_filesystem=job.loc.fs, destination_filesystem=work.fs)
    return skipped_parts


def _plan(job: _Job, partitions: list[Partition]) -> tuple[list[dict], np.ndarray, np.ndarray, int]:
    """Shuffle the documents, split validation from train, cut the shards: ``(shard plans, document lengths,
    each part's last document index + 1, the validation budget)``."""
    part_files = [_PartFile(job.work, _part_name(p.index)) for p in partitions]
    lengths = np.concatenate([pf.doc_lengths() for pf in part_files]).astype(np.int64)
    part_doc_ends = np.cumsum([pf.num_docs for pf in part_files], dtype=np.int64)
    del part_files
    if len(lengths) == 0:
        raise job.discard(f"source {json.dumps(job.src.describe())} is an empty corpus (no non-empty documents)")
    total_tokens = int(lengths.sum())
    budget = min(DEFAULT_VAL_TOKENS, total_tokens // 10) if job.val_tokens is None else job.val_tokens
    try:
        val_ids, train_ids = split_documents(lengths, job.seed, budget)
    except UserError as exc:
        raise job.discard(str(exc)) from None
    if len(train_ids) == 0:
        raise job.discard(f"--val-tokens {budget} takes every document; lower it so a train split remains")
    plans = plan_shards("train", train_ids, lengths, job.shard_tokens) + plan_shards(
        "val", val_ids, lengths, job.shard_tokens
    )
    return plans, lengths, part_doc_ends, budget


def _assemble(job: _Job, plans: list[dict], part_doc_ends: np.ndarray, pool: _Runner) -> tuple[dict[str, dict], int]:
    """Phase 2: write every shard not written yet; ``(manifest entry by shard name, shards already done)``."""
    loc, work = job.loc, job.work
    existing_names = set(loc.list_names())
    entries: dict[str, dict] = {}
    skipped_shards = 0
    shard_jobs = []
    for plan in plans:
        if job.remote:  # a shard uploaded by an interrupted run: its entry was recorded here (never read back)
            recorded = work.read_json(f"shards/{plan['name']}.json")
            if recorded is not None and plan["name"] in existing_names:
                entries[plan["name"]] = recorded
                skipped_shards += 1
                continue
        elif plan["name"] in existing_names:
            data = read_shard(loc, plan["name"])
            if len(data.tokens) == plan["num_tokens"]:
                entries[plan["name"]] = _entry(
                    plan["name"], file_sha256(loc, plan["name"]), len(data.tokens), len(data.doc_starts),
                    data.first_doc_continues,
                )
                skipped_shards += 1
                continue
        shard_jobs.append(ShardJob(work, loc, part_doc_ends=part_doc_ends, **plan))
    bar = _progress(len(plans), "shards", job.progress)
    if bar is not None:
        bar.update(skipped_shards)
    if job.remote:  # in this process: the part files are on this machine's disk, memory-mapped once
        open_parts: dict[int, _PartFile] = {}
        done = ((i, assemble_shard(shard_job, open_parts)) for i, shard_job in enumerate(shard_jobs))
    else:
        done = pool.map(assemble_shard, shard_jobs)
    for _, entry in done:
        entries[entry["name"]] = entry
        if job.remote:
            work.write_json(f"shards/{entry['name']}.json", entry)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return entries, skipped_shards


def _write_manifest(job: _Job, plans: list[dict], entries: dict[str, dict], budget: int) -> dict:
    """The manifest (the folder's identity, the split rule, every shard's entry), written last; then the work
    folder goes."""
    shards = [entries[p["name"]] for p in plans]
    splits = {
        s: {
            "num_tokens": sum(e["num_tokens"] for e in shards if e["split"] == s),
            "num_docs": sum(e["num_docs"] for e in shards if e["split"] == s),
            "num_shards": sum(1 for e in shards if e["split"] == s),
        }
        for s in SPLITS
    }
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        **job.wanted,
        "dtype": "uint16",
        "eot_position": "before every document",
        "shuffle": "documents in source order, permuted by numpy.random.Generator(PCG64(seed)).permutation",
        "val_tokens": budget,
        "val_rule": "longest prefix of the shuffled documents that fits in val_tokens (whole documents)",
        "splits": splits,
        "shards": shards,
    }
    job.loc.write_bytes(MANIFEST, manifest_bytes(manifest))
    _remove_work(job.loc, job.work, job.remote)
    return manifest


def prepare(
    source: str | Source,
    path: str | None = None,
    out: str | os.PathLike = "data/prepared",
    *,
    name: str | None = None,
    text_column: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_tokens: int | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
    tokenizer: str = DEFAULT_TOKENIZER,
) -> dict:
    """Tokenise ``source`` into shards under ``out`` (local folder or pyarrow URI); return a summary.

    ``source``: a kind of :data:`attnlab.data.pipeline.corpora.SOURCE_KINDS` (with ``path``, ``name``,
    ``text_column``) or a :class:`Source`. ``val_tokens=None`` means 100M tokens capped at 10% of the
    corpus; 0 means no validation split. ``workers``: parallel tasks (1 = in this process, no Ray;
    None = every CPU). ``tokenizer``: ``gpt2`` or ``bytes`` (:data:`attnlab.data.tokenizer.TOKENIZERS`).
    Returns ``{"manifest", "tokens", "seconds", "tokens_per_s", "skipped_partitions", "skipped_shards",
    "already_prepared", "summary"}`` (``summary``: the one-line report, printed when ``progress``).

    The steps, each a function of this module: check the arguments (:func:`_job`), refuse a folder prepared
    differently or stop at one already prepared (:func:`_already_prepared`), start the work folder
    (:func:`_start`), tokenise (:func:`_tokenise`), shuffle, split and cut (:func:`_plan`), write the shards
    (:func:`_assemble`) and the manifest (:func:`_write_manifest`).
    """
    t0 = time.perf_counter()
    job = _job(source, path, out, name, text_column, shard_tokens, val_tokens, seed, progress, tokenizer)
    done = _already_prepared(job, t0)
    if done is not None:
        return done
    partitions = job.src.partitions()  # validates columns etc. before anything is written
    if not partitions:
        raise UserError(f"source {job.src.describe()} is an empty corpus (no partitions)")
    workers = resolve_workers(workers)
    _start(job)
    with _Runner(workers) as pool:
        skipped_parts = _tokenise(job, partitions, pool, workers)
        plans, lengths, part_doc_ends, budget = _plan(job, partitions)
        entries, skipped_shards = _assemble(job, plans, part_doc_ends, pool)
    manifest = _write_manifest(job, plans, entries, budget)
    splits = manifest["splits"]
    total_tokens = int(lengths.sum())
    seconds = time.perf_counter() - t0
    result = {
        "manifest": manifest,
        "tokens": total_tokens,
        "seconds": seconds,
        "tokens_per_s": total_tokens / seconds if seconds > 0 else None,
        "skipped_partitions": skipped_parts,
        "skipped_shards": skipped_shards,
        "already_prepared": False,
    }
    result["summary"] = (
        f"prepared {total_tokens:,} tokens ({splits['train']['num_tokens']:,} train in "
        f"{splits['train']['num_shards']} shard(s), {splits['val']['num_tokens']:,} val in "
        f"{splits['val']['num_shards']}) from {len(lengths):,} documents into {job.loc.uri} in {seconds:.1f} s: "
        f"{result['tokens_per_s']:,.0f} tokens/s (workers={pool.workers})"
    )
    if progress:
        print(result["summary"], flush=True)
    return result
