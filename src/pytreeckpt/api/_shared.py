"""What the save and load calls share: leaf kinds, process groups, layout exchange, the save in flight."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from pytreeckpt.core._errors import CheckpointError, LayoutError
from pytreeckpt.core._leaf import Abstract, ShardedLeaf
from pytreeckpt.core._sharding import Layout, Mesh, Replicate, ShardingSpec
from pytreeckpt.core._values import PYTHON_LEAF_TYPES
from pytreeckpt.execute._monitor import Monitor, Span
from pytreeckpt.plan import ArraySpec, spec_digest, spec_plan_key
from pytreeckpt.storage._location import Where

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

    from ._save import SaveHandle

PathLike = Where  # a local path, a URL (file://, memory://, s3://, gs://), a kvstore spec or a Location

_SINGLE = ShardingSpec(Mesh(1), [Replicate()])


_gc_lock = threading.Lock()
_gc_paused_by = 0  # calls inside gc_paused() that found the collector enabled


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a save or load runs in the caller's thread.

    A state of 10,000 leaves makes hundreds of thousands of short-lived objects (plans,
    regions, futures); the collector's passes over them (and over everything else the
    process holds) cost a third of such a save or load. Nothing made here forms cycles
    that need the collector before the call returns; it is re-enabled on the way out,
    when the last of concurrent such calls ends, and only if it was enabled.
    """
    global _gc_paused_by
    with _gc_lock:
        mine = gc.isenabled() or _gc_paused_by > 0
        if mine:
            _gc_paused_by += 1
            gc.disable()
    try:
        yield
    finally:
        if mine:
            with _gc_lock:
                _gc_paused_by -= 1
                if _gc_paused_by == 0:
                    gc.enable()


def _span(layout: Any, ranks: Sequence[int] | None) -> int:
    """The world a layout needs: its positions, or the ranks a placement puts them on."""
    return int(layout.world_size) if ranks is None else _placed(ranks)[0] + 1


def _rank_of(placement: range | tuple[int, ...] | None) -> Any:
    """Position -> global rank under ``placement``."""
    if placement is None:
        return lambda p: p
    return placement.__getitem__


def _position(key: str, spec: Layout, placement: range | tuple[int, ...] | None, comm: Comm) -> int | None:
    """This rank's position in ``spec`` placed on ``placement`` (None: it holds nothing of the leaf)."""
    if placement is None:
        if spec.world_size > comm.world:
            raise LayoutError(f"its spec spans {spec.world_size} ranks but the process group has {comm.world}")
        return comm.rank if comm.rank < spec.world_size else None
    last, where = _placed(placement)
    if last >= comm.world:
        raise LayoutError(f"its placement names rank {last} but the process group has {comm.world}")
    return where.get(comm.rank)


_PLACED: dict[int, tuple[Any, int, dict[int, int]]] = {}


def _placed(placement: Sequence[int]) -> tuple[int, dict[int, int]]:
    """The highest rank of a placement, and each rank's position; once per placement object (the
    arrays of a pipeline stage share theirs)."""
    got = _PLACED.get(id(placement))
    if got is not None and got[0] is placement:
        return got[1], got[2]
    if len(_PLACED) > 256:
        _PLACED.clear()
    where = {r: p for p, r in enumerate(placement)}
    last = max(where, default=-1)
    _PLACED[id(placement)] = (placement, last, where)
    return last, where


_LEAF_TYPES = (torch.Tensor, np.ndarray, np.generic, ShardedLeaf, Abstract, *PYTHON_LEAF_TYPES)


# The leaf types met most, exactly: a set lookup answers for them (isinstance against a tuple
# holding enum.Enum, whose metaclass is not type, costs ten times as much for every non-value).
_VALUE_TYPES = frozenset({bool, int, float, str, type(None)})
_ARRAY_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, np.ndarray, ShardedLeaf, Abstract})
_LEAF_EXACT = _VALUE_TYPES | _ARRAY_TYPES


def _is_leaf(x: Any) -> bool:
    return type(x) in _LEAF_EXACT or isinstance(x, _LEAF_TYPES)


def _is_value(x: Any) -> bool:
    """A plain Python leaf, stored inline (numpy scalars, though float subclasses, are arrays)."""
    t = type(x)
    if t in _VALUE_TYPES:
        return True
    if t in _ARRAY_TYPES:
        return False
    return isinstance(x, PYTHON_LEAF_TYPES) and not isinstance(x, np.generic)


def _where(key: str) -> str:
    return repr(key) if key else "(root)"


def _is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and type(x).__module__.startswith("torch.distributed")


def _comm(process_group: Any) -> Comm | None:
    """The DistComm of a distributed save or load, or None in a single process (or a group of one rank)."""
    from pytreeckpt.distributed._comm import distributed_comm

    return distributed_comm(process_group)


class _Carried:
    """Errors a rank meets before a collective, carried into it so that every rank raises together.

    In a single process (no comm) an error is raised where it happens. In a distributed
    save or load a rank that raised before the next collective would never join it and
    leave the others waiting for the collective's timeout; instead the first error is
    kept here and given to the collective (``comm.agree`` or the layout exchange).
    """

    def __init__(self, comm: Comm | None) -> None:
        self.comm = comm
        self.error: BaseException | None = None

    def catch(self, key: str | None = None) -> _Catch:
        """Keep an exception of the block (as a CheckpointError naming ``key``, if given and it is not one)."""
        return _Catch(self, key)

    def carry(self, e: Exception, key: str | None) -> None:
        """What :meth:`catch`'s block does with ``e``, for a loop that catches it itself (a try per leaf
        costs less than entering a block): raise it in a single process, else keep it."""
        if self.comm is None:
            raise e
        self.keep(e, key)

    def keep(self, e: Exception, key: str | None) -> None:
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


class _Catch:
    """:meth:`_Carried.catch`'s block (a class, not a generator: it is entered once per leaf)."""

    __slots__ = ("carried", "key")

    def __init__(self, carried: _Carried, key: str | None) -> None:
        self.carried, self.key = carried, key

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, e: BaseException | None, tb: Any) -> bool:
        if not isinstance(e, Exception) or self.carried.comm is None:
            return False  # (none, or not ours to keep: raised as it is)
        self.carried.keep(e, self.key)
        return True


def _gather_spans(comm: Comm, monitor: Monitor) -> None:
    """Bring every rank's spans of this call to rank 0's monitor (the other ranks keep their own)."""
    mine = [s.to_json() for s in monitor.spans if s.rank == comm.rank]
    gathered = comm.gather(mine)
    if comm.rank == 0:
        monitor.extend([Span.from_json(s) for r, spans in enumerate(gathered) if r != 0 for s in spans])


def _describe(specs: Sequence[ArraySpec], dtypes: Sequence[str]) -> list[Any]:
    """What a rank says of the arrays it saves or loads, for an error message: key, dtype, shape, layout, ranks."""
    return [
        (s.key, d, list(s.shape), s.layout.to_json(), None if s.ranks is None else list(s.ranks))
        for s, d in zip(specs, dtypes, strict=True)
    ]


def _agree_on_specs(
    comm: Comm,
    specs: Sequence[ArraySpec],
    dtypes: Sequence[str],
    what: str,
    error: BaseException | None = None,
    values: Sequence[str] = (),
    known: tuple[tuple[Any, ...], bytes] | None = None,
) -> tuple[tuple[Any, ...], bytes] | None:
    """Check that every rank describes the same arrays, in the same layouts: the first collective of a save or load.

    Returns ``spec_plan_key(specs)`` and the digest this rank sent (None if this rank
    failed before): the plan cache's key, computed once per save or load, and what a
    later save of the same state sends (``known``).

    Every array's layout is a spec that every rank knows whole (a DTensor's mesh and
    placements, a ``ShardingSpec``, ``FlatRanges`` or ``ExplicitRegions``), so no rank's
    pieces travel: each rank sends rank 0 a 16-byte digest of its arrays (keys, dtypes,
    shapes, layouts, placements, and the keys of plain Python leaves ``values``), and
    rank 0 answers every rank with its verdict. What a rank receives does not grow with
    the world. Only when the digests differ do the descriptions travel, to say how they
    differ. A rank that failed before (``error``) sends its error instead, and every
    rank raises the same error. ``known``: ``spec_plan_key(specs)`` and this rank's
    digest (:func:`_state_digest`), if a save of this state computed them before.
    """
    from pytreeckpt.distributed._comm import describe_failure, failure

    mine: Any = None
    if error is None:
        try:
            if known is None:
                base = spec_plan_key(specs)
                known = (base, _state_digest(base, dtypes, values))
            mine = ("ok", known[1])
        except Exception as e:
            error = e
    if error is not None:
        mine = ("error", describe_failure(error))
    gathered = comm.gather(mine)
    verdict: Any = None
    # (every rank's digest equal to rank 0's: C compares them, at 16,384 ranks a Python loop cost 5 ms)
    if comm.rank == 0 and (mine[0] != "ok" or gathered.count(mine) != len(gathered)):
        failed = [(r, g[1]) for r, g in enumerate(gathered) if g[0] == "error"]
        if failed:
            verdict = ("failed", failed)
        elif any(g[1] != gathered[0][1] for g in gathered):
            verdict = ("differ",)
    verdict = comm.broadcast(verdict)
    if verdict is None:
        return known
    if verdict[0] == "failed":
        raise failure(f"preparing the {what}", verdict[1], comm.world) from error
    # The digests differ: rank 0's description goes to every rank, which says how its own differs.
    desc = (_describe(specs, dtypes), list(values))
    ref = comm.broadcast(desc if comm.rank == 0 else None)
    problem = None
    if [m[:3] for m in desc[0]] != [m[:3] for m in ref[0]]:
        problem = CheckpointError(
            f"ranks disagree on the state to {what}: rank 0 and rank {comm.rank} differ in (key, dtype, shape): "
            f"{_difference([m[:3] for m in ref[0]], [m[:3] for m in desc[0]], comm.rank)}"
        )
    elif desc[0] != ref[0]:
        problem = CheckpointError(
            f"ranks disagree on the state to {what}: rank 0 and rank {comm.rank} differ in the layout of "
            f"{_difference(ref[0], desc[0], comm.rank)}"
        )
    elif desc[1] != ref[1]:
        problem = CheckpointError(
            f"ranks disagree on the state to {what}: rank 0 and rank {comm.rank} differ in their plain Python "
            f"leaves: {_difference(ref[1], desc[1], comm.rank)}"
        )
    comm.agree(problem, f"preparing the {what}")
    raise CheckpointError(f"ranks disagree on the state to {what}: their descriptions differ in a way not shown")


def _state_digest(base: tuple[Any, ...], dtypes: Sequence[str], values: Sequence[str]) -> bytes:
    """What a rank sends to agree on a state: a digest of its arrays' key (``spec_plan_key``), dtypes and value keys."""
    return spec_digest((*base, tuple(dtypes), tuple(values)))


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
