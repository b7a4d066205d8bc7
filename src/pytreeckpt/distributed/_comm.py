"""The distributed adapter: the only module that talks to other ranks.

It converts DTensors to and from pytreeckpt specs, gathers layouts once per save or
load, moves merge fragments to their chunk's writer, forwards replicated reads to the
other ranks that want them, and agrees on success before the commit.

All traffic runs on a process group of its own (gloo, over CPU tensors), never on the
user's default group, so a save running in a background thread cannot interleave its
collectives with the training loop's. Those groups are destroyed when the program ends
(``atexit``), while the interpreter is whole: held here, they would otherwise outlive
the user's ``destroy_process_group()`` and have their gloo threads torn down during
interpreter finalisation.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from pytreeckpt.core._errors import CheckpointError, LayoutError, MetadataError, NotCommittedError, TargetMismatchError
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import Mesh, Placement, Replicate, Shard, ShardingSpec, StridedShard
from pytreeckpt.execute._executor import PieceData, WriteItem
from pytreeckpt.plan import ArrayLoadPlan, ArraySavePlan, ReadOp

__all__ = [
    "DistComm",
    "checkpoint_group",
    "distributed_comm",
    "dtensor_layout",
    "placements_from_spec",
    "spec_from_dtensor",
]

_GROUPS: dict[tuple[Any, ...], tuple[Any, Any]] = {}
_GROUPS_LOCK = threading.Lock()
_HOOKED: list[bool] = []  # release_groups is registered with atexit


@runtime_checkable
class Comm(Protocol):
    """What a save or load needs of its ranks: the object collectives of planning and agreement.

    :class:`DistComm` is the torch.distributed one. Another (``pytreeckpt.testing.SimComm``,
    one rank of a simulated world) may be passed as ``process_group`` to
    ``pytreeckpt.plan_save`` and ``pytreeckpt.plan_load``, which need nothing else.
    """

    rank: int
    world: int

    def gather(self, obj: Any) -> list[Any]: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def agree(self, error: BaseException | None, what: str) -> None: ...


def data_comm(comm: Comm, what: str) -> DistComm:
    """``comm`` as the torch.distributed communicator that moves data and maps meshes to ranks.

    Another :class:`Comm` (a simulated world) plans only the leaves every rank describes
    by a spec (``ShardedLeaf``, ``Abstract``), and moves no data.

    Raises:
      CheckpointError: ``comm`` is not a :class:`DistComm`.
    """
    if not isinstance(comm, DistComm):
        raise CheckpointError(
            f"{what} needs a torch.distributed process group; {type(comm).__name__} only plans leaves described "
            f"by a spec (ShardedLeaf, Abstract) and moves no data"
        )
    return comm


def distributed_comm(group: Any = None) -> Comm | None:
    """The DistComm of a save or load, or None when it runs as a single process.

    A save or load is distributed when torch.distributed is initialised (at any world
    size) or ``group`` is given; its ranks are those of ``group``, else of the default
    group. With one rank there is nobody to talk to: no gloo group is made, no
    collective is issued, and the call runs as a single process does, DTensors on a mesh
    of this one rank included.

    Raises:
      CheckpointError: this process is not a member of ``group``.
    """
    if isinstance(group, Comm):
        return group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
    elif len(group_ranks(group)) == 1:
        return None
    return DistComm(checkpoint_group(group))


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group given by the caller, this process among them."""
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError("a process_group was given but torch.distributed is not initialised")
    try:
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"process_group {group!r} is not a process group of this process: {e}") from e
    if dist.get_rank() not in ranks:
        raise CheckpointError(
            f"rank {dist.get_rank()} is not a member of the process_group given (its ranks are {list(ranks)}): "
            f"only its members save or load with it"
        )
    return ranks


def this_rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


# Point-to-point tags start high: gloo's collectives number their own messages from 0
# on a group, and a send with a small tag can be taken for one of them.
_TAG_BASE = 1 << 20


def checkpoint_group(group: Any = None) -> tuple[Any, Any]:
    """The process groups for checkpoint traffic: one for collectives, one for fragment transfers.

    With ``group`` given, its ranks are used. The gloo groups are made once
    (collectively, on first use) and reused; keeping point-to-point transfers on a
    group of their own means no collective can ever match one of their messages.
    Groups of the whole world are made by every rank; a group of some ranks only (a
    pipeline stage, a data-parallel replica) by its members alone, so the other ranks
    need not take part, and may make their own.
    """
    ranks = None if group is None else group_ranks(group)
    if ranks is not None and len(ranks) == dist.get_world_size():
        ranks = None
    key = (id(dist.distributed_c10d._get_default_group()), ranks)
    with _GROUPS_LOCK:
        if key not in _GROUPS or not all(_alive(g) for g in _GROUPS[key]):
            # (a group of a destroyed world is remade: a new default group may reuse the old one's id)
            if ranks is None:
                _GROUPS[key] = (dist.new_group(None, backend="gloo"), dist.new_group(None, backend="gloo"))
            else:
                _check_group_history(group, ranks)
                members = list(ranks)
                _GROUPS[key] = (
                    dist.new_group(members, backend="gloo", use_local_synchronization=True),
                    dist.new_group(members, backend="gloo", use_local_synchronization=True),
                )
            if not _HOOKED:
                _HOOKED.append(True)
                atexit.register(release_groups)
        return _GROUPS[key]


def _check_group_history(group: Any, ranks: tuple[int, ...]) -> None:
    """Refuse, rather than hang, when the members of ``group`` cannot make a group together.

    torch names a group made by its members alone after its ranks and the number of
    groups each member has made so far; members that made different numbers of groups
    would wait for each other under different names until the rendezvous timeout.
    """
    made = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if made is None:  # another torch: nothing to check with
        return
    counts: list[Any] = [None] * len(ranks)
    dist.all_gather_object(counts, len(made), group=group)
    if len(set(counts)) > 1:
        detail = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts, strict=True))
        raise CheckpointError(
            f"the ranks of process_group have made different numbers of process groups ({detail}), so torch "
            f"cannot name the checkpoint's gloo groups alike on all of them; make process groups in the same "
            f"order on every member, or pass no process_group (the whole world)"
        )


def release_groups() -> None:
    """Destroy the checkpoint process groups (at exit): their gloo threads end while Python is whole.

    Runs after Python has joined every non-daemon thread (an asynchronous save's writer
    included), so no checkpoint traffic is left. A group the user's
    ``destroy_process_group()`` already shut down is only let go; one still registered
    is destroyed. Later saves and loads make new groups.
    """
    with _GROUPS_LOCK:
        groups = [g for pair in _GROUPS.values() for g in pair]
        _GROUPS.clear()
    while groups:
        g = groups.pop()
        if _alive(g):
            with contextlib.suppress(ValueError, RuntimeError):  # gone with its world meanwhile
                dist.destroy_process_group(g)
        del g  # the last reference: the group's destructor joins its threads now


def _alive(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


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
    """The spec of a DTensor and the global ranks of its mesh, in row-major mesh order.

    Raises:
      LayoutError: for a ``Partial`` placement (unreduced values cannot be saved).
    """
    mesh, ranks = _mesh_of(dt.device_mesh)
    return ShardingSpec(mesh, [_placement_of(p) for p in dt.placements]), ranks


_MESHES: weakref.WeakKeyDictionary[Any, tuple[Mesh, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def _mesh_of(device_mesh: Any) -> tuple[Mesh, tuple[int, ...]]:
    """A DeviceMesh as a Mesh, and its global ranks in row-major order.

    Remembered per mesh: torch rebuilds ``DeviceMesh.mesh`` at every access (0.1-1 ms),
    which a state of thousands of DTensors on one mesh would pay for each.
    """
    try:
        return _MESHES[device_mesh]
    except (KeyError, TypeError):
        pass
    names = device_mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(device_mesh.ndim))
    found = (Mesh(tuple(device_mesh.shape), names), tuple(int(r) for r in device_mesh.mesh.flatten().tolist()))
    with contextlib.suppress(TypeError):  # (a mesh that cannot be weakly referenced is not remembered)
        _MESHES[device_mesh] = found
    return found


def placements_from_spec(spec: ShardingSpec) -> list[Any]:
    """DTensor placements equal to a spec's, e.g. to ``distribute_tensor`` a loaded tensor.

    >>> from pytreeckpt import Mesh, Shard, ShardingSpec, StridedShard
    >>> placements_from_spec(ShardingSpec(Mesh((2, 2)), [StridedShard(0, 2), Shard(0)]))
    [_StridedShard(dim=0, sf=2), Shard(dim=0)]
    """
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


def dtensor_layout(dt: Any, comm: Comm | None) -> tuple[ShardingSpec, tuple[int, ...], int | None, ShardingSpec]:
    """A DTensor's layout for planning, the rank in ``comm``'s group of each of its positions, this process's
    position (None off the mesh), and the DTensor's own spec (its mesh and placements).

    With ``comm`` None the save or load runs in this process alone: the mesh must be
    this rank alone, which is rank 0.
    """
    spec, mesh_ranks = spec_from_dtensor(dt)
    own = spec
    if comm is not None:
        comm = data_comm(comm, "a DTensor leaf")
        # A mesh sliced from a larger one (the "dp" axis of a dp x tp mesh) has replicas
        # (the other tp ranks' "dp" meshes) holding the same tensor: its layout is the
        # spec replicated over them. Every rank finds them from the root mesh alone.
        replicas = [r for r in _replicas(dt.device_mesh) if all(g in comm.members for g in r)]
        if len(replicas) > 1 and mesh_ranks in replicas:
            mesh = spec.mesh
            spec = ShardingSpec(
                Mesh((len(replicas), *mesh.shape), (_free_name(mesh.axis_names), *mesh.axis_names)),
                [Replicate(), *spec.placements],
            )
            mesh_ranks = tuple(g for r in replicas for g in r)
    me = this_rank()
    position = mesh_ranks.index(me) if me in mesh_ranks else None  # (a rank off the mesh holds nothing of it)
    return spec, _group_ranks(comm, mesh_ranks), position, own


_REPLICAS: weakref.WeakKeyDictionary[Any, list[tuple[int, ...]]] = weakref.WeakKeyDictionary()


def _replicas(device_mesh: Any) -> list[tuple[int, ...]]:
    """The global ranks of every mesh sliced like ``device_mesh`` from its root mesh (itself among them).

    Uses torch's mesh layouts (``DeviceMesh._layout``, torch >= 2.9); with an older torch
    only the mesh itself is known, and a tensor on a sliced mesh must be saved with a
    process group of that mesh's ranks.
    """
    try:
        return _REPLICAS[device_mesh]
    except (KeyError, TypeError):
        pass
    try:
        table = device_mesh._layout.remap_to_tensor(device_mesh._rank_map)
        found = [tuple(int(g) for g in row.flatten().tolist()) for row in table.reshape(table.shape[0], -1)]
    except AttributeError:
        found = [_mesh_of(device_mesh)[1]]
    with contextlib.suppress(TypeError):
        _REPLICAS[device_mesh] = found
    return found


def _free_name(names: Sequence[str]) -> str:
    name = "replicas"
    while name in names:
        name = "_" + name
    return name


def _group_ranks(comm: DistComm | None, mesh_ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks in ``comm``'s group of the global ranks ``mesh_ranks``.

    Remembered per call: a model's DTensors share a few meshes.
    """
    if comm is None:
        if mesh_ranks == (this_rank(),):
            return (0,)
        raise LayoutError(
            f"its DTensor mesh holds ranks {list(mesh_ranks)}, but this save or load runs on rank {this_rank()} "
            f"alone (a process group of one rank); pass a process_group holding the mesh's ranks, and call on "
            f"each of them"
        )
    found = comm.mesh_ranks.get(mesh_ranks)
    if found is None:
        out = []
        for global_rank in mesh_ranks:
            r = dist.get_group_rank(comm.group, global_rank)
            if r < 0:
                raise LayoutError(f"rank {global_rank} of a DTensor's mesh is not in the checkpoint process group")
            out.append(int(r))
        found = comm.mesh_ranks[mesh_ranks] = tuple(out)
    return found


# --------------------------------------------------------------------------- communication


def _as_bytes(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class DistComm:
    """One rank's view of the checkpoint process group."""

    def __init__(self, groups: tuple[Any, Any]) -> None:
        self.group, self.p2p = groups
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.mesh_ranks: dict[tuple[int, ...], tuple[int, ...]] = {}  # global ranks of a mesh -> ranks in the group
        self.members = frozenset(int(g) for g in dist.get_process_group_ranks(self.group))  # global ranks

    def global_rank(self, rank: int) -> int:
        return int(dist.get_global_rank(self.group, rank))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on rank 0 (other ranks get an empty list)."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self.global_rank(0), group=self.group)
        return out if out is not None else []

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Every rank raises the same error if any rank failed; the message names the failed ranks.

        The error is of the failed ranks' CheckpointError subclass when they share one;
        on a rank that failed it is chained to that rank's own error.
        """
        gathered = self.gather(describe_failure(error))  # on rank 0; its verdict to every rank
        failed = self.broadcast([(r, e) for r, e in enumerate(gathered) if e is not None] if self.rank == 0 else None)
        if failed:
            raise failure(what, failed, self.world) from error

    # ------------------------------------------------------------------ save
    def post_write_transfers(
        self,
        plans: Sequence[ArraySavePlan],
        data: Sequence[PieceData],
        dtypes: Sequence[np.dtype],
        direct: bool = True,
    ) -> WriteTransfers:
        """Post every send and receive of merge fragments at once, before any write.

        With ``direct=False`` the transfers yield only the merged writes (the direct
        ones come from the staging pipeline).

        Fragments of a merged chunk held by other ranks travel point to point to the
        chunk's writer, overlapping the direct writes. Every posted receive is always
        matched: a rank that cannot read a fragment of its own still sends that many
        bytes (and reports its error), so no rank waits forever and no stale receive
        is left on the group.
        """
        me = self.rank
        t = WriteTransfers()
        tags = _PairTags()
        for i, plan in enumerate(plans):
            for op in plan.writes:
                if op.is_direct:
                    continue
                buf = np.empty(op.region.shape, dtype=dtypes[i]) if op.writer == me else None
                pending: list[tuple[Any, torch.Tensor, Region]] = []
                for frag in op.sources:
                    tag = tags.next(frag.rank, op.writer)
                    if frag.rank == me:
                        try:
                            src, where = data[i](me, frag.piece)
                            part = src[frag.region.relative_to(where).slices()]
                        except Exception as e:
                            t.error = t.error or e
                            part = np.zeros(frag.region.shape, dtype=dtypes[i])
                        if buf is not None:
                            buf[frag.region.relative_to(op.region).slices()] = part
                        else:
                            payload = _as_bytes(part)
                            work = dist.isend(payload, dst=self.global_rank(op.writer), group=self.p2p, tag=tag)
                            t.sends.append((work, payload))
                    elif buf is not None:
                        tmp = torch.empty(frag.region.size * dtypes[i].itemsize, dtype=torch.uint8)
                        work = dist.irecv(tmp, src=self.global_rank(frag.rank), group=self.p2p, tag=tag)
                        pending.append((work, tmp, frag.region.relative_to(op.region)))
                if buf is not None:
                    t.merged.append((i, op.region, buf, pending))
        for i, plan in enumerate(plans):
            for op in plan.writes:
                if direct and op.is_direct and op.writer == me:
                    t.direct.append((i, op, data[i]))
        return t

    # ------------------------------------------------------------------ load
    def read_forwarding(
        self, plans: Sequence[ArrayLoadPlan], dest: Sequence[PieceData], dtypes: Sequence[np.dtype]
    ) -> tuple[Callable[[int, ReadOp, np.ndarray], None], Callable[[], None]]:
        """Receives for regions other ranks read for this one, and sends for those it reads for others.

        Returns ``(after, finish)``: ``after`` is called by the executor when a region this
        rank read is in memory, and sends it on; ``finish`` sends whatever was not sent
        (after a failed read: the receivers must not wait forever; every rank learns of
        the failure and discards the data), waits for every transfer, and copies received
        regions into place.
        """
        me = self.rank
        tags: dict[tuple[int, int, int], int] = {}
        recvs: list[tuple[Any, torch.Tensor, list[np.ndarray]]] = []
        pairs = _PairTags()
        for i, plan in enumerate(plans):
            for j, op in enumerate(plan.reads):
                for rank in sorted({t.rank for t in op.targets} - {op.reader}):
                    tag = tags[(i, j, rank)] = pairs.next(op.reader, rank)
                    if rank == me:
                        outs = []
                        for t in op.targets:
                            if t.rank == me:
                                view, where = dest[i](me, t.piece)
                                outs.append(view[t.region.relative_to(where).slices()])
                        tmp = torch.empty(op.region.size * dtypes[i].itemsize, dtype=torch.uint8)
                        work = dist.irecv(tmp, src=self.global_rank(op.reader), group=self.p2p, tag=tag)
                        recvs.append((work, tmp, outs))
        index = {(i, id(op)): j for i, plan in enumerate(plans) for j, op in enumerate(plan.reads)}
        sends: list[tuple[Any, torch.Tensor]] = []
        sent: set[tuple[int, int]] = set()

        def send(i: int, j: int, op: ReadOp, data: np.ndarray) -> None:
            sent.add((i, j))
            payload: torch.Tensor | None = None
            for rank in sorted({t.rank for t in op.targets} - {me}):
                payload = _as_bytes(data) if payload is None else payload
                work = dist.isend(payload, dst=self.global_rank(rank), group=self.p2p, tag=tags[(i, j, rank)])
                sends.append((work, payload))

        def after(i: int, op: ReadOp, data: np.ndarray) -> None:
            send(i, index[(i, id(op))], op, data)

        def finish() -> None:
            for i, plan in enumerate(plans):
                for j, op in enumerate(plan.reads):
                    if op.reader == me and (i, j) not in sent and any(t.rank != me for t in op.targets):
                        send(i, j, op, np.zeros(op.region.shape, dtype=dtypes[i]))
            for work, tmp, outs in recvs:
                work.wait()
                for o in outs:
                    o[...] = tmp.numpy().view(o.dtype).reshape(o.shape)
            for work, _payload in sends:
                work.wait()

        return after, finish


class _PairTags:
    """Tags of point-to-point messages, numbered per (sender, receiver) pair in plan order.

    Each rank plans only its own part, so the two ends of a message number it alike only
    by counting the messages between them: both see those in the same order (arrays in
    order, each array's operations in the order of the whole plan).
    """

    def __init__(self) -> None:
        self._count: dict[tuple[int, int], int] = {}

    def next(self, sender: int, receiver: int) -> int:
        n = self._count.get((sender, receiver), 0) + 1
        self._count[(sender, receiver)] = n
        return _TAG_BASE + n


class WriteTransfers:
    """The merge-fragment transfers of one rank's save, posted up front."""

    def __init__(self) -> None:
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.merged: list[tuple[int, Region, np.ndarray, list[tuple[Any, torch.Tensor, Region]]]] = []
        self.direct: list[tuple[int, Any, PieceData]] = []
        self.error: BaseException | None = None
        self.received = 0

    def items(self) -> Iterator[WriteItem]:
        """This rank's writes: direct ones at once, merged ones as their fragments arrive."""
        if self.error is not None:
            raise self.error
        for i, op, get in self.direct:
            src, where = get(op.writer, op.sources[0].piece)
            yield i, op.region, src[op.region.relative_to(where).slices()], None
        for i, region, buf, pending in self.merged:
            while pending:
                work, tmp, rel = pending.pop(0)  # a gloo work is waited on once only
                work.wait()
                buf[rel.slices()] = tmp.numpy().view(buf.dtype).reshape(rel.shape)
                self.received += tmp.numel()
            yield i, region, buf, None

    def received_bytes(self) -> int:
        """Bytes of merge fragments received from other ranks so far, and still pending."""
        return self.received + sum(tmp.numel() for _, _, _, pending in self.merged for _, tmp, _ in pending)

    def wait_all(self) -> None:
        """Complete every posted transfer not yet completed, whatever happened to the writes."""
        for _, _, _, pending in self.merged:
            while pending:
                pending.pop(0)[0].wait()
        while self.sends:
            self.sends.pop(0)[0].wait()


_ERRORS: dict[str, type[CheckpointError]] = {
    c.__name__: c for c in (CheckpointError, NotCommittedError, MetadataError, TargetMismatchError, LayoutError)
}


def describe_failure(error: BaseException | None) -> tuple[str, str] | None:
    """What a rank tells the others of its error: the type's name and the message."""
    return None if error is None else (type(error).__name__, str(error))


def failure(what: str, failed: Sequence[tuple[int, tuple[str, str]]], world: int) -> CheckpointError:
    """The one error every rank raises when ``failed`` ranks (rank, (type name, message)) failed at ``what``.

    >>> str(failure("writing", [(1, ("OSError", "disk full")), (3, ("OSError", "disk full"))], 4))
    'writing failed on 2 of 4 ranks: ranks 1, 3: OSError: disk full'
    """
    by_error: dict[tuple[str, str], list[int]] = {}
    for rank, (kind, message) in failed:
        by_error.setdefault((kind, message), []).append(rank)
    detail = "; ".join(f"{_ranks_text(ranks)}: {kind}: {message}" for (kind, message), ranks in by_error.items())
    kinds = {kind for kind, _ in by_error}
    cls = _ERRORS.get(kinds.pop(), CheckpointError) if len(kinds) == 1 else CheckpointError
    return cls(f"{what} failed on {len(failed)} of {world} ranks: {detail}")


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
