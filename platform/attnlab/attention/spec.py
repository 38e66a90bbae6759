"""What an attention variant is: a frozen, validated description (no tensors, no torch here).

An :class:`AttentionSpec` names the choices of the general form (docs/attention.md#the-general-form), ``A = l1norm(f(S) * M)`` with
``S = scale * q @ k^T``: the non-linearity ``phi``, the normalisation, the scale factor, QK-norm, an additive
bias, a post-processing step (Table 1's inverse/re-centred rows), the sharpening power ``p`` (docs/attention.md#sharpening)
and an output LayerNorm (``relu_shen``). The registry of named variants lives in ``variants.py``; the math
lives in ``dense.py``.

A :class:`PluginSpec` is the same kind of description for a variant loaded from a plugin
(``attention/plugin.py``, docs/plugins.md): the variant's own forms stand in for the fields, and it answers the
questions the rest of attnlab asks of a spec (``name``, ``p``, ``sharpened``, ``scale_label``, ``replace``,
``position_bias``, ``learned_qk_gain``) the same way.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

PHIS = ("exp", "identity", "relu", "relu2", "relu6", "gelu", "sigmoid", "softplus", "mish")
NORMS = ("l1", "none", "count")  # count: divide by the number of visible keys N_i (relu_wortsman)
SCALES = ("inv_sqrt_d", "log_n", "logd_logn", "coef*log_n")
BIASES = ("none", "neg_log_t", "neg_log_n")
POSTS = ("none", "negate", "recentre", "recentre_l1")
OUT_NORMS = ("none", "layernorm")
# none: QK-norm L2-normalises q and k (unit vectors, LSSA's form); learned: RMSNorm with a learned per-channel
# gain held by the model (docs/attention.md#modern-softmax-baselines), passed to ``attend(..., qk_gain=...)``.
QK_NORM_GAINS = ("none", "learned")
# An additive position bias on the scores: ALiBi (docs/attention.md#alibi).
POSITION_BIASES = ("none", "alibi")

# Sharpening leaves the first SHARPEN_EXEMPT_ROWS rows without the offset O_i = 1 (docs/attention.md#sharpening).
SHARPEN_EXEMPT_ROWS = 3
# The sharpening a model trains with (``p_train``): the variant's own power (lssar: 15, the others: none), or
# ``off`` / none (no sharpening, as ``get_variant(p=None)`` means), or a number >= 1.
P_TRAIN_DEFAULT = "default"
P_TRAIN_OFF = "off"


@dataclass(frozen=True)
class AttentionSpec:
    """One attention variant. Build it with :func:`attnlab.attention.get_variant`.

    Fields:
        name: registry name (``lssa``, ``softmax``, ...).
        phi: the non-linearity ``f`` applied to the scores.
        norm: ``l1`` (divide each row by its sum of absolute values), ``none``, or ``count`` (divide by N_i).
        scale: ``inv_sqrt_d`` = 1/sqrt(d); ``log_n`` = ln(N_i)/sqrt(d) (Chiang & Cholak);
            ``logd_logn`` = ln(d)*ln(N_i) (LSSA); ``coef*log_n`` = coef*ln(N_i).
        coef: the coefficient of ``coef*log_n`` (None otherwise).
        qk_norm: L2-normalise q and k per token before the scores (no learnable gain unless ``qk_norm_gain``).
        qk_norm_gain: ``none`` (QK-norm is the L2 normalisation) or ``learned``: QK-norm is an RMSNorm with a
            learned per-channel gain, ``sqrt(d) * gain * x / |x|`` for q and k (needs ``qk_norm``); the model
            holds the gains and passes them as ``attend(..., qk_gain=(gain_q, gain_k))``.
        bias: additive score bias: ``neg_log_t`` = -ln(T) (T = sequence length), ``neg_log_n`` = -ln(N_i).
        post: ``negate`` (-A, Table 1 inverse), ``recentre`` (subtract 1/N_i from visible entries of rows >= 3),
            ``recentre_l1`` (that, then l1norm).
        p: sharpening power (docs/attention.md#sharpening); None = no sharpening.
        out_norm: ``layernorm``: parameter-free LayerNorm over the head dimension of each head's output
            ``A @ v`` (relu_shen), applied inside :func:`attnlab.attention.attend` before heads are merged.
        position_bias: ``none`` or ``alibi``: ``- m_h * (i - j)`` added to the scores of head ``h`` before
            ``phi`` (Press et al. 2022; slopes: :func:`attnlab.attention.masks.alibi_slopes`).
        source: where the variant comes from in the paper (documentation only).
    """

    name: str
    phi: str = "exp"
    norm: str = "l1"
    scale: str = "inv_sqrt_d"
    coef: float | None = None
    qk_norm: bool = False
    bias: str = "none"
    post: str = "none"
    p: float | None = None
    out_norm: str = "none"
    source: str = ""
    qk_norm_gain: str = "none"
    position_bias: str = "none"

    def __post_init__(self) -> None:
        _check_choice("phi", self.phi, PHIS)
        _check_choice("norm", self.norm, NORMS)
        _check_choice("scale", self.scale, SCALES)
        _check_choice("bias", self.bias, BIASES)
        _check_choice("post", self.post, POSTS)
        _check_choice("out_norm", self.out_norm, OUT_NORMS)
        _check_choice("qk_norm_gain", self.qk_norm_gain, QK_NORM_GAINS)
        _check_choice("position_bias", self.position_bias, POSITION_BIASES)
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"qk_norm={self.qk_norm!r} is not allowed: use true or false")
        if self.qk_norm_gain != "none" and not self.qk_norm:
            raise ValueError(f"qk_norm_gain={self.qk_norm_gain!r} needs qk_norm=true: use qk_norm_gain='none' "
                             "without QK-norm")
        if self.scale == "coef*log_n":
            if self.coef is None:
                raise ValueError("scale='coef*log_n' needs coef: a positive float, e.g. coef=4.16")
            object.__setattr__(self, "coef", _check_float("coef", self.coef, minimum=0.0, strict=True))
        elif self.coef is not None:
            raise ValueError(f"coef={self.coef!r} is only allowed with scale='coef*log_n' (scale is {self.scale!r})")
        if self.p is not None:
            object.__setattr__(self, "p", _check_float("p", self.p, minimum=1.0))

    @property
    def sharpened(self) -> bool:
        return self.p is not None

    @property
    def scale_label(self) -> str:
        """The scale as one string, as the results store records it (``coef*log_n:4.16`` for a coefficient)."""
        return f"coef*log_n:{self.coef:g}" if self.scale == "coef*log_n" else self.scale

    @property
    def learned_qk_gain(self) -> bool:
        """True when attention needs the model's QK-norm gains (``attend(..., qk_gain=(gain_q, gain_k))``)."""
        return self.qk_norm_gain == "learned"

    def replace(self, **changes) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)


def parse_p_train(value, field: str = "p_train") -> float | str | None:
    """``default`` (the variant's own power) -> ``"default"``; ``off``/``none``/``null``/None -> None (no
    sharpening); a number >= 1 -> float. Raises ValueError naming ``field`` otherwise."""
    allowed = "default (the variant's own power), off (no sharpening) or a number >= 1"
    if value is False:  # YAML 1.1 reads a bare `off` as false
        return None
    if value is None or (isinstance(value, str) and value.strip().lower() in (P_TRAIN_OFF, "none", "null", "~")):
        return None
    if isinstance(value, str) and value.strip().lower() == P_TRAIN_DEFAULT:
        return P_TRAIN_DEFAULT
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{field}={value!r} is not allowed: use {allowed}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 1:
        raise ValueError(f"{field}={value!r} is not allowed: use {allowed}")
    return float(value)


def parse_scale(value) -> tuple[str, float | None]:
    """Parse a scale override into ``(scale, coef)``.

    Accepts ``inv_sqrt_d``, ``log_n``, ``logd_logn``, ``coef*log_n`` (coef given separately), a string
    ``"<float>*log_n"`` or ``"coef*log_n:<float>"``, or a bare number meaning ``<number>*log_n``.
    """
    allowed = "inv_sqrt_d, log_n, logd_logn, or coef*log_n with a float coefficient (e.g. '2.5*log_n')"
    if isinstance(value, bool):
        raise ValueError(f"scale={value!r} is not allowed: use {allowed}")
    if isinstance(value, numbers.Real):
        return "coef*log_n", _check_float("scale coefficient", value, minimum=0.0, strict=True)
    if not isinstance(value, str):
        raise ValueError(f"scale={value!r} is not allowed: use {allowed}")
    text = value.strip()
    if text in SCALES:
        return text, None
    for prefix in ("coef*log_n:", "coef*log_n="):
        if text.startswith(prefix):
            return "coef*log_n", _parse_coef(text[len(prefix):], value, allowed)
    if text.endswith("*log_n"):
        return "coef*log_n", _parse_coef(text[: -len("*log_n")], value, allowed)
    raise ValueError(f"scale={value!r} is not allowed: use {allowed}")


def _parse_coef(text: str, original, allowed: str) -> float:
    try:
        coef = float(text)
    except ValueError:
        raise ValueError(f"scale={original!r}: the coefficient {text!r} is not a number; use {allowed}") from None
    return _check_float("scale coefficient", coef, minimum=0.0, strict=True)


def _check_choice(field: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed: use one of {', '.join(allowed)}")


def _check_float(field: str, value, minimum: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field}={value!r} is not a number: use a float "
                         f"{'>' if strict else '>='} {minimum:g}")
    value = float(value)
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{field}={value!r} is out of range: use a finite number "
                         f"{'>' if strict else '>='} {minimum:g}")
    return value


@dataclass(frozen=True)
class PluginSpec:
    """A variant from a plugin (docs/plugins.md), as the model, evaluation, diagnostics and the memory plan use it.

    Built by :func:`attnlab.attention.get_variant` for a loaded plugin's name (never by hand). Fields:
        name: the variant's name (unique among the built-ins and every loaded plugin).
        variant: the :class:`attnlab.attention.plugin.Variant` (its forms, parameters and declarations).
        p: sharpening power (docs/attention.md#sharpening), only for a variant declared ``normalised``.
        position_bias: ``none`` or ``alibi`` (the context offers ALiBi's bias to the variant's forms).
        origin, sha256: where the plugin came from (a path or a module name) and the hash of its source bytes.
        source: the :class:`attnlab.attention.plugin.PluginSource` it was loaded from (``plugin.py`` makes a spec
            pickle as its source and name, so it is rebuilt in a process that cannot read the plugin's files).
    """

    name: str
    variant: object = dataclasses.field(repr=False)
    p: float | None = None
    position_bias: str = "none"
    origin: str = ""
    sha256: str = ""
    source: object = dataclasses.field(default=None, repr=False, compare=False)

    # What the rest of attnlab reads off a spec: a plugin has no QK-norm gain, no output LayerNorm and no
    # scale field of its own (its scale, if any, is part of its forms).
    qk_norm = False
    learned_qk_gain = False
    out_norm = "none"

    def __post_init__(self) -> None:
        _check_choice("position_bias", self.position_bias, POSITION_BIASES)
        if self.p is not None:
            object.__setattr__(self, "p", _check_float("p", self.p, minimum=1.0))
            if not getattr(self.variant, "normalised", False):
                raise ValueError(f"p={self.p:g} is not allowed for attention {self.name!r}: sharpening needs "
                                 "normalised rows, and the plugin does not declare normalised=True; use p=None")

    @property
    def sharpened(self) -> bool:
        return self.p is not None

    @property
    def scale_label(self) -> str:
        """``plugin``: the variant's scale is part of its own forms (the results store's ``scale`` column)."""
        return "plugin"

    def replace(self, **changes) -> "PluginSpec":
        return dataclasses.replace(self, **changes)

    def unfusable_reason(self) -> str | None:
        """Why this spec runs the variant's reference rather than a fused form (None when it has one)."""
        if self.variant.log_score is None and self.variant.fused is None:
            return "the plugin gives a reference form only"
        if self.p is not None and self.variant.log_score is None:
            # A log_score is sharpened by the two passes of flex.attend_log_scores; a fused function has no
            # second pass to sharpen with.
            return "sharpening is fused for a plugin's log_score form only, and this plugin gives a fused function"
        return None
