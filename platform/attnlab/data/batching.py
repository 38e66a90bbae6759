"""How an optimizer step's batch is split between workers and micro-steps: one rule for every data source.

The ``global_batch`` rows of an optimizer step depend on the step and the seed alone; rank ``r`` at
micro-step ``m`` takes rows ``[(m * world_size + r) * B, ... + B)``. A run therefore sees the same batches
whatever its worker count, and a run resumed at step ``s`` sees exactly what an uninterrupted run would.
No Ray, no torch here.
"""

from __future__ import annotations

from attnlab.errors import UserError


def micro_batch_rows(rank: int, world_size: int, micro: int, micro_batch: int, global_batch: int) -> range:
    """The rows of a step's ``global_batch`` that rank ``rank`` takes at micro-step ``micro``."""
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} must be in [0, world_size={world_size})")
    lo = (micro * world_size + rank) * micro_batch
    hi = lo + micro_batch
    if micro < 0 or micro_batch < 1 or hi > global_batch:
        raise UserError(f"micro-step {micro} x world_size {world_size} x micro_batch {micro_batch} needs rows "
                        f"[{lo}, {hi}) but global_batch is {global_batch}")
    return range(lo, hi)
