"""Every place a user names: a local path or a URI (``file://``, ``s3://``, ``gs://``), handled by one type.

Owns :class:`Location` (``Location.parse(text)``: a folder on a pyarrow filesystem, picklable for Ray workers,
carrying its canonical ``uri``, which is what gets printed and recorded); the package's one way to write a file
whole (:func:`atomic_write`, :func:`atomic_output`, :meth:`Location.write_bytes`: every writer goes through them,
so a reader never sees half a file); and what a relative location means inside a Ray job's temporary working
directory (:func:`ray_job_working_dir`, :func:`default_storage`, :func:`user_input`).

``pathlib`` must never see a URI (``Path("s3://b/x")`` is the local folder ``s3:/b/x``). No Ray, no torch here.

Details: docs/studies.md#paths-uris-and-whole-file-writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from attnlab.errors import UserError

REMOTE_SCHEMES = ("s3", "gs", "gcs")
STORAGE_ENV = "ATTNLAB_STORAGE"  # the cluster's shared storage prefix (set on every node by cluster/*.yaml)
# The two folders a study writes, by default below $ATTNLAB_STORAGE, else in the current directory: the results
# store (``--store``, rows of every measurement) and the runs folder (``--runs``: each study's Tune state, training
# runs and trial status).
DEFAULT_STORE, DEFAULT_RUNS = "results", "runs"


def _scheme(text: str) -> str | None:
    head, sep, _ = text.partition("://")
    return head.lower() if sep and head.isidentifier() else None


def check_bucket(text: str, field: str = "location") -> None:
    """A ``s3://``, ``gs://`` or ``gcs://`` URI must name a bucket: checked from the text alone (no filesystem is
    built, so nothing is asked of the network), as a study file is validated before anything runs."""
    scheme = _scheme(text)
    if scheme in REMOTE_SCHEMES and not text.partition("://")[2].strip("/"):
        raise UserError(f"{field}={text!r}: name a bucket, e.g. {scheme}://my-bucket/attnlab")


@dataclass(frozen=True)
class Location:
    """A folder (or file) on a pyarrow filesystem: ``fs``, the ``path`` on it, and the canonical ``uri``."""

    fs: pafs.FileSystem
    path: str
    uri: str

    # ------------------------------------------------------------------------------------- building
    @classmethod
    def parse(cls, text: str | os.PathLike | Location, field: str = "location") -> Location:
        """A user's path or URI as a Location (relative paths against the current directory)."""
        if isinstance(text, Location):
            return text
        if not isinstance(text, (str, os.PathLike)) or not os.fspath(text):
            raise UserError(f"{field}={text!r} is not allowed: use a local path, file://, s3:// or gs:// URI")
        text = os.fspath(text)
        scheme = _scheme(text)
        if scheme is None or scheme == "file":
            local = text[len("file://"):] if scheme == "file" else text
            path = os.path.abspath(os.path.expanduser(local))
            return cls(pafs.LocalFileSystem(), path, path)
        if scheme not in REMOTE_SCHEMES:
            raise UserError(f"{field}={text!r}: the scheme {scheme}:// is not supported; use a local path, file://, "
                            "s3:// or gs://")
        check_bucket(text, field)
        try:
            fs, path = pafs.FileSystem.from_uri(text)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
            raise UserError(f"{field}={text!r} cannot be opened: {str(exc).splitlines()[0]}") from None
        path = path.rstrip("/")
        return cls(fs, path, f"{'gs' if scheme == 'gcs' else scheme}://{path}")

    def child(self, *names: str) -> Location:
        """A location below this one (``names`` are path components, ``/``-separated)."""
        parts = [n.strip("/") for n in names if n and n.strip("/")]
        if not parts:
            return self
        sep = os.sep if self.is_local else "/"
        path = sep.join([self.path.rstrip("/"), *parts]) if self.is_local else "/".join([self.path, *parts])
        uri = path if self.is_local else f"{self.scheme}://{path}"
        return Location(self.fs, path, uri)

    @property
    def parent(self) -> Location:
        path = (os.path.dirname if self.is_local else posixpath.dirname)(self.path.rstrip("/"))
        return Location(self.fs, path, path if self.is_local else f"{self.scheme}://{path}")

    # ------------------------------------------------------------------------------------- facts
    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def scheme(self) -> str:
        return "file" if self.is_local else self.uri.split("://", 1)[0]

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def local_path(self) -> str:
        """The local folder; UserError for object storage."""
        if not self.is_local:
            raise UserError(f"{self.uri} is on object storage, not a local folder")
        return self.path

    def __str__(self) -> str:
        return self.uri

    def join(self, *names: str) -> str:
        """The filesystem path of ``names`` below this location (for pyarrow calls)."""
        return self.child(*names).path if names else self.path

    def ray_storage(self) -> tuple[str, pafs.FileSystem | None]:
        """``(storage_path, storage_filesystem)`` for Ray Train/Tune ``RunConfig``."""
        return (self.path, None) if self.is_local else (self.path, self.fs)

    # ------------------------------------------------------------------------------------- reading
    def _info(self, name: str = "") -> pafs.FileInfo:
        return self.fs.get_file_info(self.join(name) if name else self.path)

    def exists(self, name: str = "") -> bool:
        return self._info(name).type != pafs.FileType.NotFound

    def is_dir(self, name: str = "") -> bool:
        return self._info(name).type == pafs.FileType.Directory

    def is_file(self, name: str = "") -> bool:
        return self._info(name).type == pafs.FileType.File

    def list_names(self, sub: str = "", hidden: bool = True) -> list[str]:
        """Names directly below ``sub`` (sorted; none when it does not exist); ``hidden=False`` leaves out
        ``.``-names (temporary files of a write in progress)."""
        base = self.join(sub) if sub else self.path
        if self.fs.get_file_info(base).type != pafs.FileType.Directory:
            return []
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=False))
        return sorted(i.base_name for i in infos if hidden or not i.base_name.startswith("."))

    def read_bytes(self, name: str = "") -> bytes:
        with self.fs.open_input_stream(self.join(name) if name else self.path) as f:
            return f.read()

    def read_text(self, name: str = "") -> str:
        return self.read_bytes(name).decode("utf-8")

    def read_json(self, name: str = "", default=None):
        """The JSON document at ``name``, or ``default`` when it does not exist."""
        try:
            return json.loads(self.read_bytes(name))
        except FileNotFoundError:
            return default
        except OSError:
            if not self.exists(name):
                return default
            raise

    # ------------------------------------------------------------------------------------- writing
    def mkdir(self, sub: str = "") -> None:
        self.fs.create_dir(self.join(sub) if sub else self.path, recursive=True)

    def write_bytes(self, name: str, data: bytes | pa.Buffer) -> None:
        """Write ``name`` whole (:func:`atomic_write`)."""
        atomic_write(self.fs, self.join(name), data)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def write_json(self, name: str, payload) -> None:
        self.write_text(name, json.dumps(payload, indent=1, default=str) + "\n")

    def delete(self, name: str) -> None:
        info = self._info(name)
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self.join(name))
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self.join(name))

    def move(self, name: str, new_name: str) -> None:
        self.fs.move(self.join(name), self.join(new_name))

    def upload(self, local_dir: str, name: str, last: str | None = None) -> None:
        """Copy a local folder's files to ``name`` below this location (replacing what is there). ``last``: a file of
        the folder's top level written after every other one, whole (a checkpoint's ``meta.json``: a reader that
        finds it finds the rest, and a copy cut short leaves a folder without it)."""
        target = self.child(name)
        held = os.path.join(local_dir, last) if last and os.path.isfile(os.path.join(local_dir, last)) else None
        if self.is_local:
            if os.path.exists(target.path):
                shutil.rmtree(target.path)
            shutil.copytree(local_dir, target.path, ignore=lambda folder, names: [last] if held and os.path.samefile(
                folder, local_dir) and last in names else [])
        elif held is None:
            target.mkdir()
            pafs.copy_files(local_dir, target.path, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=self.fs)
        else:
            if target.is_file(last):
                target.delete(last)  # an older copy's: it must not vouch for the files being replaced
            target.mkdir()
            for folder, _, files in os.walk(local_dir):
                for file in files:
                    path = os.path.join(folder, file)
                    if path != held:
                        pafs.copy_files(path, target.join(os.path.relpath(path, local_dir)),
                                        source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.fs)
        if held is not None:
            with open(held, "rb") as f:
                target.write_bytes(last, f.read())

    def download(self, name: str, local_dir: str) -> str:
        """Copy the folder ``name`` below this location into ``local_dir``; returns ``local_dir``."""
        os.makedirs(local_dir, exist_ok=True)
        pafs.copy_files(self.join(name) if name else self.path, local_dir, source_filesystem=self.fs,
                        destination_filesystem=pafs.LocalFileSystem())
        return local_dir


# ------------------------------------------------------------------------------------------ whole-file writes
@contextlib.contextmanager
def atomic_output(fs: pafs.FileSystem, path: str, *, temporary: str | None = None,
                  before_rename: Callable[[], None] | None = None) -> Iterator:
    """A stream whose bytes appear at ``path`` whole, or not at all (every writer of the package writes through
    here or :func:`atomic_write`).

    Local disk: the stream is a temporary file in ``path``'s folder (named ``temporary``, default
    ``.<name>.tmp-<12 hex digits>``: a ``.``-name readers skip), flushed and fsynced when the block ends, then
    renamed into place (``os.replace``: atomic on POSIX); ``before_rename`` runs just before the rename. Object
    storage: a temporary object moved into place (a put cut short by an error would publish what it had).
    An error in the block removes the temporary and propagates."""
    folder, _, name = path.rpartition("/")
    if folder:
        fs.create_dir(folder, recursive=True)
    tmp = f"{folder}/{temporary or f'.{name}.tmp-{uuid.uuid4().hex[:12]}'}"
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            with open(tmp, "wb") as out:
                yield out
                out.flush()
                os.fsync(out.fileno())
            if before_rename is not None:
                before_rename()
            os.replace(tmp, path)
        else:
            with fs.open_output_stream(tmp) as out:
                yield out
            fs.move(tmp, path)
    except BaseException:
        try:
            fs.delete_file(tmp)
        except OSError:
            pass
        raise


def atomic_write(fs: pafs.FileSystem, path: str, data: bytes | pa.Buffer, *, temporary: str | None = None,
                 before_rename: Callable[[], None] | None = None) -> None:
    """Write ``data`` at ``path`` whole: :func:`atomic_output` on a local disk; a direct put on object storage
    (one write of bytes in hand: the object appears once its upload completed)."""
    if isinstance(fs, pafs.LocalFileSystem):
        with atomic_output(fs, path, temporary=temporary, before_rename=before_rename) as out:
            out.write(data)
        return
    folder = path.rpartition("/")[0]
    if folder:
        fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(path) as out:
        out.write(data)


# ------------------------------------------------------------------------------------------ Ray jobs
def ray_job_working_dir() -> str | None:
    """The working-directory copy this process runs in when it is a ``ray job submit --working-dir`` driver."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    if not runtime_env.get("working_dir"):
        return None
    cwd = os.getcwd()
    return cwd if "working_dir_files" in cwd.split(os.sep) else None


def default_storage(what: str) -> str | None:
    """``$ATTNLAB_STORAGE/<what>`` when the cluster sets a shared storage prefix, else None."""
    base = os.environ.get(STORAGE_ENV)
    return f"{base.rstrip('/')}/{what}" if base else None


def user_input(text: str | os.PathLike, *, field: str) -> Location:
    """A location a command reads (a data folder): :meth:`Location.parse`, except inside a Ray job's temporary
    working directory, where a relative path names the same path below ``$ATTNLAB_STORAGE`` (the cluster's shared
    prefix, where ``attnlab data prepare --out $ATTNLAB_STORAGE/data/...`` wrote it), and without
    ``ATTNLAB_STORAGE`` is refused with one line: the job's copy of the folder is not on the other nodes."""
    text = os.fspath(text)
    job_dir = ray_job_working_dir()
    if job_dir and text and _scheme(text) is None and not os.path.isabs(os.path.expanduser(text)):
        base = os.environ.get(STORAGE_ENV)
        if not base:
            raise UserError(f"{field} {text!r} is relative inside a Ray job, whose working directory ({job_dir}) is "
                            "a temporary copy on the head only: give an absolute shared location (s3://..., gs://..., "
                            f"or an NFS path), or set {STORAGE_ENV} on the cluster (a relative {field} then means "
                            f"${STORAGE_ENV}/{text})")
        text = f"{base.rstrip('/')}/{posixpath.normpath(text.replace(os.sep, '/'))}"
    return Location.parse(text, field=field)


def user_location(text: str | None, *, flag: str, default: str) -> Location:
    """The location a command writes to, from a flag: the flag's value, else ``$ATTNLAB_STORAGE/<default>``,
    else the local ``./<default>``. Inside a Ray job's temporary working directory a relative (or default)
    location is refused with one line naming the flag, since what it writes would vanish with the session."""
    job_dir = ray_job_working_dir()
    chosen = text or default_storage(default)
    if chosen is None:
        chosen = default
    relative = _scheme(str(chosen)) is None and not os.path.isabs(os.path.expanduser(str(chosen)))
    if job_dir and relative:
        raise UserError(f"{flag} {chosen!r} is relative inside a Ray job, whose working directory ({job_dir}) is a "
                        f"temporary copy: give {flag} an absolute shared location (s3://..., gs://..., or an NFS "
                        f"path), or set {STORAGE_ENV} on the cluster")
    return Location.parse(chosen, field=flag)


def store_location(text: str | None = None) -> Location:
    """The results store a command writes to: ``--store``, else the default (:func:`user_location`)."""
    return user_location(text, flag="--store", default=DEFAULT_STORE)


def runs_location(text: str | None = None) -> Location:
    """The runs folder a command writes to: ``--runs``, else the default (:func:`user_location`)."""
    return user_location(text, flag="--runs", default=DEFAULT_RUNS)
