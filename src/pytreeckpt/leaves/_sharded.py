"""Leaves laid out by a declarative spec: :class:`ShardedLeaf` (shards held) and :class:`Abstract` (none).

A ShardedLeaf holds the shards of some positions of its spec (placed on ranks by its
placement); a save writes what they hold, a load fills or makes the shards of its
positions (in a distributed load, this rank's). An Abstract is a leaf's description
alone: ``plan_save`` plans it, a load makes a new tensor (or this rank's shard) of it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pytreeckpt.core._dtypes import dtype_of_torch
from pytreeckpt.core._errors import CheckpointError, LayoutError, where
from pytreeckpt.core._leaf import Abstract, ShardedLeaf
from pytreeckpt.core._sharding import Layout, Mesh, Replicate, ShardingSpec
from pytreeckpt.format import ArrayMeta, ValueMeta

from ._dests import fillable, full_dest, into, naming_leaf, stored_for
from ._kind import (
    SINGLE,
    ArrayIn,
    Buffers,
    Describing,
    Dest,
    LeafKind,
    Matching,
    array_in_of,
    dest_of,
    position,
    rank_of,
)
from ._sources import check_ndim, check_spec, check_tensor, layout_error, no_data, shard_sources

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

__all__ = ["AbstractKind", "ShardedKind"]


class ShardedKind(LeafKind):
    """A :class:`ShardedLeaf`: the shards of some positions of its spec."""

    name = "sharded"

    def claims(self, t: type) -> bool:
        return issubclass(t, ShardedLeaf)

    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        check_spec(key, spec)
        try:
            d.array(_sharded_in(key, leaf, spec, d.comm))
        except (LayoutError, ValueError) as e:
            raise layout_error(key, e) from None

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        array = stored_for(key, stored, leaf, m)
        if array is None:
            return
        devices = {r: t.device for r, t in leaf.shards.items()}
        into_ = leaf if m.inplace else None
        dest = sharded_dest(
            array, leaf.spec, sorted(leaf.shards), devices, m.comm, into_, leaf.placement, buffers=m.buffers
        )
        m.dests.append((i, dest))


def _sharded_in(key: str, leaf: ShardedLeaf, spec: Any, comm: Comm | None) -> ArrayIn:
    if spec is not None and spec != leaf.spec:
        raise CheckpointError(
            f"leaf {where(key)} is a ShardedLeaf in layout {leaf.spec}, but the spec tree gives {spec}"
        )
    check_ndim(key, len(leaf.shape))
    for shard in leaf.shards.values():
        check_tensor(key, shard)
    # Pieces and data by global rank; shards by position (the same unless a placement says otherwise).
    to_rank = rank_of(leaf.placement)
    if comm is not None:
        mine = position(key, leaf.spec, leaf.placement, comm)
        if mine is not None and mine not in leaf.shards:
            raise CheckpointError(
                f"leaf {where(key)}: rank {comm.rank} saves a ShardedLeaf without its own shard "
                f"(position {mine}; it holds positions {sorted(leaf.shards)})"
            )
        positions: tuple[int, ...] = () if mine is None else (mine,)
        pieces = {comm.rank: leaf.spec.pieces_of(mine, leaf.shape) if mine is not None else ()}
    else:
        positions = tuple(leaf.shards)
        pieces = {to_rank(p): leaf.spec.pieces_of(p, leaf.shape) for p in positions}
    present = frozenset(pieces) if comm is None else frozenset({comm.rank})
    get, device = shard_sources({to_rank(p): leaf.shards[p] for p in positions}, pieces)
    watch = tuple(leaf.shards[p] for p in positions)
    dtype = dtype_of_torch(leaf.dtype)
    return ArrayIn(
        key, "torch", dtype, leaf.shape, leaf.spec, leaf.spec, pieces, get, present, device, watch, ranks=leaf.placement
    )


class AbstractKind(LeafKind):
    """An :class:`Abstract`: shape, dtype, spec and placement, no data."""

    name = "abstract"

    def claims(self, t: type) -> bool:
        return issubclass(t, Abstract)

    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        if not d.plan_only:
            raise CheckpointError(f"leaf {where(key)} is an Abstract placeholder, which has no data to save")
        d.array(_abstract_in(key, leaf, spec, d.comm, d.kinds))

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        array = stored_for(key, stored, leaf, m)
        if array is None:
            return
        comm, buffers = m.comm, m.buffers
        if leaf.spec is None:
            m.dests.append((i, full_dest(array, False, None, None, comm, buffers=buffers)))
            return
        if comm is not None and not m.inplace:
            # (a rank's new shard of a sharded Abstract target: every leaf of a job's first load, thousands a rank)
            m.dests.append(
                (i, own_shard_dest(array, own_shard_of(leaf.spec, leaf.placement, array, comm, buffers), buffers))
            )
            return
        problem = spec_problem(key, leaf.spec, leaf.shape)
        if problem:
            m.problems.append(problem)
            return
        positions = range(leaf.spec.world_size) if comm is None else ()  # (all, one process; a group: its own)
        m.dests.append((i, sharded_dest(array, leaf.spec, positions, {}, comm, None, leaf.placement, buffers=buffers)))


def _abstract_in(key: str, leaf: Abstract, spec: Any, comm: Comm | None, kinds: dict[Any, Any]) -> ArrayIn:
    """An Abstract leaf, planned (for :func:`pytreeckpt.plan_save`) as a tensor whose data is never read.

    ``kinds`` (one per save) keeps what leaves of one spec, shape, dtype and placement
    *objects* share (a model's layers do): their layout, this rank's pieces and dtype.
    """
    if spec is not None and spec != leaf.spec:
        raise CheckpointError(f"leaf {where(key)} is an Abstract in layout {leaf.spec}, but the spec tree gives {spec}")
    placement, saved = leaf.placement, leaf.spec
    kind = (id(saved), leaf.shape, leaf.dtype, id(placement))
    got = kinds.get(kind)
    if got is None or got[0] is not saved or got[1] is not placement:
        check_ndim(key, len(leaf.shape))
        if saved is not None:
            try:
                saved.check(leaf.shape)
            except LayoutError as e:
                raise LayoutError(f"leaf {where(key)}: {e}") from None
        layout = (
            leaf.spec
            if leaf.spec is not None
            else (SINGLE if comm is None else ShardingSpec(Mesh(comm.world), [Replicate()]))
        )
        if comm is not None:
            mine = position(key, layout, placement, comm)
            pieces = {comm.rank: layout.pieces_of(mine, leaf.shape) if mine is not None else ()}
        else:
            to_rank = rank_of(placement)
            pieces = {to_rank(p): layout.pieces_of(p, leaf.shape) for p in range(layout.world_size)}
        got = (leaf.spec, placement, layout, pieces, dtype_of_torch(leaf.dtype))
        kinds[kind] = got  # (the leaf keeps its spec and placement alive, so their ids stay theirs)
    _, _, layout, pieces, dtype = got
    made: ArrayIn = array_in_of(
        key, "torch", dtype, leaf.shape, layout, saved, pieces, no_data, None, None, (), placement, False
    )
    return made


def spec_problem(key: str, spec: Layout, shape: tuple[int, ...]) -> str | None:
    """Why a target's ``spec`` cannot lay out its ``shape`` (an :class:`Abstract` is made without checking)."""
    try:
        spec.check(shape)
    except LayoutError as e:
        return f"leaf {where(key)}: the target's spec does not fit its shape {shape}: {e}"
    return None


def own_shard(
    spec: Layout, placement: range | tuple[int, ...] | None, shape: tuple[int, ...], comm: Comm, key: str
) -> tuple[Any, ...]:
    """This rank's shard of a leaf of ``spec``, ``placement`` and ``shape``: (spec, placement, its position
    (None: it holds none), its rank, its shard's shape, its pieces by rank)."""
    problem = spec_problem(key, spec, shape)
    if problem is not None:
        raise LayoutError(problem)
    try:
        mine = position(key, spec, placement, comm)
    except LayoutError as e:
        raise LayoutError(f"leaf {where(key)}: {e}") from None
    if mine is None:
        return spec, placement, None, None, None, {}
    rank = mine if placement is None else placement[mine]
    return spec, placement, mine, rank, spec.local_shape(mine, shape), {rank: spec.pieces_of(mine, shape)}


def own_shard_dest(meta: ArrayMeta, own: tuple[Any, ...], buffers: Buffers) -> Dest:
    """:func:`sharded_dest` of a new leaf on the host in a distributed load: this rank's shard (``own``, from
    :func:`own_shard`), read into new host memory."""
    shape, dtype = meta.shape, meta.dtype.torch
    spec, placement, mine, rank, local_shape, pieces = own
    # (finish: a partial, not a closure, for the many thousand leaves of a rank's load: one object, not seven)
    if mine is None:
        none = functools.partial(ShardedLeaf, shape, dtype, spec, {}, placement)
        return dest_of(meta, spec, {}, {}, none, 0, placement, None)  # type: ignore[no-any-return]
    local = buffers.tensor(local_shape, dtype, False)
    finish = functools.partial(ShardedLeaf, shape, dtype, spec, {mine: local}, placement)
    return dest_of(meta, spec, pieces, {rank: local}, finish, 0, placement, None)  # type: ignore[no-any-return]


def own_shard_of(
    spec: Layout, placement: range | tuple[int, ...] | None, meta: ArrayMeta, comm: Comm, buffers: Buffers
) -> tuple[Any, ...]:
    """:func:`own_shard` of a target leaf, memoised in ``buffers`` on its spec, shape and placement objects."""
    kind = (id(spec), meta.shape, id(placement))
    mine = buffers.shards.get(kind)
    if mine is None or mine[0] is not spec or mine[1] is not placement:
        mine = buffers.shards[kind] = own_shard(spec, placement, meta.shape, comm, meta.key)
        # (the target leaf keeps its spec and placement alive: their ids stay theirs for the load)
    return mine


@naming_leaf
def sharded_dest(
    meta: ArrayMeta,
    spec: Layout,
    ranks: Sequence[int],
    devices: dict[int, torch.device],
    comm: Comm | None = None,
    into_: ShardedLeaf | None = None,
    placement: range | tuple[int, ...] | None = None,
    *,
    buffers: Buffers,
) -> Dest:
    """The shards of ``ranks`` (positions of ``spec``) on their global ranks (``placement``, None: the same);
    in a distributed load this rank's position is filled.

    With ``into_`` (a load in place) the reads land in its own shards, and the result is ``into_``.
    Pieces and memory go by global rank, the result's shards by position.
    """
    if comm is not None:
        mine = own_shard_of(spec, placement, meta, comm, buffers)
        if into_ is None and not devices:  # (a new leaf on the host, this rank's shard: what follows, for one)
            return own_shard_dest(meta, mine, buffers)
        ranks = [] if mine[2] is None else [mine[2]]
    to_rank = rank_of(placement)
    if placement is not None:  # memory and devices by global rank from here on
        devices = {to_rank(p): d for p, d in devices.items()}
    pieces = {to_rank(p): spec.pieces_of(p, meta.shape) for p in ranks}
    position_of = {to_rank(p): p for p in ranks}
    ranks = [to_rank(p) for p in ranks]
    moved = {r for r in ranks if r in devices and devices[r].type != "cpu"}
    if into_ is not None:
        leaf = into_
        missing = [position_of[r] for r in ranks if position_of[r] not in leaf.shards]
        if missing:
            raise LayoutError(
                f"leaf {where(meta.key)}: loading in place needs the shards of ranks {missing}, which the target "
                f"ShardedLeaf does not hold"
            )
        own = {r: leaf.shards[position_of[r]] for r in ranks}
        direct = {r: t for r, t in own.items() if fillable(t)}
        staged = {
            r: buffers.tensor(tuple(own[r].shape), meta.dtype.torch, devices[r].type == "cuda")
            for r in ranks
            if r not in direct
        }

        def filled() -> ShardedLeaf:
            for r, b in staged.items():
                into(own[r], b)
            return leaf

        held = {r: direct[r].detach() if r in direct else staged[r] for r in ranks}
        h2d = sum(b.numel() * b.element_size() for r, b in staged.items() if r in moved)
        return Dest(meta, spec, pieces, held, filled, h2d, placement)

    locals_ = {
        r: buffers.tensor(
            spec.local_shape(position_of[r], meta.shape), meta.dtype.torch, r in moved and devices[r].type == "cuda"
        )
        for r in ranks
    }

    def finish() -> ShardedLeaf:
        shards = {position_of[r]: t.to(devices[r], non_blocking=True) if r in moved else t for r, t in locals_.items()}
        return ShardedLeaf(meta.shape, meta.dtype.torch, spec, shards, placement)

    device_bytes = sum(locals_[r].numel() * locals_[r].element_size() for r in moved)
    return Dest(meta, spec, pieces, dict(locals_), finish, device_bytes, placement)
