"""The results store: Parquet files of long-format rows under a store URI, kept per training run so that a run's
reads touch only its own files, and merged per study by compaction.

Layout 2 (``ROOT`` is a local folder or any pyarrow filesystem URI: ``file://``, ``s3://``, ``gs://``)::

    ROOT/study=<study>/train_key=<key>/<stem>.v<version>.parquet   a written file: one write key's rows of one run
    ROOT/study=<study>/train_key=<key>/_compacted.<id>.json       what compaction <id> took from this run's files
    ROOT/study=<study>/_compacted/<id>.parquet                    compaction <id>'s rows (every run of the study)
    ROOT/study=<study>/_layout.json                               present once the study has no layout-1 files
    ROOT/study=<study>/<stem>.parquet                             layout 1 (schema 1-5 writers): read, compacted away

- **Writes.** Every writer writes its own files: no lock, no single writer, no shared index. A write's ``key``
  (e.g. ``("eval", train_key, length, digest)``) names its *stem*; the rows go to their run's folder
  (``train_key=<key>``; a write with rows of several runs writes one file per run), under a new *version*
  (the writer's clock in microseconds, after any version of the key the folder already holds, plus 8 random hex
  digits). The newest version of a ``(stem, run)`` is the one read: writing a key again replaces its rows. The
  writer then deletes the older versions it listed. Local disks: a temporary ``.``-name renamed into place;
  object stores: a direct put (an object appears whole). Readers skip ``.``-names.
- **Per-run reads** (:meth:`ResultsStore.stored_eval_keys`, the skip-done check every trial makes, and any read
  filtered to one ``train_key``) list only the run's folder: its written files, and the index each compaction
  left there (the run's writes it merged: stem, version, evaluation keys, in which compacted file). The cost
  does not grow with the study.
- **Study-wide reads** list the study once (written and layout-1 files), then its ``_compacted/`` folder, and
  read only the columns asked for with the filters pushed into the Parquet scan (row-group statistics prune
  compacted files).
- **Refreshing reads** (:meth:`ResultsStore.read_since`, the study page's refresh) list the study as a study-wide
  read does and hand back a :class:`StudyRows`; given the previous one, they open only the files it did not read
  (a run's new written files, a new compacted file): written files and compacted files are named by their
  version or id and never rewritten, so a name seen before holds the same rows. Nothing changed: no file opened.
- **Which copy is read.** Every write is identified by ``(stem, run)`` and ordered by its version; a compacted
  file keeps each row's write and version (columns ``_write``, ``_version``). For each write the newest version
  is read, from exactly one place (a compacted copy before a written file of the same version, a later
  compacted file before an earlier one); a layout-1 file's rows yield to any layout-2 copy of their write. So
  a write of a compacted key wins at read time and at the next compaction, and a copy left twice by a crash
  or by two compactions at once is read once.
- **Compaction** (:meth:`ResultsStore.compact`, ``attnlab results compact``) merges everything it lists into
  one compacted file, then writes each run's index, then deletes exactly the files it merged, then the older
  indexes and compacted files. It never deletes a file it did not list and read, so writes made meanwhile
  stay; at every point between the steps the store reads every row once (readers list written files before
  compacted files, and re-list when a file they listed has gone). A crash leaves a readable store; running
  compaction again completes it.
- "Done": an evaluation cell is done once rows with its ``eval_key`` are stored (a file appears whole, so
  rows of a cell are all there or none).

Layout-1 stores (one flat folder per study, files named by the key, schema versions 1-5) read as they are; their
``config_hash`` column is read as ``train_key``. Until ``attnlab results compact`` rewrites them, a run's
skip-done check in such a study lists the study folder. Writers of schema 1-5 must not write to a study once
layout 2 has written to it (their files would be seen by study-wide reads but not by per-run reads).

Never deletes or rewrites a file outside those two cases (older versions of the key being written; files a
compaction merged). No Ray here.

:class:`ResultsStore` is put together from one module per job: :mod:`~attnlab.results.layout` (naming and the file
primitives), :mod:`~attnlab.results.writes`, :mod:`~attnlab.results.plan` (listing and which copy is read),
:mod:`~attnlab.results.reads`, :mod:`~attnlab.results.refresh` (``read_since``, ``signature``),
:mod:`~attnlab.results.compaction` and :mod:`~attnlab.results.legacy` (layout 1).
"""

from __future__ import annotations

import os

from attnlab.location import DEFAULT_STORE, Location
from attnlab.results.compaction import Compaction, _Compaction
from attnlab.results.layout import VERSION_COLUMN, WRITE_COLUMN, _Files, key_stem, run_folder
from attnlab.results.legacy import LAYOUT_1_VERSION, _Legacy
from attnlab.results.plan import _Planning
from attnlab.results.reads import _Reads
from attnlab.results.refresh import StudyRows, _Refresh
from attnlab.results.writes import _Writes

__all__ = ["LAYOUT_1_VERSION", "VERSION_COLUMN", "WRITE_COLUMN", "Compaction", "ResultsStore", "StudyRows", "key_stem",
           "run_folder"]


class ResultsStore(_Writes, _Reads, _Refresh, _Compaction, _Planning, _Legacy, _Files):
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
        self.filesystem, self.root = self.location.fs, self.location.path.rstrip("/") or "/"
        self._local = self.location.is_local
        self._marked: set[str] = set()  # studies seen with their layout marker (it is never removed)

    def __repr__(self) -> str:
        return f"ResultsStore({self.uri!r})"

    def __getstate__(self):  # a pickled store (handed to Ray workers) checks the markers afresh
        return {**self.__dict__, "_marked": set()}
