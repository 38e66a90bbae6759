"""A read's filters: ``column=value``, ``column=[...]`` (any of; ``None`` in the list matches null) or
``column=None``, checked against the stored columns (an old name, such as ``config_hash``, means its column) and
turned into one pyarrow expression, which the readers push into their scans. It reads no file."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc

from attnlab.errors import UserError
from attnlab.results.schema import ARROW_SCHEMA, INPUT_ALIASES, STORED_NAMES


def filter_expression(filters: Mapping[str, object], train_key: pc.Expression | None = None):
    """The filters as one pyarrow expression (``train_key``: what a ``train_key`` filter compares, when not the
    column itself)."""
    expr = None
    for name, wanted in filters.items():
        field_ = train_key if name == "train_key" and train_key is not None else pc.field(name)
        if isinstance(wanted, (list, tuple, set, frozenset)):
            values = list(wanted)
            non_null = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
            term = None
            if non_null:
                term = field_.isin(pa.array(non_null, type=ARROW_SCHEMA.field(name).type))
            if len(non_null) < len(values):
                term = field_.is_null() if term is None else (term | field_.is_null())
            if term is None:  # empty list: nothing matches
                term = pc.scalar(False)
        elif wanted is None:
            term = field_.is_null()
        else:
            term = field_ == pa.scalar(wanted, type=ARROW_SCHEMA.field(name).type)
        expr = term if expr is None else (expr & term)
    return expr


def current_filters(filters: Mapping[str, object]) -> dict:
    """``filters`` by their columns' current names; a UserError names a filter that is no column."""
    out = {}
    for name, wanted in filters.items():
        current = INPUT_ALIASES.get(name, name)
        if current not in STORED_NAMES:
            raise UserError(f"results filter {name!r} is not a column; allowed: {', '.join(STORED_NAMES)}")
        if current in out and out[current] != wanted:
            raise UserError(f"results filters {name!r} and {current!r} name one column ({name!r} is its old name) "
                            "with two values: give one")
        out[current] = wanted
    return out
