"""Where a plugin comes from: its bytes, read without running them (docs/plugins.md#where-a-plugin-comes-from).

:func:`read_source` reads a plugin, a path to a ``.py`` file or an importable module name, into a
:class:`PluginSource` (origin, kind, entry, {relative path: bytes}, sha256); nothing is executed here (running those
bytes is :func:`attnlab.attention.plugin.load_source`'s). :class:`LoadedPlugin` is a source that ran, with its
variants; :class:`PluginError` is every plugin problem in one line. All are re-exported by
:mod:`attnlab.attention.plugin`, the public API. No torch, no Ray, no model code.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import keyword
import re
from dataclasses import dataclass
from pathlib import Path

from attnlab.errors import UserError

# A module plugin is a small package: more files than this is almost surely the wrong name (e.g. "torch").
MAX_FILES = 200
MAX_BYTES = 8 * 1024**2


class PluginError(UserError):
    """A plugin that cannot be used, in one line: what is wrong, where (file:line when known), how to fix it."""


@dataclass(frozen=True)
class PluginSource:
    """The exact source of a plugin: ``origin`` (the path or module name as given), ``kind`` (``file`` or
    ``module``), ``entry`` (the file's name, or the dotted module name), ``files`` ({relative path: bytes}) and
    ``sha256`` (over every relative path and its bytes: editing, adding or renaming a file changes it).

    :func:`attnlab.attention.plugin.load_source` runs it from ``files`` alone, so it can be shipped to a process that
    cannot read the user's files (pickle it, or :meth:`to_dict` for JSON)."""

    origin: str
    kind: str
    entry: str
    files: dict
    sha256: str

    @staticmethod
    def of(origin: str, kind: str, entry: str, files: dict) -> "PluginSource":
        files = {str(k): bytes(v) for k, v in sorted(files.items())}
        return PluginSource(origin, kind, entry, files, _hash_files(files))

    def to_dict(self) -> dict:
        """JSON-friendly: every file as UTF-8 text."""
        return {"origin": self.origin, "kind": self.kind, "entry": self.entry, "sha256": self.sha256,
                "files": {k: v.decode("utf-8") for k, v in self.files.items()}}

    @staticmethod
    def from_dict(data: dict) -> "PluginSource":
        files = {k: v.encode("utf-8") if isinstance(v, str) else bytes(v) for k, v in data["files"].items()}
        source = PluginSource.of(data["origin"], data["kind"], data["entry"], files)
        if data.get("sha256") not in (None, source.sha256):
            raise PluginError(f"plugin {data['origin']}: its files do not match sha256 {data['sha256'][:12]}")
        return source

    @property
    def short_hash(self) -> str:
        return self.sha256[:12]


def _hash_files(files: dict) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        data = files[path]
        digest.update(path.encode("utf-8") + b"\0" + len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


@dataclass(frozen=True)
class LoadedPlugin:
    """A plugin that ran: its :class:`PluginSource` and its variants as registered specs."""

    source: PluginSource
    specs: tuple

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs)


def parse_ref(ref: str) -> tuple[str, str | None]:
    """``FILE_OR_MODULE[:NAME]`` -> ``(target, name or None)``."""
    if not isinstance(ref, str) or not ref.strip():
        raise PluginError(f"plugin {ref!r} is not allowed: give a path to a .py file or an importable module name, "
                          "optionally with :NAME")
    target, sep, name = ref.strip().rpartition(":")
    if sep and name and target and re.match(r"^[A-Za-z_][A-Za-z0-9_.-]*$", name) and len(target) > 1:
        return target, name
    return ref.strip(), None


def _is_file_ref(target: str) -> bool:
    """A path (ends in .py or names a folder) rather than a dotted module name (looked up on sys.path)."""
    return target.endswith(".py") or "/" in target or "\\" in target


def read_source(ref: str) -> PluginSource:
    """Read a plugin's bytes: a path to a ``.py`` file, or an importable module name (a single module, or the
    top-level package it belongs to, every ``.py`` file of it). ``ref`` may end in ``:NAME`` (ignored here).
    Nothing is executed (a dotted name's parent packages are not imported)."""
    target, _ = parse_ref(ref)
    if _is_file_ref(target):
        path = Path(target)
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise PluginError(f"plugin file {target} {what}: give a path to a .py file or an importable module name")
        return PluginSource.of(target, "file", path.name, {path.name: path.read_bytes()})
    parts = target.split(".")
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise PluginError(f"plugin {target!r} is neither a file nor a module name: give a path to a .py file or "
                          "an importable module name (e.g. mypackage.attention)")
    try:  # sys.path only: not a package this process already serves from a plugin's bytes
        top = importlib.machinery.PathFinder.find_spec(parts[0])
    except (ImportError, ValueError) as exc:
        top, cause = None, exc
    else:
        cause = None
    if top is None or (top.origin in (None, "built-in", "frozen") and not top.submodule_search_locations):
        why = f": {cause}" if cause else f" (no module named {parts[0]!r} on sys.path)"
        raise PluginError(f"plugin module {target!r} cannot be imported{why}: give a path to a .py file or an "
                          "importable module name")
    files: dict[str, bytes] = {}
    if top.submodule_search_locations:
        for location in top.submodule_search_locations:
            root = Path(location)
            for path in sorted(root.rglob("*.py")):
                rel = path.relative_to(root)
                if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                    continue
                files[str(Path(parts[0], rel).as_posix())] = path.read_bytes()
                _check_size(target, files)
    else:
        files[f"{parts[0]}.py"] = Path(top.origin).read_bytes()
    module_file = "/".join(parts) + ".py"
    package_file = "/".join(parts) + "/__init__.py"
    if len(parts) > 1 and module_file not in files and package_file not in files:
        raise PluginError(f"plugin module {target!r} cannot be imported (no module named {target!r} in "
                          f"{parts[0]!r}): give a path to a .py file or an importable module name")
    return PluginSource.of(target, "module", target, files)


def _check_size(target: str, files: dict) -> None:
    if len(files) > MAX_FILES or sum(map(len, files.values())) > MAX_BYTES:
        raise PluginError(f"plugin module {target!r} belongs to a package of more than {MAX_FILES} files or "
                          f"{MAX_BYTES // 1024**2} MiB: a plugin is one file or a small package")
