"""The results store: concurrent writers in real processes, replace-on-retry, schema refusal, reads, schema 6's
train_key (and its old name config_hash), stores of the first layout (schema 1-5)."""

from __future__ import annotations

import glob
import math
import multiprocessing
import os

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from attnlab.errors import UserError
from attnlab.results import SCHEMA_VERSION, ResultsStore, key_stem
from attnlab.results.schema import ARROW_SCHEMA, SCHEMA_VERSION_METADATA_KEY


def written_files(root) -> list[str]:
    """Every file below ``root`` (relative paths, sorted)."""
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(str(root), "**", "*"), recursive=True)
                  if os.path.isfile(p))


def make_row(**overrides) -> dict:
    row = dict(
        study="s1", trial="t0", attention="lssa", scale="logd_logn", p_train=None, p_eval=None,
        rope_scaling="ntk", step=100, tokens=6400, eval_len=64, train_len=64, window_mode="nonoverlap",
        metric="val_loss", value=3.5, seed=0, config_hash="cfg-t0", git_sha="abc1234",
    )
    row.update(overrides)
    return row


def _writer(root: str, worker: int, barrier) -> None:
    """One writer process: its own 10 keys, a retry of its first key, and the key every writer shares."""
    store = ResultsStore(root)
    barrier.wait()
    for step in range(10):
        rows = [make_row(trial=f"w{worker}", step=step, eval_len=64 * 2**i, value=worker + step / 10 + i / 100,
                         config_hash=f"cfg-w{worker}") for i in range(5)]
        store.write(rows, key=(f"w{worker}", step, "eval"))
        if step == 0:
            store.write(rows, key=(f"w{worker}", step, "eval"))  # a retried write
    shared = [make_row(trial="shared", step=0, eval_len=64 * 2**i, value=float(i)) for i in range(5)]
    store.write(shared, key=("shared", 0, "eval"))


def test_four_processes_write_concurrently_nothing_lost_nothing_duplicated(tmp_path):
    root = str(tmp_path / "store")
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(4)
    processes = [context.Process(target=_writer, args=(root, w, barrier)) for w in range(4)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=120)
    assert [p.exitcode for p in processes] == [0, 0, 0, 0]

    frame = ResultsStore(root).read()
    # 4 writers x 10 steps x 5 lengths, plus the 5 shared rows exactly once.
    assert len(frame) == 4 * 10 * 5 + 5
    identity = list(zip(frame["trial"], frame["step"], frame["eval_len"]))
    assert len(set(identity)) == len(identity)
    expected = {(f"w{w}", s, 64 * 2**i) for w in range(4) for s in range(10) for i in range(5)}
    expected |= {("shared", 0, 64 * 2**i) for i in range(5)}
    assert set(identity) == expected
    w3 = frame[(frame["trial"] == "w3") & (frame["step"] == 7) & (frame["eval_len"] == 256)]
    assert w3["value"].tolist() == [pytest.approx(3 + 0.7 + 0.02)]
    files = [f for f in written_files(root) if f.endswith(".parquet")]
    # one file per key (a retry left no older version), except that the four writers of the shared key may each
    # have written theirs before seeing another's (read once all the same: the newest version); no temporaries
    keys = {(os.path.dirname(f), os.path.basename(f).split(".v")[0]) for f in files}
    assert len(keys) == 41 and 41 <= len(files) <= 44
    assert not [f for f in written_files(root) if os.path.basename(f).startswith(".")]
    # each writer's files are in its run's folder
    assert sum(f.startswith(os.path.join("study=s1", "train_key=cfg-w2", "")) for f in files) == 10


def test_same_key_replaces_and_other_key_adds(tmp_path):
    store = ResultsStore(str(tmp_path))
    first = store.write([make_row(value=1.0), make_row(eval_len=128, value=2.0)], key=("t0", 100, "eval"))
    again = store.write([make_row(value=1.5)], key=("t0", 100, "eval"))
    assert first != again and os.path.dirname(first) == os.path.dirname(again)  # a new version, same run folder
    assert os.path.basename(again).startswith(key_stem(("t0", 100, "eval")) + ".v")
    assert not os.path.exists(first)  # the older version is gone
    assert store.read()["value"].tolist() == [1.5]
    store.write([make_row(step=200, value=0.5)], key=("t0", 200, "eval"))
    assert store.read()["value"].tolist() == [1.5, 0.5]
    # Keys differing only in type or order are different files; the same key is the same name.
    assert key_stem(("t0", 1)) != key_stem(("t0", "1"))
    assert key_stem(("a", "b")) != key_stem(("b", "a"))
    assert key_stem("t0") == key_stem(("t0",))


def test_read_filters_types_and_studies(tmp_path):
    store = ResultsStore(str(tmp_path))
    assert store.read().empty and store.studies() == []
    store.write([make_row(p_eval=None, value=1.0), make_row(p_eval=3, value=2.0),
                 make_row(p_eval="none", eval_len=128, value=3.0, layer=2, n_tokens=4096)], key="a")
    store.write([make_row(study="other", trial="x", value=9.0)], key="a")
    assert store.studies() == ["other", "s1"]
    assert sorted(store.read()["value"]) == [1.0, 2.0, 3.0, 9.0]
    assert store.read(study="other")["value"].tolist() == [9.0]
    assert store.read(p_eval=3)["value"].tolist() == [2.0]
    assert sorted(store.read(p_eval=None)["value"]) == [1.0, 3.0, 9.0]
    assert sorted(store.read(study="s1", p_eval=[None, 3.0])["value"]) == [1.0, 2.0, 3.0]
    assert store.read(eval_len=[128, 4096])["value"].tolist() == [3.0]
    assert store.read(eval_len=[]).empty
    frame = store.read(study="s1")
    assert str(frame["layer"].dtype) == "Int64" and frame["layer"].tolist()[2] == 2
    assert frame["layer"].isna().sum() == 2
    assert (frame["schema_version"] == SCHEMA_VERSION).all()
    assert frame["created_at"].notna().all()
    with pytest.raises(UserError, match="filter 'evallen' is not a column"):
        store.read(evallen=64)
    # file:// URIs read the same store.
    assert len(ResultsStore("file://" + str(tmp_path)).read()) == 4


def test_nan_value_is_recorded_and_schema_version_in_metadata(tmp_path):
    store = ResultsStore(str(tmp_path))
    path = store.write([make_row(value=float("nan")), make_row(eval_len=128, value=float("inf"))], key="diverged")
    values = store.read()["value"].tolist()
    assert math.isnan(values[0]) and values[1] == math.inf
    metadata = pq.read_schema(path).metadata
    assert metadata[SCHEMA_VERSION_METADATA_KEY] == str(SCHEMA_VERSION).encode()


@pytest.mark.parametrize(
    "override, message",
    [
        ({"eval_len": "long"}, "row 1 .*column 'eval_len' must be an integer, got 'long'"),
        ({"value": None}, "row 1 .*column 'value' is required"),
        ({"seed": True}, "column 'seed' must be an integer"),
        ({"step": 1.5}, "column 'step' must be an integer"),
        ({"p_eval": "sharp"}, "column 'p_eval' must be a number"),
        ({"metric": "val-loss"}, "unknown metric 'val-loss'; registered: .*val_loss"),
        ({"rope_scaling": "linear"}, "column 'rope_scaling' is 'linear'; allowed: ntk, none, pi, yarn"),
        ({"evallen": 64}, "unknown column 'evallen'"),
        ({"study": "a/b"}, "column 'study' is 'a/b'"),
        ({"eval_len": 0}, "column 'eval_len' must be > 0"),
        ({"study": "s2"}, "rows of one write must share one study"),
    ],
)
def test_rows_that_break_the_schema_are_refused_and_nothing_is_written(tmp_path, override, message):
    store = ResultsStore(str(tmp_path))
    store.write([make_row(value=1.0)], key="good")
    with pytest.raises(UserError, match=message) as info:
        store.write([make_row(), make_row(**override)], key="bad")
    assert "\n" not in str(info.value)
    assert store.read()["value"].tolist() == [1.0]
    data = [f for f in written_files(tmp_path) if f.endswith(".parquet")]
    assert len(data) == 1 and os.path.basename(data[0]).startswith(key_stem("good") + ".v")


def test_missing_required_column_and_bad_inputs_are_refused(tmp_path):
    store = ResultsStore(str(tmp_path / "store"))
    row = make_row()
    del row["config_hash"]
    with pytest.raises(UserError, match="row 0 .*missing required column 'train_key'"):
        store.write([row], key="k")
    with pytest.raises(UserError, match="no rows to write"):
        store.write([], key="k")
    with pytest.raises(UserError, match="key must be a string or a tuple"):
        store.write([make_row()], key=["k"])
    with pytest.raises(UserError, match="single dict"):
        store.write(make_row(), key="k")
    assert not store.exists()


def test_dataframe_round_trip_keeps_nulls(tmp_path):
    store = ResultsStore(str(tmp_path / "a"))
    store.write([make_row(value=1.0, bucket="early"), make_row(eval_len=128, value=2.0, p_eval=15)], key="k")
    frame = store.read()
    copy = ResultsStore(str(tmp_path / "b"))
    copy.write(frame, key="k")  # a DataFrame from read() is valid input (NaN = null outside value)
    back = copy.read()
    assert back["p_eval"].isna().tolist() == [True, False]
    assert back["bucket"].tolist()[0] == "early" and back["bucket"].isna().tolist() == [False, True]
    assert back["value"].tolist() == [1.0, 2.0]


def test_stored_eval_keys_say_which_cells_are_done(tmp_path):
    store = ResultsStore(str(tmp_path))
    assert store.stored_eval_keys("s", "cfg-t0") == set()  # store not created yet
    rows = [make_row(eval_len=64 * 2**i, value=float(i), eval_key=f"cell{i}") for i in range(3)]
    store.write(rows, key=("t0", 100, "eval"))
    store.write([make_row(config_hash="cfg-other", eval_key="cell9")], key=("t1", 100, "eval"))
    store.write([make_row(eval_key=None, eval_len=4096)], key=("t0", 100, "old"))  # a schema-1 row: no key
    assert store.stored_eval_keys(make_row()["study"], "cfg-t0") == {"cell0", "cell1", "cell2"}
    assert store.stored_eval_keys(make_row()["study"], "cfg-missing") == set()


def test_old_files_read_with_nulls_newer_and_corrupt_files_are_refused(tmp_path):
    store = ResultsStore(str(tmp_path))
    store.write([make_row(value=1.0, preset="tiny")], key="new")
    # A file from an older writer that lacks the optional columns.
    old = make_row(value=2.0, schema_version=5, trial="old")
    fields = [pa.field(name, pa.string(), nullable=False) if name == "config_hash" else ARROW_SCHEMA.field(name)
              for name in old]
    pq.write_table(pa.Table.from_pylist([old], schema=pa.schema(fields)), str(tmp_path / "study=s1" / "old.parquet"))
    frame = store.read()  # sorted by trial: "old" before "t0"
    assert frame["trial"].tolist() == ["old", "t0"] and frame["value"].tolist() == [2.0, 1.0]
    assert frame["preset"].isna().tolist() == [True, False] and frame["preset"].tolist()[1] == "tiny"
    assert frame["plugin_sha256"].isna().all()  # schema 7's column: null in older rows (and for a built-in variant)

    newer = make_row(value=3.0, trial="newer", train_key="cfg-newer")
    del newer["config_hash"]
    newer["schema_version"] = SCHEMA_VERSION + 1
    pq.write_table(pa.Table.from_pylist([newer], schema=pa.schema([ARROW_SCHEMA.field(n) for n in newer])),
                   str(tmp_path / "study=s1" / "newer.parquet"))
    with pytest.raises(UserError, match="newer than this attnlab"):
        store.read()
    os.remove(tmp_path / "study=s1" / "newer.parquet")

    (tmp_path / "study=s1" / "broken.parquet").write_bytes(b"not parquet at all")
    (tmp_path / "study=s1" / ".tmp-inflight.parquet").write_bytes(b"half written")  # ignored
    with pytest.raises(UserError, match="broken.parquet' is not a readable results file"):
        store.read()


def test_threads_writing_one_new_run_at_once(tmp_path):
    """Evaluation writers of one run start together: each lists the run's folder while another creates it."""
    import threading

    store = ResultsStore(str(tmp_path))
    lengths, runs = (64, 128, 256, 512), 60
    barrier, errors = threading.Barrier(len(lengths)), []

    def writer(length: int) -> None:
        for run in range(runs):
            barrier.wait()
            try:
                store.write([make_row(trial=f"r{run}", config_hash=f"cfg-r{run}", eval_len=length)], key=(run, length))
            except Exception as exc:  # noqa: BLE001 (reported below, with the others)
                errors.append(repr(exc))

    threads = [threading.Thread(target=writer, args=(length,)) for length in lengths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    frame = store.read()
    assert sorted(zip(frame["trial"], frame["eval_len"])) == sorted((f"r{r}", n) for r in range(runs) for n in lengths)


class _CountingFiles(pafs.FileSystemHandler):
    """A local filesystem that records every file opened for reading (what a reader really read)."""

    def __init__(self):
        self.fs, self.opened = pafs.LocalFileSystem(), []

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def get_type_name(self):
        return "counting"

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise AssertionError("never")

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        self.opened.append(path)
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        self.opened.append(path)
        return self.fs.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)

    def parquet_opened(self) -> list[str]:
        """The Parquet files opened since the last call, as ``<run folder or _compacted>/<name>``."""
        out = sorted("/".join(p.split("/")[-2:]) for p in self.opened if p.endswith(".parquet"))
        self.opened.clear()
        return out


def test_a_refreshing_reader_reads_only_what_changed(tmp_path):
    """read_since: nothing changed -> no Parquet file opened; one run changed -> only its new file; rows written
    between refreshes appear, a replaced key's rows replace, and a compaction in between neither duplicates nor
    loses a row (each refresh equals a fresh read())."""
    import pandas as pd

    root = str(tmp_path / "store")
    writer = ResultsStore(root)

    def write(run: str, key: str, value: float, lengths=(64, 128)) -> None:
        writer.write([make_row(trial=run, config_hash=run, eval_len=L, value=value + L / 1000, seed=int(run[1:]))
                      for L in lengths], key=(run, key))

    for run in ("r1", "r2", "r3"):
        write(run, "a", 1.0)
        write(run, "b", 2.0, lengths=(256,))
    files = _CountingFiles()
    reader = ResultsStore(root)
    reader.filesystem = pafs.PyFileSystem(files)

    def same_as_read(rows) -> None:
        expected = ResultsStore(root).read(study="s1")
        pd.testing.assert_frame_equal(rows.frame().reset_index(drop=True), expected.reset_index(drop=True))
        assert rows.signature == ResultsStore(root).signature("s1") != ""

    first = reader.read_since("s1")
    assert first.rows == 9 and first.files_read == 6 and len(files.parquet_opened()) == 6
    same_as_read(first)
    again = reader.read_since("s1", first)  # nothing changed: a listing, no file opened
    assert (again.files_read, files.parquet_opened(), again.rows) == (0, [], 9)

    write("r2", "c", 3.0)  # a new key in one run: only its file is read
    grown = reader.read_since("s1", again)
    opened = files.parquet_opened()
    assert len(opened) == 1 and opened[0].startswith("train_key=r2/") and grown.files_read == 1
    assert grown.rows == 11
    same_as_read(grown)
    write("r2", "a", 5.0)  # a key written again: its rows replace the old ones
    replaced = reader.read_since("s1", grown)
    assert [p.split("/")[0] for p in files.parquet_opened()] == ["train_key=r2"]
    frame = replaced.frame()
    assert replaced.rows == 11 and sorted(frame[frame.trial == "r2"].value.round(3)) == [2.256, 3.064, 3.128, 5.064,
                                                                                         5.128]
    same_as_read(replaced)

    writer.compact("s1")  # between refreshes: the merged files are gone, the compacted file holds them once
    compacted = reader.read_since("s1", replaced)
    assert [p.split("/")[0] for p in files.parquet_opened()] == ["_compacted"]
    assert compacted.rows == 11
    same_as_read(compacted)
    write("r3", "b", 7.0, lengths=(256,))  # a compacted key written again: the new file wins, read alone
    after = reader.read_since("s1", compacted)
    assert [p.split("/")[0] for p in files.parquet_opened()] == ["train_key=r3"]
    assert after.rows == 11 and 7.256 in after.frame().value.round(3).tolist()
    assert 2.256 not in after.frame()[after.frame().trial == "r3"].value.round(3).tolist()
    same_as_read(after)
    writer.compact("s1")  # and compacted again
    final = reader.read_since("s1", after)
    assert [p.split("/")[0] for p in files.parquet_opened()] == ["_compacted"] and final.rows == 11
    same_as_read(final)
    assert reader.read_since("s1", final).files_read == 0 and files.parquet_opened() == []
    # another study's rows are no previous read of this one; a study with nothing yet reads as empty
    assert reader.read_since("nothing-yet", final).rows == 0
    with pytest.raises(UserError, match="not a valid study name"):
        reader.read_since("../x")
