"""An attnlab attention plugin inside an exported model folder: its recorded source, run without attnlab.

``attnlab export`` writes a plugin variant's source into ``config.json`` (``plugin``: origin, kind, entry, the files'
text and their sha256, as the training run recorded them). :func:`load_variant` checks the files against the sha256
(over the original bytes, as attnlab hashes them: a changed byte is refused) and runs them, their import of
``attnlab.attention.plugin`` answered with this module; any other import of attnlab fails, as it would where attnlab
is not installed. The contract a plugin is written against (``Variant``, ``Shape``, ``Rows``, ``Context``) and the
reference path that computes its weights are attnlab's own code, copied under ``# Copied from`` lines (checked by
``python -m attnlab.export.copies``); the loading of a recorded source is this folder's. Imports torch only.

Details: attnlab's docs/export.md#plugin-variants.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import importlib.abc
import importlib.util
import re
import sys
import types
from dataclasses import dataclass

import torch
import torch.nn as nn

from .attention_attnlab import (DEFAULT_CHUNK_BYTES, PluginSpec, alibi_bias, attend_chunked, autocast_off,
                                causal_rows, compute_dtype, sharpen, visible_keys)

PLUGIN_API = "attnlab.attention.plugin"  # the one attnlab module a plugin may import


class PluginError(ValueError):
    """A plugin that cannot be used, in one line (attnlab's PluginError is its UserError, which this folder lacks)."""


# --- the contract a plugin is written against (attnlab/attention/plugin.py) ------------------------------------

# Copied from attnlab.attention.plugin.FIELDS
FIELDS = ("name", "source", "reference", "log_score", "fused", "params", "prepare", "normalised", "saved_bytes")

# Copied from attnlab.attention.plugin.PLUGIN_TEMPORARIES
PLUGIN_TEMPORARIES = 8

# Copied from attnlab.attention.plugin._NAME
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


# Copied from attnlab.attention.plugin.Variant
class Variant:
    """One attention variant of a plugin. Keyword fields only (docs/plugins.md#the-contract):

    - ``name`` (str, required): unique among the built-in variants and every loaded plugin.
    - ``source`` (str): where the variant comes from (citation text).
    - ``reference(q, k, rows, ctx) -> weights`` (required): the dense oracle, ``(B, H, R, K)`` weights of the
      query rows ``rows.i`` over keys ``0 .. K - 1`` (K = last row + 1), zero on keys a row cannot see.
    - ``log_score(score, b, h, q_idx, kv_idx, ctx) -> log weight`` or ``fused(q, k, v, ctx) -> out``: at most one
      fused form. ``log_score``: the rows are ``softmax(log_score)`` over the visible keys (FlexAttention).
      ``fused``: any O(T)-memory function returning ``(B, H, T, Dv)``.
    - ``params(shape) -> torch.nn.Module``: the learned parameters one attention layer holds.
    - ``prepare(x, params, shape) -> dict[str, Tensor]``: per-token tensors both forms read (``ctx.state``),
      computed from the layer's input ``x`` ``(B, T, C)``.
    - ``normalised`` (bool): rows are non-negative and sum to 1, so ``p_train``/``p_eval`` sharpening applies.
    - ``saved_bytes(shape, seq_len, batch) -> int``: what one layer's fused form saves for the backward (for the
      GPU memory plan; without it the plan traces the forward on meta tensors).

    An unknown field, a missing name or reference, or two fused forms raise :class:`PluginError` (one line).
    """

    __slots__ = FIELDS

    def __init__(self, **fields):
        unknown = [key for key in fields if key not in FIELDS]
        if unknown:
            raise PluginError(f"Variant field {unknown[0]!r} is unknown: use {', '.join(FIELDS)}")
        name = fields.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(f"Variant name={name!r} is not allowed: give name='...' (letters, digits, _ . -, "
                              "starting with a letter or _)")
        if fields.get("reference") is None:
            raise PluginError(f"variant {name!r} has no reference form: give reference=f(q, k, rows, ctx) -> "
                              "weights (docs/plugins.md#reference)")
        if fields.get("log_score") is not None and fields.get("fused") is not None:
            raise PluginError(f"variant {name!r} gives both log_score and fused: give one fused form")
        for key in ("reference", "log_score", "fused", "params", "prepare", "saved_bytes"):
            value = fields.get(key)
            if value is not None and not callable(value):
                raise PluginError(f"variant {name!r}: {key}={value!r} is not callable: give a function")
        normalised = fields.get("normalised", False)
        if not isinstance(normalised, bool):
            raise PluginError(f"variant {name!r}: normalised={normalised!r} is not allowed: use True or False")
        source = fields.get("source", "")
        if not isinstance(source, str):
            raise PluginError(f"variant {name!r}: source={source!r} is not allowed: give citation text")
        for key in FIELDS:
            object.__setattr__(self, key, fields.get(key))
        object.__setattr__(self, "normalised", normalised)
        object.__setattr__(self, "source", source)

    def __setattr__(self, key, value):
        raise AttributeError(f"Variant {self.name!r} is frozen")

    def __repr__(self) -> str:
        return f"Variant({self.name!r}, fused form: {self.fused_form or 'none'})"

    @property
    def fused_form(self) -> str | None:
        """``log_score``, ``fused`` or None (reference only)."""
        return "log_score" if self.log_score is not None else "fused" if self.fused is not None else None


# Copied from attnlab.attention.plugin.Shape
@dataclass(frozen=True)
class Shape:
    """The sizes of one attention layer: model width ``n_embd``, heads ``n_head``, head dimension ``head_dim``."""

    n_embd: int
    n_head: int
    head_dim: int


# Copied from attnlab.attention.plugin.Rows
@dataclass(frozen=True, eq=False)
class Rows:
    """The query rows of one reference call (``R`` rows over ``K`` keys; every tensor on q's device).

    ``i`` ``(R, 1)``: their absolute indices; ``j`` ``(1, K)``: the key indices ``0 .. K - 1``; ``h`` ``(H, 1, 1)``:
    the head indices; ``n`` ``(R, 1)``: ``N_i = i + 1``, the keys each row sees (compute dtype); ``visible``
    ``(R, K)``: ``j <= i``. ``start`` is ``i[0]``. Index a ``(B, H, T)`` state tensor ``c`` as ``c[..., rows.i]``
    (``(B, H, R, 1)``) and ``c[..., rows.j]`` (``(B, H, 1, K)``).
    """

    i: torch.Tensor
    j: torch.Tensor
    h: torch.Tensor
    n: torch.Tensor
    visible: torch.Tensor
    start: int


# Copied from attnlab.attention.plugin.Context
@dataclass(frozen=True, eq=False)
class Context:
    """What every form of a variant may read besides q, k (and v).

    ``shape`` (:class:`Shape`), ``seq_len`` (T of this forward pass), ``state`` (``prepare``'s tensors, floating
    ones in the compute dtype), ``params`` (the layer's parameter module; None in ``log_score``: a score_mod reads
    tensors only, so pass what it needs through ``prepare``), ``position_bias`` (``none`` or ``alibi``) and
    ``dtype`` (the compute dtype: float32, or float64 for float64 inputs).
    """

    shape: Shape
    seq_len: int
    state: dict
    params: nn.Module | None
    position_bias: str
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def n_head(self) -> int:
        return self.shape.n_head

    def alibi(self, h, i, j):
        """ALiBi's bias ``-m_h (i - j)`` for head ``h``, query ``i`` and key ``j`` (tensors, broadcast), or 0.0 when
        the model does not use ALiBi. Add it to the score before your non-linearity (docs/plugins.md#alibi)."""
        if self.position_bias != "alibi":
            return 0.0
        return alibi_bias(h, i, j, self.shape.n_head, self.dtype)

    def visible_keys(self, i):
        """``N_i = i + 1`` (the keys query row ``i`` sees) in the compute dtype."""
        return visible_keys(i, self.dtype)


# Copied from attnlab.attention.plugin.PluginState
@dataclass(frozen=True, eq=False)
class PluginState:
    """One layer's inputs to a plugin variant besides q, k, v: its :class:`Shape`, its parameter module (or None)
    and the tensors ``prepare`` computed from the layer's input (``prepared``)."""

    shape: Shape
    params: nn.Module | None = None
    prepared: dict = dataclasses.field(default_factory=dict)

    def detach(self) -> "PluginState":
        return PluginState(self.shape, self.params, {k: v.detach() for k, v in self.prepared.items()})


# --- a layer's parameters, prepared tensors and weights (attnlab/attention/plugin.py) --------------------------

# Copied from attnlab.attention.plugin.build_params
def build_params(spec: PluginSpec, shape: Shape) -> nn.Module | None:
    """The variant's parameter module for one layer of ``shape`` (None when it declares none)."""
    variant = spec.variant
    if variant.params is None:
        return None
    module = variant.params(shape)
    if not isinstance(module, nn.Module):
        raise PluginError(f"attention {spec.name!r}: params(shape) returned {type(module).__name__}: return a "
                          "torch.nn.Module holding the layer's parameters")
    return module


# Copied from attnlab.attention.plugin.prepare_state
def prepare_state(spec: PluginSpec, x: torch.Tensor, params: nn.Module | None, shape: Shape) -> PluginState:
    """The layer's :class:`PluginState`: ``prepare(x, params, shape)`` on the layer's input ``x`` ``(B, T, C)``."""
    variant = spec.variant
    if variant.prepare is None:
        return PluginState(shape, params, {})
    prepared = variant.prepare(x, params, shape)
    if not isinstance(prepared, dict) or not all(isinstance(k, str) and k.isidentifier() and
                                                 isinstance(v, torch.Tensor) for k, v in prepared.items()):
        raise PluginError(f"attention {spec.name!r}: prepare(x, params, shape) must return a dict of tensors "
                          "keyed by identifiers, e.g. {'log_forget': tensor}")
    return PluginState(shape, params, dict(prepared))


# Copied from attnlab.attention.plugin._state_for
def _state_for(spec: PluginSpec, q: torch.Tensor, state: PluginState | None) -> PluginState:
    if state is None:
        variant = spec.variant
        if variant.params is not None or variant.prepare is not None:
            raise ValueError(f"attention {spec.name!r} needs its layer's state (parameters and prepared tensors): "
                             "pass state=PluginState(...) as the model layer builds it (prepare_state)")
        H, D = q.shape[-3], q.shape[-1]
        return PluginState(Shape(H * D, H, D))
    if not isinstance(state, PluginState):
        raise ValueError(f"state for attention {spec.name!r} must be a PluginState, got {type(state).__name__}")
    return state


# Copied from attnlab.attention.plugin._context
def _context(spec: PluginSpec, state: PluginState, seq_len: int, dtype: torch.dtype) -> Context:
    prepared = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.prepared.items()}
    return Context(state.shape, seq_len, prepared, state.params, spec.position_bias, dtype)


# Copied from attnlab.attention.plugin.reference_weights
def reference_weights(q: torch.Tensor, k: torch.Tensor, spec: PluginSpec, row_start: int = 0,
                      seq_len: int | None = None, state: PluginState | None = None, p=None) -> torch.Tensor:
    """The variant's weights ``(B, H, R, K)`` of query rows ``row_start ..`` over keys ``0 .. K - 1``, sharpened
    when ``spec.p`` is set (with the power ``p``, a number or a 0-d tensor, when given), in the compute dtype
    (autocast off inside). ``seq_len``: T (default K)."""
    state = _state_for(spec, q, state)
    with autocast_off(q.device):
        dtype = compute_dtype(q.dtype)
        q, k = q.to(dtype), k.to(dtype)
        R, K = q.shape[-2], k.shape[-2]
        ctx = _context(spec, state, k.shape[-2] if seq_len is None else seq_len, dtype)
        i, visible = causal_rows(row_start, R, K, q.device)
        rows = Rows(i=i, j=torch.arange(K, device=q.device).unsqueeze(0),
                    h=torch.arange(q.shape[-3], device=q.device).view(-1, 1, 1), n=visible_keys(i, dtype),
                    visible=visible, start=row_start)
        a = spec.variant.reference(q, k, rows, ctx)
        expected = (*q.shape[:-1], K)
        if not isinstance(a, torch.Tensor) or tuple(a.shape) != expected:
            got = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(f"attention {spec.name!r}: reference returned {got}, expected weights of shape "
                             f"{expected} (batch, heads, rows, keys)")
        a = a.to(dtype)
        if spec.p is not None:
            a = sharpen(a, rows.n, rows.i, spec.p if p is None else p)
        return a


# Copied from attnlab.attention.plugin.attend_reference
def attend_reference(q, k, v, spec: PluginSpec, state: PluginState | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, p=None) -> torch.Tensor:
    """``A @ v`` from the reference weights, query rows in memory-bounded chunks; in v's dtype. The chunks, and how
    they run under ``torch.compile``, are the built-in dense path's (:func:`attnlab.attention.chunked.attend_chunked`),
    one row counted as :data:`PLUGIN_TEMPORARIES` tensors."""
    state = _state_for(spec, q, state)
    return attend_chunked(q, k, v, spec, reference_weights, temporaries=PLUGIN_TEMPORARIES, chunk_bytes=chunk_bytes,
                          state=state, p=p)


# --- running the recorded source (this folder's own, but for the hash) -----------------------------------------

# Copied from attnlab.attention.plugin_source._hash_files
def _hash_files(files: dict) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        data = files[path]
        digest.update(path.encode("utf-8") + b"\0" + len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


_LOADED: dict[tuple[str, str], Variant] = {}  # (sha256, variant name) -> the variant


def load_variant(record: dict, name: str) -> Variant:
    """The variant ``name`` of the plugin ``record`` (config.json's ``plugin``), its files checked against their
    sha256 first; one load per process and source."""
    files = {path: text.encode("utf-8") for path, text in record["files"].items()}
    digest = _hash_files(files)
    if digest != record["sha256"]:
        raise PluginError(f"plugin {record['origin']}: its files in config.json have sha256 {digest[:12]}, not the "
                          f"recorded {record['sha256'][:12]}: the plugin's code was changed after export; export the "
                          "run again")
    if (digest, name) not in _LOADED:
        module = _run(record, files, digest)
        for variant in getattr(module, "VARIANTS", ()):
            if isinstance(variant, Variant):
                _LOADED[(digest, variant.name)] = variant
        if (digest, name) not in _LOADED:
            raise PluginError(f"plugin {record['origin']} defines no variant {name!r}")
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
