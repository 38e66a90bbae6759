"""User-facing errors.

``UserError`` is raised for bad input (a malformed study file, an unknown attention name, a missing data
folder, a corrupt shard). The CLI prints it as one line, with no traceback. It subclasses ``ValueError``
so library callers can catch it as one.
"""


class UserError(ValueError):
    """Bad input from the user: the message names the field, the value and what is allowed."""


def one_line(exc: BaseException, limit: int = 240) -> str:
    """``Type: message`` on one line (whitespace runs folded), cut to ``limit`` characters with "..."."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
