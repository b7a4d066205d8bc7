"""What the save and load calls share: leaf kinds, process groups, layout exchange, the save in flight."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._errors import CheckpointError, LayoutError
from ._leaf import Abstract, ShardedLeaf
from ._location import Where
from ._monitor import Monitor, Span
from ._region import Region
from ._sharding import Mesh, Piece, Replicate, ShardingSpec
from ._tree import PYTHON_LEAF_TYPES

if TYPE_CHECKING:
    from ._save import SaveHandle

PathLike = Where  # a local path, a URL (file://, memory://, s3://, gs://), a kvstore spec or a Location

_SINGLE = ShardingSpec(Mesh(1), [Replicate()])


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray, np.generic, ShardedLeaf, Abstract, *PYTHON_LEAF_TYPES))


def _is_value(x: Any) -> bool:
    """A plain Python leaf, stored inline (numpy scalars, though float subclasses, are arrays)."""
    return isinstance(x, PYTHON_LEAF_TYPES) and not isinstance(x, np.generic)


def _where(key: str) -> str:
    return repr(key) if key else "(root)"


def _is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and type(x).__module__.startswith("torch.distributed")


def _comm(process_group: Any) -> Any:
    """The DistComm of a distributed save or load, or None in a single process (or a group of one rank)."""
    from ._distributed import distributed_comm

    return distributed_comm(process_group)


def _pad(pieces: tuple[tuple[Piece, ...], ...], world: int, key: str) -> tuple[tuple[Piece, ...], ...]:
    if len(pieces) > world:
        raise LayoutError(f"leaf {_where(key)}: its spec spans {len(pieces)} ranks but the process group has {world}")
    return pieces + ((),) * (world - len(pieces))


def _gather_spans(comm: Any, monitor: Monitor) -> None:
    """Bring every rank's spans of this call to rank 0's monitor (the other ranks keep their own)."""
    mine = [s.to_json() for s in monitor.spans if s.rank == comm.rank]
    gathered = comm.gather(mine)
    if comm.rank == 0:
        monitor.extend([Span.from_json(s) for r, spans in enumerate(gathered) if r != 0 for s in spans])


def _exchange_layouts(
    comm: Any, arrays: list[tuple[str, str, tuple[int, ...], tuple[Piece, ...]]], what: str
) -> list[tuple[tuple[Piece, ...], ...]]:
    """Gather every rank's own pieces of every array, once; check that the ranks describe the same arrays.

    A rank knows its own pieces for sure (a DTensor on a submesh says nothing of the
    ranks outside it), so each rank reports its own and all assemble the same layouts.
    """
    mine = [
        (key, dtype, list(shape), [(p.region.offset, p.region.shape, p.local_offset, p.local_box) for p in pieces])
        for key, dtype, shape, pieces in arrays
    ]
    gathered = comm.all_gather(mine)
    ref = [m[:3] for m in gathered[0]]
    for r, other in enumerate(gathered):
        desc = [m[:3] for m in other]
        if desc != ref:
            diff = next(
                (f"{a} versus {b}" for a, b in zip(ref, desc, strict=False) if a != b),
                f"{len(ref)} arrays versus {len(desc)}",
            )
            raise CheckpointError(
                f"ranks disagree on the state to {what}: rank 0 and rank {r} differ in (key, dtype, shape): {diff}"
            )
    return [
        tuple(
            tuple(Piece(Region(tuple(o), tuple(s)), lo, lb) for o, s, lo, lb in gathered[r][i][3])
            for r in range(comm.world)
        )
        for i in range(len(arrays))
    ]


_IN_FLIGHT_LOCK = threading.Lock()

_in_flight: list[SaveHandle] = []  # the asynchronous save in flight, if any


def _wait_in_flight() -> None:
    """Wait for the save in flight, if any; its failure surfaces here at the latest."""
    with _IN_FLIGHT_LOCK:
        pending = list(_in_flight)
        _in_flight.clear()
    for h in pending:
        h._settle()
