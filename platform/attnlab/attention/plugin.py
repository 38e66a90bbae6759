"""Attention variants from outside attnlab: the public plugin API.

A plugin is one Python file, or an importable module, that defines ``VARIANTS = [Variant(...), ...]``; loaded, a
variant is a :class:`attnlab.attention.spec.PluginSpec` that the rest of attnlab accepts like a built-in. Owns
the contract a plugin is written against (:class:`Variant`, :class:`Shape`, :class:`Rows`, :class:`Context`);
where a plugin comes from (:func:`read_source`, re-exported from :mod:`attnlab.attention.plugin_source`;
:func:`load_source`, which runs the bytes, never the files; :func:`load_plugin`, both; one line for a bad plugin:
:class:`PluginError`); and how a loaded variant runs (:func:`attend_plugin`, :func:`reference_weights`,
:func:`build_params`, :func:`prepare_state`).

It must never import Ray or model code, run a plugin's code anywhere but :func:`load_source`, or let a plugin
change a built-in variant (a name means one thing).

Details: docs/plugins.md#the-contract, docs/plugins.md#where-a-plugin-comes-from,
docs/plugins.md#how-a-plugin-variant-travels-through-attnlab.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import functools
import importlib
import importlib.abc
import importlib.util
import linecache
import re
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from attnlab.attention.chunked import DEFAULT_CHUNK_BYTES, attend_chunked, autocast_off, compute_dtype
from attnlab.attention.dense import sharpen
from attnlab.attention.flex import ScoreMod, Sizes, _uncached_if_compiling, attend_log_scores
from attnlab.attention.masks import alibi_bias, causal_block_mask, causal_rows, visible_keys
# Where a plugin comes from (its bytes, read without running them), re-exported: this module is the public API.
from attnlab.attention.plugin_source import (MAX_BYTES, MAX_FILES, LoadedPlugin, PluginError,  # noqa: F401
                                             PluginSource, parse_ref, read_source)
from attnlab.attention.spec import PluginSpec
from attnlab.attention.variants import (builtin_names, get_variant, plugin_spec, register_plugin_spec,
                                        unregister_plugin_spec)

# The fields of a Variant, in the order docs/plugins.md describes them.
FIELDS = ("name", "source", "reference", "log_score", "fused", "params", "prepare", "normalised", "saved_bytes")
# The reference processes query rows in chunks (chunked.attend_chunked) once one chunk's weights and a plugin's
# temporaries, counted as this many (rows x keys) tensors, would exceed DEFAULT_CHUNK_BYTES.
PLUGIN_TEMPORARIES = 8
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


# --- the contract ------------------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class Shape:
    """The sizes of one attention layer: model width ``n_embd``, heads ``n_head``, head dimension ``head_dim``."""

    n_embd: int
    n_head: int
    head_dim: int


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


@dataclass(frozen=True, eq=False)
class PluginState:
    """One layer's inputs to a plugin variant besides q, k, v: its :class:`Shape`, its parameter module (or None)
    and the tensors ``prepare`` computed from the layer's input (``prepared``)."""

    shape: Shape
    params: nn.Module | None = None
    prepared: dict = dataclasses.field(default_factory=dict)

    def detach(self) -> "PluginState":
        return PluginState(self.shape, self.params, {k: v.detach() for k, v in self.prepared.items()})


# --- the layer's parameters and prepared tensors -----------------------------------------------------------------

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


def _context(spec: PluginSpec, state: PluginState, seq_len: int, dtype: torch.dtype) -> Context:
    prepared = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.prepared.items()}
    return Context(state.shape, seq_len, prepared, state.params, spec.position_bias, dtype)


# --- the reference form, chunked over rows -----------------------------------------------------------------------

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


def attend_reference(q, k, v, spec: PluginSpec, state: PluginState | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, p=None) -> torch.Tensor:
    """``A @ v`` from the reference weights, query rows in memory-bounded chunks; in v's dtype. The chunks, and how
    they run under ``torch.compile``, are the built-in dense path's (:func:`attnlab.attention.chunked.attend_chunked`),
    one row counted as :data:`PLUGIN_TEMPORARIES` tensors."""
    state = _state_for(spec, q, state)
    return attend_chunked(q, k, v, spec, reference_weights, temporaries=PLUGIN_TEMPORARIES, chunk_bytes=chunk_bytes,
                          state=state, p=p)


# --- the fused forms ---------------------------------------------------------------------------------------------

def attend_plugin(q, k, v, spec: PluginSpec, backend: str, state: PluginState | None = None,
                  p=None) -> torch.Tensor:
    """Causal attention ``(B, H, T, Dv)`` of a plugin variant in v's dtype: ``backend`` ``dense`` (the reference) or
    ``flex`` (the fused form: FlexAttention over ``log_score``, sharpened by the two passes of
    :func:`attnlab.attention.flex.attend_log_scores`, or the variant's ``fused`` function), as
    :func:`attnlab.attention.resolve_backend` chose it. ``p``: a sharpened spec's power as a number or a 0-d tensor
    instead of ``spec.p`` (the model passes ``p_eval`` this way, so one compiled graph serves every power)."""
    state = _state_for(spec, q, state)
    if backend == "dense":
        return attend_reference(q, k, v, spec, state, p=p)
    variant = spec.variant
    if variant.log_score is not None:
        return _attend_log_score(q, k, v, spec, state, p)
    T = q.shape[-2]
    with autocast_off(q.device):
        ctx = _context(spec, state, T, compute_dtype(q.dtype))
        out = variant.fused(q, k, v, ctx)
    expected = (*q.shape[:-1], v.shape[-1])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"attention {spec.name!r}: fused returned {got}, expected {expected}")
    return out.to(v.dtype)


def _attend_log_score(q, k, v, spec: PluginSpec, state: PluginState, p=None) -> torch.Tensor:
    """FlexAttention over the variant's ``log_score`` (its softmax is the rows), the prepared tensors passed as its
    buffers (they take gradients): one call, or with sharpening the two passes of ``flex.attend_log_scores``."""
    out_dtype = v.dtype
    work = q.dtype if q.dtype == k.dtype == v.dtype else compute_dtype(q.dtype)
    q, k, v = q.to(work), k.to(work), v.to(work)
    T, dtype = q.shape[-2], compute_dtype(q.dtype)
    ctx = _context(spec, state, T, dtype)
    names = tuple(sorted(ctx.state))
    fn = _uncached_if_compiling(_score_fn)(spec.variant, state.shape, T, spec.position_bias, dtype, names)
    score_mod = ScoreMod(fn, tuple(ctx.state[name].contiguous() for name in names))  # (expanded views: copied)
    if _kernel_stand_in:  # a memory measurement: what the CUDA kernel allocates (its block mask is built once)
        return _FlexKernelStandIn.apply(q, k, v, *score_mod.buffers).to(out_dtype)
    power = None if spec.p is None else (spec.p if p is None else p)
    sizes = Sizes(head_dim=q.shape[-1], seq_len=T, n_head=q.shape[-3])
    out = attend_log_scores(q, k, v, score_mod, sizes, causal_block_mask(T, q.device), p=power)
    return out.to(out_dtype)


@functools.lru_cache(maxsize=256)
def _score_fn(variant: Variant, shape: Shape, seq_len: int, position_bias: str, dtype: torch.dtype,
              names: tuple[str, ...]) -> Callable:
    # Cached per (variant, sizes), so a compiled kernel sees the same function on every call.
    log_score = variant.log_score

    def score_mod(score, b, h, q_idx, kv_idx, *buffers):
        ctx = Context(shape, seq_len, dict(zip(names, buffers)), None, position_bias, dtype)
        return log_score(score.to(dtype), b, h, q_idx, kv_idx, ctx)
    return score_mod


# Memory measurement only (the check, the GPU memory plan): see flex_calls_as_kernels.
_kernel_stand_in = False


@contextlib.contextmanager
def flex_calls_as_kernels():
    """Within this context a plugin's FlexAttention call allocates what the CUDA kernel does instead of running: its
    output and log-sum-exp, what it saves (q, k, v, output, LSE, the buffers) and its gradients. For measuring the
    memory of the code around the call (on CPU, FlexAttention's unfused implementation materialises the scores);
    the values are zeros. Never use it for results."""
    global _kernel_stand_in
    previous, _kernel_stand_in = _kernel_stand_in, True
    try:
        yield
    finally:
        _kernel_stand_in = previous


class _FlexKernelStandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, *buffers):
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse = q.new_zeros(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *buffers)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, *buffers = ctx.saved_tensors
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                *(torch.zeros_like(b) if b.requires_grad else None for b in buffers))


_LOADED: dict[str, LoadedPlugin] = {}  # by sha256
# The plugins this process loaded because its user asked (load_plugin, load_source: --plugin, a study's plugins:),
# by sha256. A plugin loaded from what a config or a run recorded (load_recorded) is not pinned: in a Ray worker
# that served another run before, a recorded version replaces another recorded version of the same variant.
_PINNED: set[str] = set()


def load_plugin(ref: str) -> LoadedPlugin:
    """:func:`read_source` then :func:`load_source`: the variants of ``ref`` registered (idempotent for unchanged
    source). With ``:NAME``, the plugin must define a variant of that name."""
    loaded = load_source(read_source(ref))
    _, name = parse_ref(ref)
    if name is not None and name not in loaded.names:
        raise PluginError(f"plugin {loaded.source.origin} has no variant {name!r}: it defines "
                          f"{', '.join(loaded.names)}")
    return loaded


def load_source(source: PluginSource) -> LoadedPlugin:
    """Run a plugin from its bytes (never its files) and register its variants; loading the same source again
    returns the same :class:`LoadedPlugin`. A bad plugin raises :class:`PluginError` in one line: a syntax or
    import error (its file and line), a malformed ``Variant``, no ``VARIANTS``, a name collision (with a built-in,
    or with another plugin this process loaded the same way)."""
    return _load(source, pin=True)


def load_recorded(source: PluginSource, holder: str) -> LoadedPlugin:
    """Load the plugin that ``holder`` (a training config, a run, a checkpoint) records: the bytes its weights were
    trained with. Refused in one line naming both hashes when this process was asked for another version of one of
    its variants (:func:`load_plugin`, ``--plugin``, a study's ``plugins:``); another recorded version (a Ray worker
    that served another run before) is replaced."""
    return _load(source, pin=False, holder=holder)


def loaded_plugins() -> list[LoadedPlugin]:
    """Every plugin loaded in this process, in loading order."""
    return list(_LOADED.values())


def _load(source: PluginSource, pin: bool, holder: str | None = None) -> LoadedPlugin:
    if not isinstance(source, PluginSource):
        raise PluginError(f"load_source needs a PluginSource (read_source(ref)), got {type(source).__name__}")
    if source.sha256 in _LOADED:
        if pin:
            _PINNED.add(source.sha256)
        return _LOADED[source.sha256]
    if source.kind == "module":  # one version of a package per process: a recorded other version gives way
        finder = _FINDERS.get(source.entry.split(".")[0])
        if finder is not None and finder.source.sha256 != source.sha256 and (
                not pin or finder.source.sha256 not in _PINNED):  # a pinned one: _install_finder refuses
            _give_way(source, finder.source, pin, holder, f"package {finder.source.entry.split('.')[0]!r}")
    module = _execute(source)
    declared = getattr(module, "VARIANTS", None)
    where = f"plugin {source.origin}"
    if declared is None:
        raise PluginError(f"{where} defines no VARIANTS: add VARIANTS = [Variant(name=..., reference=...)] "
                          "(docs/plugins.md)")
    if not isinstance(declared, (list, tuple)) or not declared or not all(isinstance(v, Variant) for v in declared):
        raise PluginError(f"{where}: VARIANTS must be a non-empty list of attnlab.attention.plugin.Variant, got "
                          f"{declared!r:.80}")
    specs, builtin = [], set(builtin_names())
    for variant in declared:
        name = variant.name
        if name in builtin:
            raise PluginError(f"{where}: variant {name!r} collides with the built-in variant {name!r} "
                              "(attnlab.attention.variants): rename it")
        if any(spec.name == name for spec in specs):
            raise PluginError(f"{where} defines variant {name!r} twice: give each variant its own name")
        specs.append(PluginSpec(name=name, variant=variant, origin=source.origin, sha256=source.sha256,
                                source=source))
    for spec in specs:
        other = plugin_spec(spec.name)
        if other is not None:
            _give_way(source, other.source, pin, holder, repr(spec.name))
    for spec in specs:
        register_plugin_spec(spec)
    loaded = LoadedPlugin(source, tuple(specs))
    _LOADED[source.sha256] = loaded
    if pin:
        _PINNED.add(source.sha256)
    return loaded


def _give_way(source: PluginSource, other: PluginSource, pin: bool, holder: str | None, what: str) -> None:
    """``other`` already defines ``what`` in this process: unload it when it was loaded from a record (not pinned),
    else refuse in one line (a collision for a plugin the user asked for, a mismatch for a recorded one)."""
    if other.sha256 not in _PINNED:
        unload_plugin(_LOADED.get(other.sha256) or LoadedPlugin(other, ()))
        return
    if pin:
        raise PluginError(f"plugin {source.origin}: variant {what} collides with {what} loaded from {other.origin} "
                          f"(source {other.short_hash}): rename one of them")
    raise PluginError(f"{holder} records plugin {source.origin} (sha256 {source.short_hash}), but this process loaded "
                      f"{what} from {other.origin} (sha256 {other.short_hash}) (--plugin or load_plugin): use a run "
                      "with the plugin it was trained with, or leave --plugin out (a run records its plugin's source)")


def unload_plugin(loaded: LoadedPlugin) -> None:
    """Forget a loaded plugin: its variants, and the modules its bytes became (tests; `attention check` after it
    checked)."""
    for name in loaded.names:
        registered = plugin_spec(name)
        if registered is not None and registered.sha256 == loaded.source.sha256:
            unregister_plugin_spec(name)
    _LOADED.pop(loaded.source.sha256, None)
    _PINNED.discard(loaded.source.sha256)
    source = loaded.source
    if source.kind == "file":
        sys.modules.pop(_file_module_name(source), None)
        return
    top = source.entry.split(".")[0]
    finder = _FINDERS.get(top)
    if finder is not None and finder.source.sha256 == source.sha256:
        del _FINDERS[top]
        sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]
        for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[name]


def spec_from_source(source: PluginSource, name: str, p=None, position_bias: str = "none") -> PluginSpec:
    """The spec ``name`` of a plugin given by its source (loaded first if needed): how a pickled spec comes back."""
    load_recorded(source, holder=f"attention {name!r} (a pickled spec)")
    return get_variant(name, p=p, position_bias=position_bias)


def _reduce_spec(spec: PluginSpec):
    if spec.source is None:
        raise TypeError(f"plugin spec {spec.name!r} has no source to pickle")
    return spec_from_source, (spec.source, spec.name, spec.p, spec.position_bias)


copyreg.pickle(PluginSpec, _reduce_spec)  # a spec ships as its plugin's bytes and its name


# --- running a plugin's bytes ------------------------------------------------------------------------------------

def _filename(source: PluginSource, rel: str) -> str:
    """The file name tracebacks and errors show: the path as given for a file, the relative path for a module."""
    return source.origin if source.kind == "file" else rel


def _file_module_name(source: PluginSource) -> str:
    """The module a file plugin's bytes become: ``attnlab_plugin_<stem>_<sha12>`` (the same in every process)."""
    return f"attnlab_plugin_{re.sub(r'[^A-Za-z0-9_]', '_', Path(source.entry).stem)}_{source.short_hash}"


def _execute(source: PluginSource) -> types.ModuleType:
    filenames = {_filename(source, rel): rel for rel in source.files}
    for name, rel in filenames.items():  # tracebacks show the plugin's lines even where its files are not
        text = source.files[rel].decode("utf-8", errors="replace")
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    try:
        if source.kind == "file":
            module_name = _file_module_name(source)
            module = types.ModuleType(module_name)
            module.__file__ = source.origin
            sys.modules[module_name] = module  # functions defined in it pickle by reference
            try:
                exec(compile(source.files[source.entry], source.origin, "exec"), module.__dict__)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
            return module
        _install_finder(source)
        return importlib.import_module(source.entry)
    except PluginError as exc:
        raise PluginError(_where(exc, filenames, source) + str(exc)) from None
    except SyntaxError as exc:
        raise PluginError(f"plugin {exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - any error of the plugin's own code, reported in one line
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise PluginError(f"{_where(exc, filenames, source)}{type(exc).__name__}: {message}") from None


def _where(exc: BaseException, filenames: dict, source: PluginSource) -> str:
    """``plugin FILE:LINE: `` of the deepest frame of the plugin's own files in the traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename in filenames]
    if not frames:
        return f"plugin {source.origin}: "
    return f"plugin {frames[-1].filename}:{frames[-1].lineno}: "


class _SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a module plugin's package from its bytes (first on ``sys.meta_path``, for its names only)."""

    def __init__(self, source: PluginSource):
        self.source = source
        self.modules: dict[str, tuple[str, bool]] = {}
        for rel in source.files:
            parts = rel[:-3].split("/")
            if parts[-1] == "__init__":
                self.modules[".".join(parts[:-1])] = (rel, True)
            else:
                self.modules[".".join(parts)] = (rel, False)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        rel, package = self.modules[fullname]
        spec = importlib.util.spec_from_loader(fullname, self, origin=rel, is_package=package)
        spec.has_location = False
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        rel, package = self.modules[module.__name__]
        module.__file__ = rel
        exec(compile(self.source.files[rel], rel, "exec"), module.__dict__)


_FINDERS: dict[str, _SourceFinder] = {}


def _install_finder(source: PluginSource) -> None:
    top = source.entry.split(".")[0]
    finder = _FINDERS.get(top)
    if finder is not None and finder.source.sha256 != source.sha256:
        raise PluginError(f"plugin module {source.origin!r}: package {top!r} is already loaded from other source "
                          f"({finder.source.short_hash}); one process runs one version of a package")
    if finder is None:
        finder = _SourceFinder(source)
        _FINDERS[top] = finder
        sys.meta_path.insert(0, finder)


__all__ = ["Context", "FIELDS", "LoadedPlugin", "PluginError", "PluginSource", "PluginState", "Rows", "Shape",
           "Variant", "attend_plugin", "build_params", "flex_calls_as_kernels", "load_plugin", "load_recorded",
           "load_source", "loaded_plugins",
           "parse_ref", "prepare_state", "read_source", "reference_weights", "spec_from_source", "unload_plugin"]
