"""User-facing errors.

``UserError`` is raised for bad input (a malformed study file, an unknown attention name, a missing data
folder, a corrupt shard). The CLI prints it as one line, with no traceback. It subclasses ``ValueError``
so library callers can catch it as one.
"""


class UserError(ValueError):
    """Bad input from the user: the message names the field, the value and what is allowed."""
