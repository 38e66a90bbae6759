"""User-facing errors.

``UserError`` is raised for bad input (a malformed study file, an unknown attention name, a missing data
folder, a corrupt shard). The CLI prints it as one line, with no traceback. It subclasses ``ValueError``
so library callers can catch it as one.
"""


class UserError(ValueError):
    """Bad input from the user: the message names the field, the value and what is allowed."""


class Interrupted(KeyboardInterrupt):
    """A command stopped by SIGINT (Ctrl-C) or SIGTERM (``timeout``, systemd, Slurm, Kubernetes) after it recorded
    what it had done: ``str()`` says what was interrupted, in words for the command's last line (the CLI adds how to
    resume and exits 128 + the signal's number). A ``KeyboardInterrupt``, so code that lets Ctrl-C through lets
    this through."""

    def __init__(self, what: str, signum: int):
        super().__init__(what)
        self.what, self.signum = what, int(signum)

    def __str__(self) -> str:
        return self.what

    def last_line(self, words: list[str]) -> str:
        """The command's last line: what was interrupted, and how to go on: the same command (``words``, its
        arguments after ``attnlab``), without ``--fresh``, which would start its search over."""
        import shlex

        again = [w for w in words if w != "--fresh"]
        return (f"attnlab: {self.what}; the same command{' without --fresh' if len(again) < len(words) else ''} "
                f"resumes it: attnlab {shlex.join(again)}")


def one_line(exc: BaseException, limit: int = 240) -> str:
    """``Type: message`` on one line (whitespace runs folded), cut to ``limit`` characters with "..."."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
