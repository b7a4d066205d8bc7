"""DTensors as pytreeckpt specs and back, and the ranks of a DTensor's mesh in the checkpoint's group."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

from pytreeckpt.core._errors import LayoutError
from pytreeckpt.core._sharding import Mesh, Placement, Replicate, Shard, ShardingSpec, StridedShard
from pytreeckpt.distributed._comm import Comm, DistComm, data_comm
from pytreeckpt.distributed._groups import this_rank

__all__ = ["dtensor_layout", "placements_from_spec", "spec_from_dtensor"]


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

    All of it depends on the DTensor's mesh and placements only: it is found once per
    mesh and placements in a save or load (kept by its communicator), so the DTensors of a
    model's layers share one layout object, as the planner's memos want, and a mesh of
    16,384 ranks is walked once, not once per leaf.
    """
    if comm is None:
        return _layout(dt.device_mesh, tuple(dt.placements), None)
    comm = data_comm(comm, "a DTensor leaf")
    mesh, placements = dt.device_mesh, tuple(dt.placements)
    key = (id(mesh), placements)
    try:
        known = comm.dtensor_layouts.get(key)
    except TypeError:  # (a placement that cannot be hashed: found for this leaf alone)
        return _layout(mesh, placements, comm)
    if known is not None and known[0] is mesh:  # (the mesh is kept with it: its id names no other)
        return known[1]  # type: ignore[no-any-return]
    found = _layout(mesh, placements, comm)
    comm.dtensor_layouts[key] = (mesh, found)
    return found


def _layout(
    device_mesh: Any, placements: tuple[Any, ...], comm: DistComm | None
) -> tuple[ShardingSpec, tuple[int, ...], int | None, ShardingSpec]:
    mesh_of, mesh_ranks = _mesh_of(device_mesh)
    spec = own = ShardingSpec(mesh_of, [_placement_of(p) for p in placements])
    if comm is not None:
        # A mesh sliced from a larger one (the "dp" axis of a dp x tp mesh) has replicas
        # (the other tp ranks' "dp" meshes) holding the same tensor: its layout is the
        # spec replicated over them. Every rank finds them from the root mesh alone.
        replicas = [r for r in _replicas(device_mesh) if all(g in comm.members for g in r)]
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
        in_group = comm.in_group
        try:
            found = tuple(in_group[g] for g in mesh_ranks)
        except KeyError as e:
            raise LayoutError(f"rank {e.args[0]} of a DTensor's mesh is not in the checkpoint process group") from None
        comm.mesh_ranks[mesh_ranks] = found
    return found
