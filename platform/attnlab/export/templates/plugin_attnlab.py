"""An attnlab attention plugin inside an exported model folder: its source run without attnlab.

``attnlab export`` writes a plugin variant's source into ``config.json`` (``plugin``: origin, kind, entry, the files'
text and their sha256, as the training run recorded them). :func:`load_plugin` checks the files against the sha256
(computed over the original bytes exactly as attnlab computes it: a changed byte is refused) and runs them. This
module stands in for the public plugin API the source imports (``Variant``, ``Shape``, ``Rows``, ``Context`` of
``attnlab.attention.plugin``): the plugin's import of that module is answered with this one while its code runs;
any other import of attnlab fails, as it would where attnlab is not installed. Imports torch only.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib.abc
import importlib.util
import sys
import types
from dataclasses import dataclass, field

import torch

from .attention_attnlab import alibi_bias, causal_rows, sharpen, visible_keys

PLUGIN_API = "attnlab.attention.plugin"  # the one attnlab module a plugin may import
FIELDS = ("name", "source", "reference", "log_score", "fused", "params", "prepare", "normalised", "saved_bytes")


# --- the contract a plugin is written against (attnlab/attention/plugin.py) ----------------------------------------

class Variant:
    """One variant of a plugin: keyword fields only, as attnlab's ``Variant`` (only ``reference``, ``params``,
    ``prepare`` and ``normalised`` are used here: the exported model computes the reference form)."""

    __slots__ = FIELDS

    def __init__(self, **fields):
        unknown = [key for key in fields if key not in FIELDS]
        if unknown:
            raise ValueError(f"Variant field {unknown[0]!r} is unknown: use {', '.join(FIELDS)}")
        if not isinstance(fields.get("name"), str) or fields.get("reference") is None:
            raise ValueError("a Variant needs name='...' and reference=f(q, k, rows, ctx)")
        for key in FIELDS:
            object.__setattr__(self, key, fields.get(key))
        object.__setattr__(self, "normalised", bool(fields.get("normalised", False)))
        object.__setattr__(self, "source", fields.get("source") or "")

    def __setattr__(self, key, value):
        raise AttributeError(f"Variant {self.name!r} is frozen")


@dataclass(frozen=True)
class Shape:
    """The sizes of one attention layer."""

    n_embd: int
    n_head: int
    head_dim: int


@dataclass(frozen=True, eq=False)
class Rows:
    """The query rows of one reference call: ``i`` (R, 1), ``j`` (1, K), ``h`` (H, 1, 1), ``n`` = i + 1, ``visible``
    (R, K) and ``start``."""

    i: torch.Tensor
    j: torch.Tensor
    h: torch.Tensor
    n: torch.Tensor
    visible: torch.Tensor
    start: int


@dataclass(frozen=True, eq=False)
class Context:
    """What a form reads besides q and k: ``shape``, ``seq_len``, ``state`` (prepare's tensors), ``params``,
    ``position_bias`` and ``dtype`` (the compute dtype)."""

    shape: Shape
    seq_len: int
    state: dict
    params: object
    position_bias: str
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def n_head(self) -> int:
        return self.shape.n_head

    def alibi(self, h, i, j):
        if self.position_bias != "alibi":
            return 0.0
        return alibi_bias(h, i, j, self.shape.n_head, self.dtype)

    def visible_keys(self, i):
        return visible_keys(i, self.dtype)


@dataclass(frozen=True, eq=False)
class PluginState:
    """One layer's parameters (or None) and the tensors ``prepare`` computed from its input."""

    shape: Shape
    params: object = None
    prepared: dict = field(default_factory=dict)


# --- one loaded variant -------------------------------------------------------------------------------------------

class LoadedVariant:
    """A plugin variant ready to run: its layer parameters, its prepared tensors and its weights."""

    def __init__(self, variant: Variant):
        self.variant = variant

    @property
    def name(self) -> str:
        return self.variant.name

    def build_params(self, shape: Shape):
        return None if self.variant.params is None else self.variant.params(shape)

    def prepare(self, x: torch.Tensor, params, shape: Shape) -> PluginState:
        if self.variant.prepare is None:
            return PluginState(shape, params, {})
        return PluginState(shape, params, dict(self.variant.prepare(x, params, shape)))

    def weights(self, q, k, spec, row_start: int, seq_len: int, state: PluginState, p=None) -> torch.Tensor:
        """The reference's weights ``(B, H, R, K)`` of query rows ``row_start ..``, sharpened when ``spec.p`` is set."""
        dtype = q.dtype
        prepared = {key: t.to(dtype) if t.is_floating_point() else t for key, t in state.prepared.items()}
        ctx = Context(state.shape, seq_len, prepared, state.params, spec.position_bias, dtype)
        R, K = q.shape[-2], k.shape[-2]
        i, visible = causal_rows(row_start, R, K, q.device)
        rows = Rows(i=i, j=torch.arange(K, device=q.device).unsqueeze(0),
                    h=torch.arange(q.shape[-3], device=q.device).view(-1, 1, 1), n=visible_keys(i, dtype),
                    visible=visible, start=row_start)
        a = self.variant.reference(q, k, rows, ctx).to(dtype)
        if spec.p is not None:
            a = sharpen(a, rows.n, rows.i, spec.p if p is None else p)
        return a


# --- running the recorded source ----------------------------------------------------------------------------------

def source_sha256(files: dict) -> str:
    """attnlab's hash of a plugin's files: sha256 over every (path, length, bytes), paths sorted."""
    digest = hashlib.sha256()
    for path in sorted(files):
        data = files[path]
        digest.update(path.encode("utf-8") + b"\0" + len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


_LOADED: dict[tuple[str, str], LoadedVariant] = {}  # (sha256, variant name) -> the variant


def load_plugin(record: dict, name: str) -> LoadedVariant:
    """The variant ``name`` of the plugin ``record`` (config.json's ``plugin``), its files checked against their
    sha256 first; one load per process and source."""
    files = {path: text.encode("utf-8") for path, text in record["files"].items()}
    digest = source_sha256(files)
    if digest != record["sha256"]:
        raise ValueError(f"plugin {record['origin']}: its files in config.json have sha256 {digest[:12]}, not the "
                         f"recorded {record['sha256'][:12]}: the plugin's code was changed after export; export the "
                         "run again")
    if (digest, name) not in _LOADED:
        module = _run(record, files, digest)
        variants = [v for v in getattr(module, "VARIANTS", ()) if isinstance(v, Variant)]
        for variant in variants:
            _LOADED[(digest, variant.name)] = LoadedVariant(variant)
        if (digest, name) not in _LOADED:
            raise ValueError(f"plugin {record['origin']} defines no variant {name!r}")
    return _LOADED[(digest, name)]


def _api_import(name, globals=None, locals=None, fromlist=(), level=0):
    """``__import__`` for a plugin's code: attnlab's plugin API is this module."""
    if level == 0 and (name == "attnlab" or name.startswith("attnlab.")):
        api = sys.modules[__name__]
        if name == PLUGIN_API and fromlist:
            return api
        if name == "attnlab.attention" and fromlist and set(fromlist) <= {"plugin"}:
            return types.SimpleNamespace(plugin=api)
        if name in ("attnlab", "attnlab.attention", PLUGIN_API) and not fromlist:
            return types.SimpleNamespace(attention=types.SimpleNamespace(plugin=api))
        raise ImportError(f"an exported plugin may import {PLUGIN_API} only, not {name} (attnlab is not needed "
                          "to run an exported model)", name=name)
    return builtins.__import__(name, globals, locals, fromlist, level)


def _namespace(name: str, filename: str) -> dict:
    return {"__name__": name, "__file__": filename, "__builtins__": {**vars(builtins), "__import__": _api_import}}


def _run(record: dict, files: dict, digest: str) -> types.ModuleType:
    """Execute the plugin's bytes: a file plugin as one module; a module plugin's package through a finder."""
    if record["kind"] == "file":
        name = f"exported_plugin_{digest[:12]}"  # not attnlab_*: nothing here is attnlab's
        module = types.ModuleType(name)
        module.__dict__.update(_namespace(name, record["origin"]))
        sys.modules[name] = module  # functions defined in it pickle by reference
        exec(compile(files[record["entry"]], record["origin"], "exec"), module.__dict__)
        return module
    finder = _SourceFinder(files)
    sys.meta_path.insert(0, finder)
    try:
        return __import__(record["entry"], fromlist=["VARIANTS"])
    finally:
        sys.meta_path.remove(finder)


class _SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module plugin's package from its recorded files (its own names only)."""

    def __init__(self, files: dict):
        self.files, self.modules = files, {}
        for rel in files:
            parts = rel[:-3].split("/")
            package = parts[-1] == "__init__"
            self.modules[".".join(parts[:-1] if package else parts)] = (rel, package)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        rel, package = self.modules[fullname]
        return importlib.util.spec_from_loader(fullname, self, origin=rel, is_package=package)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        rel, _ = self.modules[module.__name__]
        module.__dict__.update(_namespace(module.__name__, rel))
        exec(compile(self.files[rel], rel, "exec"), module.__dict__)
