"""Test-only fault injection: rank ``ATTNLAB_FAIL_RANK`` (default 0) raises at optimizer step
``ATTNLAB_FAIL_AT_STEP``, once when ``ATTNLAB_FAIL_ONCE_FILE`` names a marker file (written as it fails; a restart
finds it and trains on). With ``ATTNLAB_FAIL_HOW=exit`` the process dies there instead (``os._exit``, as one killed
for its memory would), before any handler can record why.

The production code only exposes the seam (:func:`attnlab.faults.before_train_step`, a no-op); :func:`install`
puts :func:`fail_at_step` there. These variables are read here, by test code, on every step of a process where it
is installed:

- the pytest process (``conftest.py`` installs it at import): training in the test's own process;
- every worker of the test session's Ray cluster (``conftest.ray_session`` passes :func:`install` as Ray's
  ``worker_process_setup_hook``, shipped by value): Ray Train workers and Tune trials. The variables reach them as
  attnlab forwards every ``ATTNLAB_*`` variable to its workers (Ray Train's ``worker_runtime_env``, a study's
  trial context);
- a subprocess whose script calls :func:`install` (it puts this folder on ``sys.path`` first).

The seams that need no variable are set directly by the test that wants them: :func:`slowed` starts a script with
data preparation slowed down (the kill-and-resume tests); the compaction crash tests set
:func:`attnlab.faults.compaction_step` in the child process they kill.
"""

from __future__ import annotations

import os
from pathlib import Path

FAIL_AT_STEP_ENV, FAIL_RANK_ENV, FAIL_ONCE_FILE_ENV = "ATTNLAB_FAIL_AT_STEP", "ATTNLAB_FAIL_RANK", "ATTNLAB_FAIL_ONCE_FILE"
FAIL_HOW_ENV = "ATTNLAB_FAIL_HOW"
HERE = str(Path(__file__).resolve().parent)


def fail_at_step(step: int, rank: int) -> None:
    if os.environ.get(FAIL_AT_STEP_ENV) is None or int(os.environ[FAIL_AT_STEP_ENV]) != step:
        return
    if rank != int(os.environ.get(FAIL_RANK_ENV, "0")):
        return
    marker = os.environ.get(FAIL_ONCE_FILE_ENV)
    if marker:
        if os.path.exists(marker):
            return
        Path(marker).write_text(f"failed at step {step} on rank {rank}\n")
    if os.environ.get(FAIL_HOW_ENV) == "exit":
        os._exit(3)
    raise RuntimeError(f"injected worker failure at step {step} on rank {rank} ({FAIL_AT_STEP_ENV})")


def install() -> None:
    """Put :func:`fail_at_step` in the training loop's seam of this process (imports nothing heavy)."""
    import attnlab.faults

    attnlab.faults.before_train_step = fail_at_step


def slow_data_items(seconds: float) -> None:
    """Make data preparation in this process sleep ``seconds`` after each work item
    (:func:`attnlab.faults.after_data_item`)."""
    import time

    import attnlab.faults

    attnlab.faults.after_data_item = lambda: time.sleep(seconds)


def slowed(code: str, seconds: float) -> str:
    """``code`` (a Python script) run after :func:`slow_data_items`: each work item of data preparation then takes
    ``seconds`` more, so a test can kill the script midway."""
    install_here = f"import sys; sys.path.insert(0, {HERE!r}); import fault_injection"
    return f"{install_here}; fault_injection.slow_data_items({seconds!r})\n{code}"


def ray_setup_hook():
    """``install`` as Ray's ``worker_process_setup_hook`` (a callable Ray pickles): by value, so a worker needs no
    path to this folder."""
    import sys

    from ray import cloudpickle  # the pickler Ray ships functions with

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return install
