"""The store's layout at scale: a run's skip-done check opens only its own files (counted through a pyarrow
filesystem that records every open, and as requests in the moto S3 server's own log), compaction loses and
duplicates nothing when its process is killed at each step (the real crash: ``os._exit`` at the step, no clean-up
runs), readers in another process see every row once while compactions and writes run, a later write of a
compacted key wins, and stores of the first layout (schema 1-5) read, yield to new writes and compact."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import attnlab.faults as faults
from attnlab.errors import UserError
from attnlab.location import Location
from attnlab.results import ResultsStore, key_stem, reports
from attnlab.results.schema import SCHEMA_VERSION_METADATA_KEY, rows_to_table

STUDY = "st"
LENGTHS = (64, 128, 256)


def train_key(run: int) -> str:
    return f"{run:016x}"


def run_write(run: int, length: int, version: float = 0.0, study: str = STUDY) -> tuple[list[dict], tuple]:
    """The rows one evaluation write of ``run`` at ``length`` carries (two cells: p_eval none and 15, a loss and
    two position buckets each), sent the way evaluation sends them today (``config_hash``), and its key."""
    key = train_key(run)
    base = dict(study=study, trial=key, attention=("softmax", "lssar")[run % 2], scale="logd_logn", p_train=None,
                rope_scaling="none", step=10, tokens=640, train_len=64, seed=run // 2, config_hash=key,
                git_sha="abc1234", window_mode="nonoverlap", eval_len=length)
    rows = []
    for p_eval in (None, 15.0):
        cell = f"{key}-{length}-{p_eval}"
        value = run + length / 1000 + (p_eval or 0) / 100 + version
        rows.append({**base, "p_eval": p_eval, "metric": "val_loss", "value": value, "eval_key": cell, "n_tokens": 64})
        for i, bucket in enumerate(("early", "late")):
            rows.append({**base, "p_eval": p_eval, "metric": "loss_bucket", "bucket": bucket, "value": value + i,
                         "eval_key": cell, "n_tokens": 32})
    return rows, ("eval", key, length)


def identity(frame) -> list[tuple]:
    """One tuple per row: which run, cell, metric and bucket, and its value (sorted, so duplicates show)."""
    return sorted(zip(frame["train_key"], frame["eval_key"].fillna(""), frame["metric"], frame["bucket"].fillna(""),
                      frame["value"].round(6)))


def expected_identity(writes: dict[tuple, list[dict]]) -> list[tuple]:
    return sorted((r["config_hash"], r.get("eval_key") or "", r["metric"], r.get("bucket") or "", round(r["value"], 6))
                  for rows in writes.values() for r in rows)


def files_below(root) -> list[str]:
    out = []
    for folder, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(folder, n), root) for n in names]
    return sorted(out)


def write_layout_1(root, rows: list[dict], key, version: int = 5) -> list[dict]:
    """A file as attnlab wrote it before schema 6: ``study=<s>/<stem>.parquet``, the run's key in ``config_hash``,
    schema version ``version`` (1: without the columns versions 2-5 added). Returns the rows as stored."""
    table = rows_to_table(rows)
    names = [n for n in table.column_names if version > 1 or n not in
             ("eval_key", "expression", "task", "stderr", "stopped", "stop_rule")]
    table = table.select(names)
    table = table.rename_columns(["config_hash" if n == "train_key" else n for n in names])
    table = table.set_column(names.index("schema_version"), "schema_version",
                             pa.array([version] * table.num_rows, pa.int64()))
    table = table.replace_schema_metadata({SCHEMA_VERSION_METADATA_KEY: str(version).encode()})
    folder = os.path.join(str(root), f"study={rows[0]['study']}")
    os.makedirs(folder, exist_ok=True)
    pq.write_table(table, os.path.join(folder, key_stem(key) + ".parquet"))
    return [{**r, "eval_key": None} for r in rows] if version == 1 else rows


# ---------------------------------------------------------------------------------------------- a rich store
def build_mixed_store(root: str) -> dict[tuple, list[dict]]:
    """A study in every state compaction meets, reached the real way: layout-1 files (runs 0-1), then written
    files (runs 2-5); a compaction killed after writing its compacted file and the runs' indexes (so every row is
    held twice: compacted and written, or compacted and layout-1); then new writes: a newer version of a compacted
    key (run 2 at 64) and of a layout-1 key (run 0 at 128), and a new run (6). Returns the rows each write key
    should read as."""
    writes: dict[tuple, list[dict]] = {}
    for run in (0, 1):
        for length in LENGTHS:
            rows, key = run_write(run, length)
            writes[key] = write_layout_1(root, rows, key, version=1 if run == 0 else 5)
    store = ResultsStore(root)
    for run in (2, 3, 4, 5):
        for length in LENGTHS:
            rows, key = run_write(run, length)
            store.write(rows, key=key)
            writes[key] = rows
    assert compact_in_child(root, crash_at="5") == CRASH_EXIT_CODE
    for run, length in ((2, 64), (0, 128), (6, 64), (6, 128)):
        rows, key = run_write(run, length, version=0.5)
        store.write(rows, key=key)
        writes[key] = rows
    return writes


CRASH_EXIT_CODE = 71


def _compact_child(root: str, crash_at: str | None) -> None:
    """Compact in this (child) process; ``crash_at``: ``<step>`` ends the process (os._exit: no clean-up runs) just
    before step <step> of the compaction, ``<step>:<n>`` after n items of it (through its seam,
    ``attnlab.faults.compaction_step``)."""
    if crash_at is not None:
        def crash(step: int, items: int | None = None) -> None:
            if crash_at == (str(step) if items is None else f"{step}:{items}"):
                os._exit(CRASH_EXIT_CODE)

        faults.compaction_step = crash
    ResultsStore(root).compact(STUDY)


_CONTEXT = None


def _context():
    """Child processes forked from a server that imported the store once (a fresh process each, started fast)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["pyarrow.parquet", "pyarrow.dataset", "attnlab.results.store"])
    return _CONTEXT


def compact_in_child(root: str, crash_at: str | None = None) -> int:
    """Run a compaction in a process of its own; ``crash_at``: the step it dies at. Returns its exit code."""
    process = _context().Process(target=_compact_child, args=(root, crash_at))
    process.start()
    process.join(timeout=120)
    return process.exitcode


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mixed") / "store")
    writes = build_mixed_store(root)
    return root, writes


def assert_reads_every_row_once(root: str, writes: dict) -> None:
    store = ResultsStore(root)
    frame = store.read(study=STUDY)
    assert identity(frame) == expected_identity(writes)
    for run in range(7):
        cells = {r["eval_key"] for key, rows in writes.items() if key[1] == train_key(run) for r in rows
                 if r.get("eval_key")}
        assert store.stored_eval_keys(STUDY, train_key(run)) == cells
        assert identity(store.read(study=STUDY, train_key=train_key(run))) == \
            expected_identity({k: v for k, v in writes.items() if k[1] == train_key(run)})


def test_the_mixed_store_reads_every_row_once(mixed_store):
    root, writes = mixed_store
    files = files_below(root)
    assert sum(f.startswith(os.path.join("study=st", "_compacted")) for f in files) == 1  # the killed compaction's
    assert len([f for f in files if f.endswith(".json") and "train_key=" in f]) == 6  # its indexes (runs 0-5)
    assert_reads_every_row_once(root, writes)


CRASH_POINTS = ["1", "2", "3", "3:1", "4", "4:1", "5", "5:1", "6", "6:1", "7", "8"]


@pytest.mark.parametrize("crash_at", CRASH_POINTS)
def test_compaction_killed_at_each_step_loses_and_duplicates_nothing(mixed_store, tmp_path, crash_at):
    source, writes = mixed_store
    root = str(tmp_path / "store")
    shutil.copytree(source, root)
    assert compact_in_child(root, crash_at) == CRASH_EXIT_CODE  # it died there
    assert_reads_every_row_once(root, writes)
    # a later write of a key still wins over every copy the dead compaction left
    rows, key = run_write(3, 256, version=0.25)
    ResultsStore(root).write(rows, key=key)
    writes = {**writes, key: rows}
    assert_reads_every_row_once(root, writes)
    # compaction run again completes: one compacted file, an index per run, no written or layout-1 files left
    result = ResultsStore(root).compact(STUDY)
    assert result.rows == len(expected_identity(writes))
    assert_reads_every_row_once(root, writes)
    files = [f for f in files_below(os.path.join(root, "study=st")) if not os.path.basename(f).startswith(".tmp-")]
    assert [f for f in files if f.startswith("_compacted")] == [os.path.relpath(result.compacted,
                                                                                os.path.join(root, "study=st"))]
    assert sorted(f.split(os.sep)[0] for f in files if f.endswith(".json") and f.startswith("train_key=")) == \
        [f"train_key={train_key(run)}" for run in range(7)]
    assert not [f for f in files if f.endswith(".parquet") and not f.startswith("_compacted")]
    assert "_layout.json" in files  # no layout-1 files left: per-run reads need not look for them
    assert ResultsStore(root).compact(STUDY).compacted is None  # nothing left to do


def test_two_compactions_at_once_read_once_and_the_next_one_tidies(mixed_store, tmp_path):
    source, writes = mixed_store
    root = str(tmp_path / "store")
    shutil.copytree(source, root)
    processes = [_context().Process(target=_compact_child, args=(root, None)) for _ in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
    # each either finished or started again on a file the other removed; both exit cleanly
    assert [p.exitcode for p in processes] == [0, 0]
    assert_reads_every_row_once(root, writes)
    ResultsStore(root).compact(STUDY)
    assert len([f for f in files_below(root) if "_compacted" in f and f.endswith(".parquet")]) == 1
    assert_reads_every_row_once(root, writes)


# ---------------------------------------------------------------------------------------------- concurrency
def _reader(root: str, expected: list, seconds: float, queue) -> None:
    store = ResultsStore(root)
    deadline, reads, wrong = time.time() + seconds, 0, []
    while time.time() < deadline:
        got = [row[:4] for row in identity(store.read(study=STUDY))]
        if got != expected:
            wrong.append(len(got))
        reads += 1
    queue.put((reads, wrong))


def test_readers_see_every_row_once_while_compactions_and_writes_run(tmp_path):
    root = str(tmp_path / "store")
    store = ResultsStore(root)
    writes = {}
    for run in range(8):
        for length in LENGTHS:
            rows, key = run_write(run, length)
            store.write(rows, key=key)
            writes[key] = rows
    expected = [row[:4] for row in expected_identity(writes)]  # which rows, not their values (rewrites change them)
    queue = _context().Queue()
    reader = _context().Process(target=_reader, args=(root, expected, 6.0, queue))
    reader.start()
    deadline = time.time() + 5.0
    rounds = 0
    while time.time() < deadline:
        store.compact(STUDY)
        for run in range(0, 8, 3):  # rewrite some keys between compactions: new versions of compacted writes
            rows, key = run_write(run, LENGTHS[rounds % 3], version=rounds / 10)
            store.write(rows, key=key)
            writes[key] = rows
        rounds += 1
    reads, wrong = queue.get(timeout=60)
    reader.join(timeout=60)
    assert rounds >= 2 and reads >= 2
    assert wrong == [], f"{len(wrong)} of {reads} reads saw a wrong number of rows: {wrong[:5]}"
    assert identity(store.read(study=STUDY)) == expected_identity(writes)


# ---------------------------------------------------------------------------------------------- later writes win
def test_a_later_write_of_a_compacted_key_replaces_its_rows_and_new_keys_add(tmp_path):
    store = ResultsStore(tmp_path / "store")
    writes = {}
    for run in range(3):
        for length in LENGTHS:
            rows, key = run_write(run, length)
            store.write(rows, key=key)
            writes[key] = rows
    before = store.read(study=STUDY)
    result = store.compact(STUDY)
    assert result.merged == 9 and result.rows == 9 * 6 and result.removed == 9
    after = store.read(study=STUDY)
    pd_equal(before, after)  # the same rows in the same order, before and after
    rows, key = run_write(1, 128, version=0.5)  # evaluation measured run 1 at 128 again
    store.write(rows, key=key)
    writes[key] = rows
    assert identity(store.read(study=STUDY)) == expected_identity(writes)  # the written file wins at read time
    value = store.read(study=STUDY, train_key=train_key(1), eval_len=128, metric="val_loss", p_eval=None)["value"]
    assert value.tolist() == [pytest.approx(1.628)]
    rows, key = run_write(5, 64)
    store.write(rows, key=key)
    writes[key] = rows
    store.compact(STUDY)  # ... and at the next compaction
    assert identity(store.read(study=STUDY)) == expected_identity(writes)
    assert store.stored_eval_keys(STUDY, train_key(5)) == {r["eval_key"] for r in rows}


def pd_equal(a, b) -> None:
    import pandas.testing

    pandas.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True))


# ------------------------------------------------------------------------------------ counting what a read opens
class _Counting(pafs.FileSystemHandler):
    """The local filesystem, recording every file opened, every listing and every stat (a filesystem pyarrow
    reads through, so nothing of the store is mocked; not being pyarrow's LocalFileSystem, the store treats it as
    object storage: direct puts, no folders)."""

    def __init__(self):
        self.local = pafs.LocalFileSystem()
        self.reset()

    def reset(self):
        self.opened, self.listed, self.stats = [], [], []

    def get_type_name(self):
        return "counting"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        self.stats += list(paths)
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        self.listed.append(selector.base_dir)
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise NotImplementedError

    def delete_file(self, path):
        self.local.delete_file(path)

    def move(self, src, dest):
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        self.local.copy_file(src, dest)

    def open_input_stream(self, path):
        self.opened.append(path)
        return self.local.open_input_stream(path)

    def open_input_file(self, path):
        self.opened.append(path)
        return self.local.open_input_file(path)

    def open_output_stream(self, path, metadata):  # as on an object store, a file needs no folder made first
        self.local.create_dir(path.rsplit("/", 1)[0], recursive=True)
        return self.local.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        raise NotImplementedError


def counting_store(root: str) -> tuple[ResultsStore, _Counting]:
    handler = _Counting()
    os.makedirs(root, exist_ok=True)
    return ResultsStore(Location(pafs.PyFileSystem(handler), root, root)), handler


def test_a_skip_done_check_opens_only_its_runs_files_at_any_study_size(tmp_path):
    root = str(tmp_path / "store")
    store, seen = counting_store(root)
    folder = f"{root}/study={STUDY}/train_key={train_key(1)}/"

    def check(runs: int) -> tuple[int, int]:
        for run in range(runs):
            if not os.path.isdir(f"{root}/study={STUDY}/train_key={train_key(run)}"):
                for length in LENGTHS:
                    store.write(*run_write(run, length)[:1], key=run_write(run, length)[1])
        fresh, seen_ = counting_store(root)  # a trial's own store: no marker known yet
        keys = fresh.stored_eval_keys(STUDY, train_key(1))
        assert keys == {f"{train_key(1)}-{length}-{p}" for length in LENGTHS for p in (None, 15.0)}
        assert seen_.opened and all(path.startswith(folder) for path in seen_.opened), seen_.opened
        assert seen_.listed == [folder.rstrip("/")]
        assert all(path.startswith(folder) or path.endswith("/_layout.json") for path in seen_.stats)
        return len(seen_.opened), len(seen_.listed) + len(seen_.stats)

    small = check(4)
    large = check(40)
    assert small == large and small[0] == len(LENGTHS)  # its three files, whatever the study's size
    store.compact(STUDY)
    fresh, seen_ = counting_store(root)
    assert len(fresh.stored_eval_keys(STUDY, train_key(1))) == 6
    assert len(seen_.opened) == 1 and seen_.opened[0].startswith(folder + "_compacted.")  # its index only
    # a read of one run after compaction: its index, then the compacted file (pruned to the run's row group)
    seen_.reset()
    assert len(fresh.read(study=STUDY, train_key=train_key(1))) == 18
    assert [p.startswith(folder) for p in seen_.opened[:1]] == [True] and len(seen_.opened) == 2


def test_study_wide_reads_prune_columns_and_rows(tmp_path):
    store = ResultsStore(tmp_path / "store")
    for run in range(4):
        for length in LENGTHS:
            store.write(*run_write(run, length)[:1], key=run_write(run, length)[1])
    store.compact(STUDY)
    table = store.read_table(STUDY, columns=["eval_len", "value"], metric="val_loss", p_eval=None)
    assert table.column_names == ["eval_len", "value"] and table.num_rows == 4 * len(LENGTHS)
    frame = store.read(study=STUDY, config_hash=train_key(2), eval_len=[64, 256])  # the old name of train_key
    assert set(frame["train_key"]) == {train_key(2)} and sorted(set(frame["eval_len"])) == [64, 256]
    with pytest.raises(UserError, match="'config_hash' is called 'train_key' since schema version 6"):
        store.read(study=STUDY, columns=["config_hash"])


# ---------------------------------------------------------------------------------------------- layout 1
def test_a_layout_1_store_reads_yields_to_new_writes_and_compacts(tmp_path):
    old_root, new_root = tmp_path / "old", tmp_path / "new"
    new = ResultsStore(new_root)
    writes = {}
    for run in range(4):
        for length in LENGTHS:
            rows, key = run_write(run, length)
            writes[key] = write_layout_1(old_root, rows, key, version=1 if run == 0 else 5)
            new.write(writes[key], key=key)
    marker = {**run_write(0, 64)[0][0], "metric": "complete", "value": 1.0, "eval_key": None}  # a schema-1 marker
    write_layout_1(old_root, [marker], ("__complete__", train_key(0)), version=1)
    old = ResultsStore(old_root)
    frame = old.read(study=STUDY)
    assert "config_hash" not in frame.columns and frame["train_key"].notna().all()
    assert identity(frame[frame["metric"] != "complete"]) == expected_identity(writes)
    # the reports read an old store as they read the same rows written today
    table_text = reports.to_markdown(reports.table(new.read(study=STUDY)))
    assert reports.to_markdown(reports.table(frame)) == table_text
    compare_columns = [c for c in frame.columns if c not in ("created_at", "schema_version", "eval_key")]
    pd_equal(frame[frame["metric"] != "complete"][compare_columns],
             new.read(study=STUDY)[compare_columns])
    # skip-done on a study that still has layout-1 files (no marker): their rows count
    assert old.stored_eval_keys(STUDY, train_key(2)) == new.stored_eval_keys(STUDY, train_key(2))
    assert old.stored_eval_keys(STUDY, train_key(0)) == set()  # schema 1 had no cell keys
    # a new write of a layout-1 key replaces that run's rows
    rows, key = run_write(2, 128, version=0.5)
    old.write(rows, key=key)
    writes[key] = rows
    assert not os.path.exists(old_root / f"study={STUDY}" / "_layout.json")  # layout-1 files are still there
    frame = old.read(study=STUDY)
    assert identity(frame[frame["metric"] != "complete"]) == expected_identity(writes)
    before = old.read(study=STUDY)
    old.compact(STUDY)
    pd_equal(before.drop(columns=["created_at"]), old.read(study=STUDY).drop(columns=["created_at"]))
    assert (old_root / f"study={STUDY}" / "_layout.json").exists()
    assert not [f for f in os.listdir(old_root / f"study={STUDY}") if f.endswith(".parquet")]
    assert old.stored_eval_keys(STUDY, train_key(2)) == {r["eval_key"] for k, v in writes.items()
                                                         if k[1] == train_key(2) for r in v}


def test_cli_compact_and_the_old_column_name(tmp_path, capsys):
    from attnlab.cli import main

    store = ResultsStore(tmp_path / "store")
    for run in range(2):
        for length in LENGTHS:
            store.write(*run_write(run, length)[:1], key=run_write(run, length)[1])
    argv = ["results", "table", "--store", str(tmp_path / "store"), "--study", STUDY]
    assert main(argv) == 0
    before = capsys.readouterr().out
    assert main(["results", "compact", "--store", str(tmp_path / "store")]) == 0
    assert "study st: merged 6 files" in capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == before  # the same table after compaction
    assert main([*argv, "--where", f"config_hash={train_key(1)}"]) == 0
    assert "lssar" in capsys.readouterr().out
    assert main(["results", "compact", "--store", str(tmp_path / "store"), "--study", "nope"]) == 2
    assert "--study 'nope' not in store" in capsys.readouterr().err
    out = tmp_path / "rows.csv"
    assert main(["results", "export", "--store", str(tmp_path / "store"), "--out", str(out)]) == 0
    header = out.read_text().splitlines()[0].split(",")
    assert "train_key" in header and "config_hash" not in header


# ---------------------------------------------------------------------------------------------- a bucket
def moto_requests(bucket_uri: str) -> list[str]:
    """Requests the session's moto server logged for this bucket (its werkzeug log writes a line per request
    before it answers, so a finished call's requests are all there)."""
    from conftest import S3_PORT

    name = bucket_uri[len("s3://"):]
    path = os.path.join(tempfile.gettempdir(), f"attnlab-test-moto-{S3_PORT}.log")
    with open(path, errors="replace") as handle:
        return [line.split('"')[1] for line in handle if f" /{name}" in line and '"' in line]


def test_a_bucket_store_counts_requests_not_files(s3_bucket):
    uri = f"{s3_bucket}/results"
    store = ResultsStore(uri)

    def skip_done_requests() -> int:
        mark = len(moto_requests(s3_bucket))
        keys = ResultsStore(uri).stored_eval_keys(STUDY, train_key(1))  # a trial's store: knows no marker yet
        assert len(keys) == 6
        return len(moto_requests(s3_bucket)) - mark

    for run in range(3):
        for length in LENGTHS:
            store.write(*run_write(run, length)[:1], key=run_write(run, length)[1])
    at_3 = skip_done_requests()
    for run in range(3, 12):
        for length in LENGTHS:
            store.write(*run_write(run, length)[:1], key=run_write(run, length)[1])
    at_12 = skip_done_requests()
    assert at_3 == at_12 <= 2 + 2 * len(LENGTHS)  # its folder's listing, the marker, two reads per file
    before = store.read(study=STUDY)
    result = store.compact(STUDY)
    assert result.merged == 12 * len(LENGTHS)
    pd_equal(before, store.read(study=STUDY))
    after = skip_done_requests()
    assert after <= 4  # the folder's listing, the marker, its index
    rows, key = run_write(7, 256, version=0.5)  # a later write of a compacted key
    store.write(rows, key=key)
    frame = store.read(study=STUDY, train_key=train_key(7), eval_len=256, metric="val_loss", p_eval=None)
    assert frame["value"].tolist() == [pytest.approx(7.756)]
    mark = len(moto_requests(s3_bucket))
    assert len(ResultsStore(uri).read(study=STUDY)) == 12 * 9 * 2
    study_wide = len(moto_requests(s3_bucket)) - mark
    assert study_wide <= 12, moto_requests(s3_bucket)[mark:]  # listings + one compacted and one written file
