"""Names and small parsers that every layer of attnlab agrees on: each has exactly one definition, here.

Owns the shared names: GPT-2's vocabulary size (:data:`GPT2_VOCAB`), the RoPE scalings (:data:`ROPE_SCALINGS`)
and the version of what each name computes (:data:`ROPE_SEMANTICS`, :func:`rope_identity`: what a scaling
contributes to a train key or an evaluation key), the default evaluation multiples and the rule a study name
follows (:data:`STUDY_NAME`). And the parsers of what users write in several places: a RoPE scaling with its factor
(:func:`parse_rope`; :func:`check_scaling` at evaluation), an optional number (``none`` -> None), lengths (``1k``,
``16k``), a length or a multiple of the training length (``16x``: :func:`parse_at`), a value missing from rows read
back (:func:`is_missing`), and durations as progress lines print them. Each bad value is one ``UserError`` line
naming the field.

A name or parser two modules need is defined here and nowhere else. It must stay pure Python: no torch, no Ray and
no pandas import at module level (the results store and the study spec import it without pulling in the model).

Details: docs/protocol.md#rope-scalings (what each scaling computes), docs/stages.md#identity-and-reuse (a
scaling's version in keys), docs/architecture.md#architecture-which-module-owns-what (layer 0-1).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable
from typing import NamedTuple

from attnlab.errors import UserError

GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary: the model's default, what the tokeniser produces
# The RoPE scalings, at evaluation and in training (model/rope.py, docs/protocol.md#rope-scalings): ntk (NTK-aware
# base beyond the training length), none (the trained base), pi (linear position interpolation), yarn (as its
# reference code and transformers compute it), yarn_paper (the ramp as the paper's equation reads: an ablation),
# dynamic (transformers' dynamic NTK, its factor a parameter).
ROPE_SCALINGS = ("ntk", "none", "pi", "yarn", "yarn_paper", "dynamic")
ROPE_BOTH = ("ntk", "none")  # what ``rope_scaling: both`` / ``--rope both`` means
DEFAULT_MULTIPLES = (1, 2, 4, 8, 16)  # evaluation lengths as multiples of the training length (1x..16x)
# The rule a study name follows: it names folders in the runs folder and the results store.
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$")
STUDY_NAME_RULE = "letters, digits and . _ + - (it names folders), starting with a letter or digit, at most 200"
_NONE_WORDS = ("none", "null", "~", "")


class RopeScaling(NamedTuple):
    """A RoPE scaling (:data:`ROPE_SCALINGS`) and its scale factor: None for the default (in training
    ``seq_len / original_len``; at evaluation the evaluated length over the trained one), else a number >= 1.
    Its text form, :attr:`label`, is ``yarn`` or ``dynamic:2``: how configs, evaluation cells and results rows
    spell it."""

    method: str
    factor: float | None = None

    @property
    def label(self) -> str:
        return self.method if self.factor is None else f"{self.method}:{self.factor:g}"


def parse_rope(value, field: str = "rope_scaling") -> RopeScaling:
    """A :class:`RopeScaling` from ``yarn``, ``dynamic:2``, ``{method: yarn, factor: 16}``, a ``RopeScaling`` or
    None (``none``). UserError naming ``field`` for an unknown method, a factor that is not a number >= 1, or a
    factor on ``none`` (plain RoPE has none)."""
    if isinstance(value, RopeScaling):
        method, factor = value
    elif isinstance(value, dict):
        unknown = sorted(set(value) - {"method", "factor"})
        if unknown or "method" not in value:
            raise UserError(f"{field}={value!r} is not allowed: use a name or {{method: NAME, factor: F}} "
                            f"(keys method and factor)")
        method, factor = value["method"], value.get("factor")
    elif value is None or is_none_word(value):
        method, factor = "none", None
    elif isinstance(value, str):
        method, _, text = value.strip().partition(":")
        factor = text if _ else None
    else:
        raise UserError(f"{field}={value!r} is not allowed: use one of {', '.join(ROPE_SCALINGS)}, NAME:FACTOR or "
                        "{method: NAME, factor: F}")
    method = "none" if method is None or is_none_word(method) else str(method).strip()
    if method not in ROPE_SCALINGS:
        raise UserError(f"{field}={value!r} is not allowed: use one of {', '.join(ROPE_SCALINGS)}")
    if factor is None or (isinstance(factor, str) and is_none_word(factor)):
        return RopeScaling(method, None)
    if method == "none":
        raise UserError(f"{field}={value!r}: none (plain RoPE) takes no factor; give a factor only to "
                        f"{', '.join(m for m in ROPE_SCALINGS if m != 'none')}")
    number = parse_optional_number(factor, f"{field}.factor", minimum=1.0)
    return RopeScaling(method, number)


# The version of what each scaling's name computes (absent: 1). Raise it in the change that alters the
# frequencies a name gives, so train keys and evaluation keys change with it (rope_identity).
# yarn 2: the reference code's pair-index ramp; version 1 was the paper's ramp, now named yarn_paper.
ROPE_SEMANTICS = {"yarn": 2}
# A name whose computation an older name performed: its keys are that name's at version 1 (yarn_paper's runs and
# rows are those attnlab trained and measured as ``yarn`` before version 2).
_OLDER_NAME = {"yarn_paper": "yarn"}


def rope_identity(scaling) -> str:
    """What a scaling contributes to a key: its method (``yarn_paper`` as the ``yarn`` it was), ``@version`` when
    its meaning has changed since keys were first made (:data:`ROPE_SEMANTICS`), ``:factor`` when one is given.
    ``none``, ``ntk``, ``pi`` and ``yarn_paper`` give what they always gave, so those keys stay."""
    rope = parse_rope(scaling)
    name = _OLDER_NAME.get(rope.method, rope.method)
    version = 1 if rope.method in _OLDER_NAME else ROPE_SEMANTICS.get(rope.method, 1)
    text = name if version == 1 else f"{name}@{version}"
    return text if rope.factor is None else f"{text}:{rope.factor:g}"


def recorded_rope_method(fields: dict) -> str:
    """The training-time scaling a recorded config names (a checkpoint's ``gpt_config``, a run's recorded
    ``TrainConfig``): its ``rope_scaling``, except that ``yarn`` in a record written before ``rope_factor`` existed
    (before :data:`ROPE_SEMANTICS` raised yarn to 2) was the paper's ramp: ``yarn_paper``."""
    method = fields.get("rope_scaling") or "none"
    return "yarn_paper" if method == "yarn" and "rope_factor" not in fields else method


def check_scaling(scaling, field: str = "rope_scaling") -> RopeScaling:
    """An evaluation-time scaling (a name, or ``dynamic:F``): UserError for anything else. Only ``dynamic`` takes
    a factor here: the others' is the evaluated length over the trained one."""
    rope = parse_rope(scaling, field)
    if rope.method == "dynamic" and rope.factor is None:
        raise UserError(f"{field}={scaling!r}: dynamic takes its factor at evaluation, e.g. dynamic:2 "
                         "(transformers' rope_type dynamic with factor 2)")
    if rope.factor is not None and rope.method != "dynamic":
        raise UserError(f"{field}={scaling!r}: at evaluation {rope.method}'s factor is the evaluated length over "
                         "the trained one; only dynamic takes one (a fine-tune sets its factor in training)")
    return rope


def check_study_name(value: str, field: str = "name") -> str:
    if not isinstance(value, str) or not STUDY_NAME.match(value):
        raise UserError(f"{field}={value!r} is not allowed: use {STUDY_NAME_RULE}")
    return value


def is_none_word(value) -> bool:
    """True for None and the YAML/CLI spellings of "no value" (``none``, ``null``, ``~``, empty)."""
    return value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS)


def parse_optional_number(value, field: str, minimum: float | None = None) -> float | None:
    """``none``/``null``/``~``/None -> None; a number (or its text) -> float, at least ``minimum`` when given.

    Raises ``UserError`` naming ``field`` otherwise.
    """
    if is_none_word(value):
        return None
    allowed = "none or a number" + (f" >= {minimum:g}" if minimum is not None else "")
    if isinstance(value, bool):
        raise UserError(f"{field}={value!r} is not allowed: use {allowed}")
    if isinstance(value, numbers.Real):
        number = float(value)
    else:
        try:
            number = float(str(value).strip())
        except ValueError:
            raise UserError(f"{field}={value!r} is not allowed: use {allowed}") from None
    if not math.isfinite(number) or (minimum is not None and number < minimum):
        raise UserError(f"{field}={value!r} is not allowed: use {allowed}")
    return number


def parse_length(item) -> int | None:
    """``1024`` / ``"1024"`` / ``"1k"`` / ``"1.5k"`` -> tokens (``k`` = 1024); None when it is not a length."""
    if isinstance(item, bool):
        return None
    if isinstance(item, numbers.Integral):
        return int(item)
    if isinstance(item, float):
        return int(item) if item.is_integer() else None
    text = str(item).strip().lower().replace("_", "")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(k?)", text)
    if not match:
        return None
    number = float(match.group(1)) * (1024 if match.group(2) else 1)
    return int(number) if number.is_integer() else None


def parse_lengths(value, field: str = "lengths") -> list[int]:
    """Lengths from ``"1024,2048"``, ``"1k,2k"`` or an iterable; sorted, de-duplicated, each >= 1."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        items = [value]
    if not items or items == [""]:
        raise UserError(f"{field}: give at least one length, e.g. 1024,2048 or 1k,2k")
    out = set()
    for item in items:
        length = parse_length(item)
        if length is None or length < 1:
            raise UserError(f"{field}: {item!r} is not a positive integer length (use e.g. 1024,2048 or 1k,2k)")
        out.add(length)
    return sorted(out)


def parse_at(at, field: str = "--at") -> tuple[str, float | int]:
    """``"16x"`` -> ``("multiple", 16.0)``; ``16384`` / ``"16k"`` -> ``("length", 16384)``."""
    text = str(at).strip().lower()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)x", text)
    if match:
        multiple = float(match.group(1))
        if multiple <= 0:
            raise UserError(f"{field} {at!r}: the multiple must be > 0")
        return ("multiple", multiple)
    length = parse_length(text) if re.fullmatch(r"\d+k?", text) else None
    if length is not None and length > 0:
        return ("length", length)
    raise UserError(f"{field} {at!r}: give an eval length (16384, 16k) or a multiple of the training length (16x)")


def resolve_at(at: tuple[str, float | int], train_len: int) -> int:
    """The length in tokens of a parsed ``at`` for a model trained at ``train_len``."""
    kind, number = at
    return int(round(number * train_len)) if kind == "multiple" else int(number)


def is_missing(value) -> bool:
    """None, NaN (float or numpy) or pandas' NA/NaT, or NA already turned into the text ``<NA>``."""
    if value is None:
        return True
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        try:
            return math.isnan(value)
        except TypeError:
            return False
    if type(value).__name__ in ("NAType", "NaTType"):
        return True
    return isinstance(value, str) and value == "<NA>"


def same_optional_number(a, b) -> bool:
    """Two optional numbers are the same: both missing, or both present and equal."""
    a_none, b_none = is_missing(a), is_missing(b)
    return (a_none and b_none) or (not a_none and not b_none and float(a) == float(b))


def check_int(value, field: str, minimum: int) -> int:
    """``value`` as an int if it is an integer (Python's or numpy's; not a bool) >= ``minimum``; else UserError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise UserError(f"{field}={value!r} is not allowed: use an integer >= {minimum}")
    return int(value)


def format_duration(seconds: float) -> str:
    """``37s``, ``4m05s``, ``2h13m``: elapsed times and ETAs in progress lines."""
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")
