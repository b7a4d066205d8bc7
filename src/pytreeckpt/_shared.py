"""What the save and load calls share: leaf kinds, process groups, layout exchange, the save in flight."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NoReturn

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


class _Carried:
    """Errors a rank meets before a collective, carried into it so that every rank raises together.

    In a single process (no comm) an error is raised where it happens. In a distributed
    save or load a rank that raised before the next collective would never join it and
    leave the others waiting for the collective's timeout; instead the first error is
    kept here and given to the collective (``comm.agree`` or the layout exchange).
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.error: BaseException | None = None

    @contextlib.contextmanager
    def catch(self, key: str | None = None) -> Iterator[None]:
        """Keep an exception of the block (as a CheckpointError naming ``key``, if given and it is not one)."""
        try:
            yield
        except Exception as e:
            if self.comm is None:
                raise
            if self.error is None:
                if key is not None and not isinstance(e, CheckpointError):
                    wrapped = CheckpointError(f"leaf {_where(key)}: {type(e).__name__}: {e}")
                    wrapped.__cause__ = e
                    e = wrapped
                self.error = e

    def agree(self, what: str) -> None:
        """Every rank raises if any rank failed so far (a collective; nothing in a single process)."""
        if self.comm is not None:
            error, self.error = self.error, None
            self.comm.agree(error, what)

    def fail(self, what: str) -> NoReturn:
        """This rank failed: raise, together with the other ranks at their agreement on ``what``."""
        error = self.error
        if error is None:
            raise AssertionError("_Carried.fail without an error")
        self.agree(what)
        raise error  # (a single process; in a distributed one the agreement raised)


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
    comm: Any,
    arrays: list[tuple[str, str, tuple[int, ...], tuple[Piece, ...]]],
    what: str,
    error: BaseException | None = None,
    values: list[str] | None = None,
) -> list[tuple[tuple[Piece, ...], ...]]:
    """Gather every rank's own pieces of every array, once; check that the ranks describe the same arrays.

    A rank knows its own pieces for sure (a DTensor on a submesh says nothing of the
    ranks outside it), so each rank reports its own and all assemble the same layouts.
    This is the first collective of a save or load: a rank that failed before it
    (``error``) sends its error instead, and every rank raises the same error. The keys
    of plain Python leaves (``values``) must agree too.
    """
    from ._distributed import describe_failure, failure

    if error is not None:
        mine: Any = ("error", describe_failure(error))
    else:
        mine = (
            "ok",
            [
                (key, dtype, list(shape), [(p.region.offset, p.region.shape, p.local_offset, p.local_box) for p in pcs])
                for key, dtype, shape, pcs in arrays
            ],
            list(values or []),
        )
    gathered = comm.all_gather(mine)
    failed = [(r, g[1]) for r, g in enumerate(gathered) if g[0] == "error"]
    if failed:
        raise failure(f"preparing the {what}", failed, comm.world) from error
    ref = [m[:3] for m in gathered[0][1]]
    for r, (_, other, other_values) in enumerate(gathered):
        desc = [m[:3] for m in other]
        if desc != ref:
            raise CheckpointError(
                f"ranks disagree on the state to {what}: rank 0 and rank {r} differ in (key, dtype, shape): "
                f"{_difference(ref, desc, r)}"
            )
        if other_values != gathered[0][2]:
            raise CheckpointError(
                f"ranks disagree on the state to {what}: rank 0 and rank {r} differ in their plain Python leaves: "
                f"{_difference(gathered[0][2], other_values, r)}"
            )
    return [
        tuple(
            tuple(Piece(Region(tuple(o), tuple(s)), lo, lb) for o, s, lo, lb in gathered[r][1][i][3])
            for r in range(comm.world)
        )
        for i in range(len(arrays))
    ]


def _difference(ref: list[Any], other: list[Any], rank: int) -> str:
    """The first difference of two ranks' descriptions, by key where a key is missing on one side."""

    def name(m: Any) -> str:
        return str(m[0]) if isinstance(m, (list, tuple)) else str(m)

    ref_keys, other_keys = [name(m) for m in ref], [name(m) for m in other]
    ref_set, other_set = set(ref_keys), set(other_keys)
    only_ref = [k for k in ref_keys if k not in other_set]
    only_other = [k for k in other_keys if k not in ref_set]
    if only_ref or only_other:
        parts = [f"leaf {_where(k)} only on rank 0" for k in only_ref[:3]]
        parts += [f"leaf {_where(k)} only on rank {rank}" for k in only_other[:3]]
        return "; ".join(parts)
    return next((f"{a} versus {b}" for a, b in zip(ref, other, strict=False) if a != b), "their order")


_IN_FLIGHT_LOCK = threading.Lock()

_in_flight: list[SaveHandle] = []  # the asynchronous save in flight, if any


def _wait_in_flight() -> None:
    """Wait for the save in flight, if any; its failure surfaces here at the latest."""
    with _IN_FLIGHT_LOCK:
        pending = list(_in_flight)
        _in_flight.clear()
    for h in pending:
        h._settle()
