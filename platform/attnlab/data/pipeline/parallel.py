"""The only Ray code of the data pipeline: run one function over many work items as Ray tasks.

``with RayPool(workers) as pool: pool.map(fn, items)`` submits ``fn(item)`` as plain Ray tasks (fractional
``num_cpus`` so they fit beside other work and never deadlock like Ray Data's actor pools on small
machines), keeps at most ``workers`` in flight, and yields ``(index, result)`` as each finishes. It uses
the Ray cluster this process is already connected to, or the one ``RAY_ADDRESS`` names, or else starts an
embedded local one (shut down again on exit). Only top-level functions of importable modules are sent,
so workers need ``attnlab`` installed (true for a local cluster and for ``ray job submit`` working dirs). Everything else in ``attnlab.data`` imports and runs without Ray.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def cluster_cpus() -> int | None:
    """Logical CPUs of the Ray cluster this process is connected to, or None when not connected."""
    import ray

    if not ray.is_initialized():
        return None
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


class RayPool:
    """Runs work items as Ray tasks, at most ``workers`` in flight; a context manager (see module doc)."""

    def __init__(self, workers: int | None, num_cpus: float = 0.5):
        """``workers=None``: every CPU of the cluster (known once connected)."""
        self.workers = None if workers is None else max(1, int(workers))
        self.num_cpus = num_cpus
        self._started_here = False

    def __enter__(self) -> RayPool:
        from attnlab.ray_runtime import ensure_ray

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self._started_here = ensure_ray(num_cpus=self.workers or os.cpu_count() or 1, object_store_mb=256,
                                        dashboard=False, log_to_driver=False)
        if self.workers is None:
            self.workers = cluster_cpus() or 1
        return self

    def __exit__(self, *exc) -> None:
        import ray

        if self._started_here:
            ray.shutdown()
            self._started_here = False

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> Iterator[tuple[int, Any]]:
        """Yield ``(i, fn(items[i]))`` in completion order. A task's own exception is re-raised as is."""
        import ray

        remote = ray.remote(num_cpus=self.num_cpus, max_retries=2)(fn)
        pending: dict[Any, int] = {}
        next_item = 0
        try:
            while next_item < len(items) or pending:
                while next_item < len(items) and len(pending) < self.workers:
                    pending[remote.remote(items[next_item])] = next_item
                    next_item += 1
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    index = pending.pop(ref)
                    try:
                        result = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        cause = getattr(exc, "cause", None)
                        if isinstance(cause, Exception):
                            raise cause from None
                        raise
                    yield index, result
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
