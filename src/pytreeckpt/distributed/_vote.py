"""Small votes among a checkpoint group's ranks: each position's maximum over the ranks.

A :class:`~pytreeckpt.manager.CheckpointManager` asks, at each save, whether any rank saw
a preemption signal and whether rank 0's clock says a timed save is due; and, at each
restore attempt, what the worst outcome on any rank was. One all-reduce of a few
integers on the checkpoint's own gloo group (never the training's group).
"""

from __future__ import annotations

from collections.abc import Sequence

from pytreeckpt.distributed._comm import Comm, DistComm

__all__ = ["vote_max"]


def vote_max(comm: Comm | None, values: Sequence[int], what: str) -> list[int]:
    """Each position's maximum over the ranks of ``comm`` (``values`` themselves in a single process); ``what``
    names the vote in a timeout's error.

    >>> vote_max(None, [0, 3], "a vote")
    [0, 3]
    """
    if comm is None:
        return [int(v) for v in values]
    if isinstance(comm, DistComm):
        return comm.max_of(values, what)
    gathered = comm.gather([int(v) for v in values], what)
    best = [max(column) for column in zip(*gathered, strict=True)] if comm.rank == 0 else None
    return list(comm.broadcast(best, 0, what))
