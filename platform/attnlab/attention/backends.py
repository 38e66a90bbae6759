"""Which implementation computes an attention call: the :class:`Backend` names and the one rule that picks one.

This module owns the names (``auto``, ``dense``, ``flex``, ``sdpa``): the model config and the training config
validate against :class:`Backend`, so a new backend is added here once. :func:`resolve_backend` turns a
requested backend, a spec and a device into the concrete one (``dense``, ``flex`` or ``sdpa``), once per call:

- ``auto`` on CUDA: the fastest exact path. SDPA (FlashAttention) for softmax with any scale override,
  QK-norm (with or without a learned gain) or row bias, i.e. also ``softmax_logn``, ``softmax_qknorm`` and
  ``softmax_qknorm_logn``; the compiled FlexAttention calls for every other registered variant (LSSA, LSSAR,
  the l1 variants, sharpened softmax, the unnormalised Table 4 rows, the sign-changing ``f`` of Tables 1-3,
  negate, recentre and recentre_l1: see :func:`attnlab.attention.flex.unfusable_reason`) and for every spec
  with ALiBi (``position_bias='alibi'``, softmax included: SDPA would need a materialised ``(H, T, T)`` float
  mask, FlexAttention adds the bias in its score_mod); the dense
  reference, after one warning per variant, for what has no fused form (only overrides: sharpening of rows
  that are not normalised and non-negative, recentre_l1 of them).
- ``auto`` anywhere else (CPU): the dense reference, so CPU results never depend on this choice.
- ``sdpa``: on any device; a spec SDPA cannot compute exactly is refused (ValueError naming why).
- ``flex``: FlexAttention (its unfused form on CPU, for tests); a variant without a fused form falls back to
  the dense reference after one warning, as :func:`attnlab.attention.flex.attend_flex` does.
- ``dense``: the reference.

No tensors are computed here; no Ray, no model code.
"""

from __future__ import annotations

import enum

import torch

from attnlab.attention.flex import unfusable_reason, warn_fallback
from attnlab.attention.sdpa import sdpa_unsupported_reason
from attnlab.attention.spec import AttentionSpec


class Backend(str, enum.Enum):
    """An attention implementation, as ``attend(..., impl=...)`` and the configs name it.

    A ``str`` enum: ``Backend.SDPA == "sdpa"``, and :meth:`parse` accepts the member or its value.
    """

    AUTO = "auto"    # the fastest exact path for the spec and the device (see the module docstring)
    DENSE = "dense"  # the reference: materialises the weights, chunked over query rows
    FLEX = "flex"    # FlexAttention: O(T) memory on CUDA, every variant with a fused form
    SDPA = "sdpa"    # scaled_dot_product_attention: softmax variants only, exactly

    def __str__(self) -> str:
        return self.value

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The allowed values, in order: ``("auto", "dense", "flex", "sdpa")``."""
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


def resolve_backend(spec: AttentionSpec, device: torch.device | str, impl: Backend | str = Backend.AUTO) -> Backend:
    """The concrete backend (``DENSE``, ``FLEX`` or ``SDPA``) that computes ``spec`` on ``device``.

    ``impl="sdpa"`` for a spec SDPA cannot compute exactly raises ValueError; ``flex`` (asked for, or chosen
    by ``auto`` on CUDA) for a variant without a fused form warns once per variant and gives ``DENSE``.
    """
    backend = Backend.parse(impl)
    device = torch.device(device)
    if backend is Backend.DENSE:
        return Backend.DENSE
    if backend is Backend.SDPA:
        reason = sdpa_unsupported_reason(spec)
        if reason is not None:
            raise ValueError(f"impl='sdpa' cannot compute attention {spec.name!r} exactly: {reason}; "
                             "use impl='auto', 'flex' or 'dense'")
        return Backend.SDPA
    if backend is Backend.AUTO:
        if device.type != "cuda":
            return Backend.DENSE
        if sdpa_unsupported_reason(spec) is None:
            return Backend.SDPA
    reason = unfusable_reason(spec)
    if reason is not None:
        warn_fallback(spec, reason, stacklevel=4)
        return Backend.DENSE
    return Backend.FLEX
