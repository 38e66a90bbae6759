"""The results store: Parquet files of long-format rows under a store URI (a local folder or any pyarrow filesystem
URI: ``file://``, ``s3://``, ``gs://``), kept per training run so that a run's reads touch only its own files, and
merged per study by compaction. The layout, and why no crash or concurrent writer loses or doubles a row:
docs/results-store.md.

:class:`ResultsStore` is a facade over parts, each built with the parts it needs: the layout
(:mod:`~attnlab.results.layout`: names, listings and the file primitives), the legacy reader
(:mod:`~attnlab.results.legacy`: layout 1 and its marker), the planner (:mod:`~attnlab.results.plan`) and the
reader (:mod:`~attnlab.results.reads`), the writer (:mod:`~attnlab.results.writes`), the refresher
(:mod:`~attnlab.results.refresh`) and the compactor (:mod:`~attnlab.results.compaction`). Only the layout touches
files. The store deletes or rewrites a file only as a write (older versions of its key) or a compaction (the files
it merged) does. No Ray here.
"""

from __future__ import annotations

import os

from attnlab.location import DEFAULT_STORE, Location
from attnlab.results.compaction import Compaction, Compactor
from attnlab.results.layout import VERSION_COLUMN, WRITE_COLUMN, Layout, key_stem, run_folder
from attnlab.results.legacy import LAYOUT_1_VERSION, LegacyReader
from attnlab.results.plan import Planner
from attnlab.results.reads import Reader
from attnlab.results.refresh import Refresher, StudyRows
from attnlab.results.writes import Writer

__all__ = ["LAYOUT_1_VERSION", "VERSION_COLUMN", "WRITE_COLUMN", "Compaction", "ResultsStore", "StudyRows", "key_stem",
           "run_folder"]


class ResultsStore:
    """A results store at ``uri`` (a local folder by default, or any pyarrow filesystem URI).

    >>> store = ResultsStore("results")
    >>> store.write(rows, key=(trial, step, "eval"))       # replaces on retry
    >>> df = store.read(study="table4", metric="val_loss", eval_len=[1024, 2048])
    >>> store.stored_eval_keys("table4", train_key)        # one run's cells, reading only its files
    >>> store.compact("table4")                             # merge the study's small files
    """

    def __init__(self, uri: str | os.PathLike | Location = DEFAULT_STORE):
        self.location = Location.parse(uri, field="store")
        self.uri = self.location.uri
        self._layout = layout = Layout(self.location)
        legacy = LegacyReader(layout)
        planner = Planner(layout, legacy)
        self._reader = Reader(layout, planner, legacy)
        self._writer = Writer(layout, legacy)
        self._refresher = Refresher(layout, self._reader)
        self._compactor = Compactor(layout, planner, self._reader, legacy)

    def __repr__(self) -> str:
        return f"ResultsStore({self.uri!r})"

    @property
    def filesystem(self):
        """The pyarrow filesystem every part reads and writes through (a test may wrap it)."""
        return self._layout.filesystem

    @filesystem.setter
    def filesystem(self, filesystem) -> None:
        self._layout.filesystem = filesystem

    @property
    def root(self) -> str:
        return self._layout.root

    def write(self, rows, key: str | tuple) -> str:
        """Validate ``rows`` (a list of dicts or a pandas DataFrame) and write them as a new version of ``key``.

        All rows must belong to one study. Writing again with the same ``key`` in the same study replaces its rows
        (a retry never duplicates), compacted or not. Rows of several runs (``train_key``) are written to each
        run's folder, one file per run; writing the key again replaces the rows of the runs it writes. Rows may
        still name ``train_key`` by its old name ``config_hash``. Returns the path of the file written (of the
        first run's, for several).
        """
        return self._writer.write(rows, key)

    def read(self, study: str | list[str] | None = None, columns: list[str] | None = None, **filters):
        """Read rows as a pandas DataFrame. ``filters``: ``column=value`` (equality), ``column=[...]``
        (any of; ``None`` in the list matches null) or ``column=None`` (is null); ``config_hash`` names
        ``train_key``. A filter on one ``train_key`` (with a study) reads only that run's files.

        Rows come back sorted by study, trial, step, metric, eval_len, p_eval, layer, bucket, task, then as
        they were written (by write key, then each write's row order). A store that does not exist yet reads
        as empty.
        """
        return self._reader.read(study, columns, **filters)

    def read_table(self, study: str | list[str] | None = None, columns: list[str] | None = None, **filters):
        """Like :meth:`read`, as an Arrow table (rows in no particular order)."""
        return self._reader.read_table(study, columns, **filters)

    def stored_eval_keys(self, study: str, train_key: str | None = None, *, config_hash: str | None = None) -> set[str]:
        """The evaluation cells (``eval_key``) stored for one training run of a study: lists the run's folder and
        reads its files and indexes only, so it costs the same in a study of 10 runs or 10,000. ``config_hash``
        is the old name of ``train_key``."""
        return self._reader.stored_eval_keys(study, train_key, config_hash=config_hash)

    def signature(self, study: str) -> str:
        """A short hash naming the study's files (listed, none read): it changes whenever rows are written,
        replaced or compacted; "" for a study with no files. :attr:`StudyRows.signature` is the same hash."""
        return self._refresher.signature(study)

    def read_since(self, study: str, previous: StudyRows | None = None) -> StudyRows:
        """Every row of ``study`` (all columns), re-reading only what changed since ``previous`` (an earlier
        :class:`StudyRows` of this store and study; None reads everything).

        It lists the study as :meth:`read` does (written files, then compacted files): with the same files as
        ``previous`` it opens none. Otherwise it opens only the files ``previous`` did not read: a run's new
        written files (the rows of that run's files that are still the newest version of their write are kept,
        those of a replaced or merged write dropped), and a compacted file a compaction made since (read whole,
        once; the files it merged are gone from the listing, so no row is counted twice or lost). Layout-1 files
        (a study not compacted since schema 5) are read again whenever anything changed. The rows are the rows
        :meth:`read` returns, in the same order (:meth:`StudyRows.frame`)."""
        return self._refresher.read_since(study, previous)

    def compact(self, study: str) -> Compaction:
        """Merge a study's files into one compacted file; returns what was done (safe while others write and read,
        and after a crash: :meth:`attnlab.results.compaction.Compactor.compact` lists its steps)."""
        return self._compactor.compact(study)

    def exists(self) -> bool:
        return self._layout.exists()

    def has_study(self, study: str) -> bool:
        """Whether the store has a folder of rows for ``study`` (one listing; no file is read)."""
        return self._layout.has_study(study)

    def studies(self) -> list[str]:
        """Names of the studies in the store (one listing of the store's top folder)."""
        return self._layout.studies()
