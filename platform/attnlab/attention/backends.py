"""Which implementation computes an attention call: the :class:`Backend` names and the one rule that picks one.

Owns the names (``auto``, ``dense``, ``flex``, ``sdpa``, ``triton``: the model and training configs validate
against :class:`Backend`, so a new backend is added here once) and the rule: :func:`choose_backend` turns a
requested backend, a spec, a device and a dtype into the concrete one, with no side effect (the memory plan asks
it about a GPU it is not on); :func:`resolve_backend` is that, warning once per variant when a fallback is taken.
``auto`` is the fastest exact path on CUDA (SDPA, then the Triton kernels, then FlexAttention, then the dense
reference for what has no fused form) and the dense reference anywhere else, so CPU results never depend on it.

It must never compute a tensor or import Triton, Ray or model code: what a backend can compute is asked of its own
module (:func:`attnlab.attention.sdpa.sdpa_unsupported_reason`,
:func:`attnlab.attention.kernels.unsupported_reason`, :func:`attnlab.attention.flex.unfusable_reason`).

Details: docs/attention.md#which-backend-runs.
"""

from __future__ import annotations

import enum

import torch

from attnlab.attention.kernels import device_refusal, unsupported_reason
from attnlab.attention.flex import unfusable_reason, warn_fallback
from attnlab.attention.sdpa import sdpa_unsupported_reason
from attnlab.attention.spec import AttentionSpec


class Backend(str, enum.Enum):
    """An attention implementation, as ``attend(..., impl=...)`` and the configs name it.

    A ``str`` enum: ``Backend.SDPA == "sdpa"``, and :meth:`parse` accepts the member or its value.
    """

    AUTO = "auto"    # the fastest exact path for the spec and the device (docs/attention.md#which-backend-runs)
    DENSE = "dense"  # the reference: materialises the weights, chunked over query rows
    FLEX = "flex"    # FlexAttention: O(T) memory on CUDA, every variant with a fused form
    SDPA = "sdpa"    # scaled_dot_product_attention: softmax variants only, exactly
    TRITON = "triton"  # attnlab's Triton kernels: LSSA, LSSAR, sharpened softmax (attention/kernels/)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The allowed values, in order: ``("auto", "dense", "flex", "sdpa", "triton")``."""
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls, value, field: str = "impl") -> "Backend":
        """The member for ``value`` (a member or its string); ValueError naming ``field`` and the names otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"{field}={value!r} is not allowed: use one of {', '.join(cls.names())}")


def choose_backend(spec: AttentionSpec, device: torch.device | str, impl: Backend | str = Backend.AUTO,
                   dtype: torch.dtype | None = None) -> tuple[Backend, str | None]:
    """``(backend, fallback)``: the concrete backend (``DENSE``, ``FLEX``, ``SDPA`` or ``TRITON``) that computes
    ``spec`` on ``device`` for inputs of ``dtype`` (None: any floating dtype but float64), and, when ``flex`` (asked
    for, or chosen by ``auto`` on CUDA) has no fused form for the variant, why it falls back to ``DENSE``.

    ``impl="sdpa"`` or ``"triton"`` for a spec (or a device) they cannot serve raises ValueError naming why.
    """
    backend = Backend.parse(impl)
    device = torch.device(device)
    if backend is Backend.DENSE:
        return Backend.DENSE, None
    if backend is Backend.SDPA:
        reason = sdpa_unsupported_reason(spec)
        if reason is not None:
            raise ValueError(f"impl='sdpa' cannot compute attention {spec.name!r} exactly: {reason}; "
                             "use impl='auto', 'flex' or 'dense'")
        return Backend.SDPA, None
    if backend is Backend.TRITON:
        reason = unsupported_reason(spec) or device_refusal(device)
        if reason is not None:
            raise ValueError(f"impl='triton' cannot compute attention {spec.name!r}: {reason}; use impl='auto', "
                             "'flex' or 'dense'")
        return Backend.TRITON, None
    if backend is Backend.AUTO:
        if device.type != "cuda":
            return Backend.DENSE, None
        if sdpa_unsupported_reason(spec) is None:
            return Backend.SDPA, None
        if unsupported_reason(spec) is None and dtype != torch.float64:
            return Backend.TRITON, None
    reason = unfusable_reason(spec)
    if reason is not None:
        return Backend.DENSE, reason
    return Backend.FLEX, None


def resolve_backend(spec: AttentionSpec, device: torch.device | str, impl: Backend | str = Backend.AUTO,
                    dtype: torch.dtype | None = None) -> Backend:
    """:func:`choose_backend`'s backend; a fallback from ``flex`` to ``DENSE`` warns once per variant."""
    backend, fallback = choose_backend(spec, device, impl, dtype)
    if fallback is not None:
        warn_fallback(spec, fallback, stacklevel=4)
    return backend
