"""The distributed adapter: the only module that talks to other ranks.

It converts DTensors to and from pytreeckpt specs, gathers layouts once per save or
load, moves merge fragments to their chunk's writer, forwards replicated reads to the
other ranks that want them, and agrees on success before the commit.

All traffic runs on a process group of its own (gloo, over CPU tensors), never on the
user's default group, so a save running in a background thread cannot interleave its
collectives with the training loop's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ._errors import CheckpointError, LayoutError
from ._executor import PieceData
from ._plan import ArrayLoadPlan, ArraySavePlan, ReadOp
from ._region import Region
from ._sharding import Layout, Mesh, Piece, Placement, Replicate, Shard, ShardingSpec, StridedShard

__all__ = [
    "DistComm",
    "checkpoint_group",
    "dtensor_layout",
    "is_dtensor",
    "placements_from_spec",
    "spec_from_dtensor",
]

_GROUPS: dict[int, Any] = {}
_GROUPS_LOCK = threading.Lock()


def is_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def distributed_active(group: Any = None) -> bool:
    """True when this process is one rank of several in an initialised process group."""
    if group is not None:
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def checkpoint_group(group: Any = None) -> Any:
    """The process group for checkpoint traffic: ``group`` if given, else a gloo group of all ranks.

    The gloo group is made once (collectively, on first use) and reused.
    """
    if group is not None:
        return group
    key = id(dist.distributed_c10d._get_default_group())
    with _GROUPS_LOCK:
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(backend="gloo")
        return _GROUPS[key]


# --------------------------------------------------------------------------- DTensor


def _placement_of(p: Any) -> Placement:
    from torch.distributed.tensor.placement_types import Partial, _StridedShard
    from torch.distributed.tensor.placement_types import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import Shard as TShard

    if isinstance(p, _StridedShard):
        return StridedShard(p.dim, int(p.split_factor))
    if isinstance(p, TShard):
        return Shard(p.dim)
    if isinstance(p, TReplicate):
        return Replicate()
    if isinstance(p, Partial):
        raise LayoutError(
            f"a DTensor with a Partial placement ({p}) holds unreduced partial values; reduce it first "
            f"(dtensor.redistribute(placements=[Replicate()...])) before saving"
        )
    raise LayoutError(f"unsupported DTensor placement {p!r}")


def spec_from_dtensor(dt: Any) -> tuple[ShardingSpec, tuple[int, ...]]:
    """The spec of a DTensor and the global ranks of its mesh, in row-major mesh order."""
    mesh = dt.device_mesh
    names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
    spec = ShardingSpec(Mesh(tuple(mesh.shape), names), [_placement_of(p) for p in dt.placements])
    return spec, tuple(int(r) for r in mesh.mesh.flatten().tolist())


def placements_from_spec(spec: ShardingSpec) -> list[Any]:
    """DTensor placements equal to a spec's."""
    from torch.distributed.tensor.placement_types import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in spec.placements:
        if isinstance(p, StridedShard):
            out.append(_StridedShard(p.dim, split_factor=p.split_factor))
        elif isinstance(p, Shard):
            out.append(TShard(p.dim))
        else:
            out.append(TReplicate())
    return out


def dtensor_layout(dt: Any, world: int, group: Any) -> tuple[ShardingSpec, tuple[tuple[Piece, ...], ...]]:
    """A DTensor's spec and every rank's pieces, indexed by rank of ``group``."""
    spec, mesh_ranks = spec_from_dtensor(dt)
    by_position = spec.rank_pieces(tuple(dt.shape))
    pieces: list[tuple[Piece, ...]] = [() for _ in range(world)]
    for pos, global_rank in enumerate(mesh_ranks):
        pieces[_group_rank(group, global_rank)] = by_position[pos]
    return spec, tuple(pieces)


def _group_rank(group: Any, global_rank: int) -> int:
    r = dist.get_group_rank(group, global_rank)
    if r < 0:
        raise LayoutError(f"rank {global_rank} of a DTensor's mesh is not in the checkpoint process group")
    return int(r)


# --------------------------------------------------------------------------- communication


def _as_bytes(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class DistComm:
    """One rank's view of the checkpoint process group."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def global_rank(self, rank: int) -> int:
        return int(dist.get_global_rank(self.group, rank))

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Every rank raises if any rank failed; the message names the failed ranks."""
        errors = self.all_gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
            if error is not None and isinstance(error, CheckpointError) and len(failed) == 1:
                raise error
            raise CheckpointError(f"{what} failed on {len(failed)} of {self.world} ranks: {detail}") from error

    # ------------------------------------------------------------------ save
    def write_items(
        self, plans: Sequence[ArraySavePlan], data: Sequence[PieceData], dtypes: Sequence[np.dtype]
    ) -> Iterator[tuple[int, Region, np.ndarray]]:
        """This rank's writes: direct ones at once, merged ones once their fragments arrive.

        Fragments of merged chunks held by other ranks travel point to point to the
        chunk's writer; all sends and receives are posted first, so they overlap the
        direct writes.
        """
        me = self.rank
        sends: list[tuple[Any, torch.Tensor]] = []
        merged: list[tuple[int, Region, np.ndarray, list[tuple[Any, torch.Tensor, Region]]]] = []
        tag = 0
        for i, plan in enumerate(plans):
            for op in plan.writes:
                if op.is_direct:
                    continue
                buf = np.empty(op.region.shape, dtype=dtypes[i]) if op.writer == me else None
                pending: list[tuple[Any, torch.Tensor, Region]] = []
                for frag in op.sources:
                    tag += 1
                    if frag.rank == me:
                        src, where = data[i](me, frag.piece)
                        part = src[frag.region.relative_to(where).slices()]
                        if buf is not None:
                            buf[frag.region.relative_to(op.region).slices()] = part
                        else:
                            payload = _as_bytes(part)
                            work = dist.isend(payload, dst=self.global_rank(op.writer), group=self.group, tag=tag)
                            sends.append((work, payload))
                    elif buf is not None:
                        tmp = torch.empty(frag.region.size * dtypes[i].itemsize, dtype=torch.uint8)
                        work = dist.irecv(tmp, src=self.global_rank(frag.rank), group=self.group, tag=tag)
                        pending.append((work, tmp, frag.region.relative_to(op.region)))
                if buf is not None:
                    merged.append((i, op.region, buf, pending))
        for i, plan in enumerate(plans):
            for op in plan.writes:
                if op.is_direct and op.writer == me:
                    src, where = data[i](me, op.sources[0].piece)
                    yield i, op.region, src[op.region.relative_to(where).slices()]
        for i, region, buf, pending in merged:
            for work, tmp, rel in pending:
                work.wait()
                buf[rel.slices()] = tmp.numpy().view(buf.dtype).reshape(rel.shape)
            yield i, region, buf
        for work, _payload in sends:
            work.wait()

    # ------------------------------------------------------------------ load
    def read_forwarding(
        self, plans: Sequence[ArrayLoadPlan], dest: Sequence[PieceData], dtypes: Sequence[np.dtype]
    ) -> tuple[Callable[[int, ReadOp, np.ndarray], None], Callable[[], None]]:
        """Receives for regions other ranks read for this one, and sends for those it reads for others.

        Returns ``(after, finish)``: ``after`` is called by the executor when a region this
        rank read is in memory, and sends it on; ``finish`` waits for every transfer and
        copies received regions into place.
        """
        me = self.rank
        tags: dict[tuple[int, int, int], int] = {}
        recvs: list[tuple[Any, torch.Tensor, list[np.ndarray]]] = []
        tag = 0
        for i, plan in enumerate(plans):
            for j, op in enumerate(plan.reads):
                for rank in sorted({t.rank for t in op.targets} - {op.reader}):
                    tag += 1
                    tags[(i, j, rank)] = tag
                    if rank == me:
                        outs = []
                        for t in op.targets:
                            if t.rank == me:
                                view, where = dest[i](me, t.piece)
                                outs.append(view[t.region.relative_to(where).slices()])
                        tmp = torch.empty(op.region.size * dtypes[i].itemsize, dtype=torch.uint8)
                        work = dist.irecv(tmp, src=self.global_rank(op.reader), group=self.group, tag=tag)
                        recvs.append((work, tmp, outs))
        index = {(i, id(op)): j for i, plan in enumerate(plans) for j, op in enumerate(plan.reads)}
        sends: list[tuple[Any, torch.Tensor]] = []

        def after(i: int, op: ReadOp, data: np.ndarray) -> None:
            j = index[(i, id(op))]
            payload: torch.Tensor | None = None
            for rank in sorted({t.rank for t in op.targets} - {me}):
                payload = _as_bytes(data) if payload is None else payload
                work = dist.isend(payload, dst=self.global_rank(rank), group=self.group, tag=tags[(i, j, rank)])
                sends.append((work, payload))

        def finish() -> None:
            for work, tmp, outs in recvs:
                work.wait()
                for o in outs:
                    o[...] = tmp.numpy().view(o.dtype).reshape(o.shape)
            for work, _payload in sends:
                work.wait()

        return after, finish


def layout_fingerprint(key: str, dtype: str, shape: tuple[int, ...], layout: Layout) -> tuple[Any, ...]:
    """What every rank must agree on for one array."""
    return (key, dtype, shape, repr(layout.to_json()))
