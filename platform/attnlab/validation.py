"""Turn pydantic validation errors into one-line ``UserError`` messages that name the field and the value.

Shared by the typed configs (training config, study spec). No Ray here.
"""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic

from attnlab.errors import UserError

M = TypeVar("M", bound=pydantic.BaseModel)


def describe(exc: pydantic.ValidationError, prefix: str = "") -> str:
    """The first error as ``prefix.field.path=value: what is wrong`` (plus a count of any others)."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = ".".join(str(part) for part in err["loc"])
    where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "is not a known field"
    elif err["type"] == "missing":
        msg = "is required"
    value = err.get("input")
    shown = "" if err["type"] in ("missing",) or isinstance(value, dict) else f"={value!r}"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where}{shown}: {msg}{more}"


def parse(model: type[M], data: Any, prefix: str = "") -> M:
    """Validate ``data`` into ``model``, raising ``UserError`` with a one-line message on failure."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise UserError(describe(exc, prefix)) from None
