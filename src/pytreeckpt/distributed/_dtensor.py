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

__all__ = ["dtensor_layout", "placements_from_spec", "placements_key", "spec_from_dtensor"]


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


def placements_key(placements: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key equal for equal DTensor placements, cheap to hash and compare (torch's own ``_StridedShard``
    hashes and compares in Python: a few microseconds a leaf, at thousands of leaves a save)."""
    kinds = _KEYED or _keyed()
    out: list[Any] = []
    for p in placements:
        k = kinds.get(type(p))
        if k is None:
            return placements  # (any other placement: compared as torch compares it)
        out.append(k if k == 2 else (k, p.dim, p._split_factor_int()) if k == 1 else (k, p.dim))
    return tuple(out)


_KEYED: dict[type, int] = {}


def _keyed() -> dict[type, int]:
    from torch.distributed.tensor.placement_types import Replicate as TReplicate
    from torch.distributed.tensor.placement_types import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    _KEYED.update({TShard: 0, _StridedShard: 1, TReplicate: 2})
    return _KEYED


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


def dtensor_layout(dt: Any, comm: Comm | None) -> tuple[ShardingSpec, Ranks, int | None, ShardingSpec]:
    """A DTensor's layout for planning, the rank in ``comm``'s group of each of its positions, this process's
    position (None off the mesh), and the DTensor's own spec (its mesh and placements).

    With ``comm`` None the save or load runs in this process alone: the mesh must be
    this rank alone, which is rank 0.

    All of it depends on the DTensor's mesh and placements only: what depends on the mesh
    is found once per mesh in a save or load, the spec once per mesh and placements (both
    kept by its communicator), so the DTensors of a model's layers share one layout object,
    as the planner's memos want, and a mesh of 16,384 ranks is walked once, not once per leaf.
    """
    mesh, placements = dt.device_mesh, tuple(dt.placements)
    if comm is None:
        for p in placements:
            _placement_of(p)  # (a Partial placement is refused before the mesh is looked at, as with a group)
        return _spec_on(_on_mesh(mesh, None), placements)
    comm = data_comm(comm, "a DTensor leaf")
    memo = comm.dtensor_layouts  # (the mesh is kept with what is found for it: its id names no other)
    key = (id(mesh), placements_key(placements))
    try:
        known = memo.get(key)
    except TypeError:  # (a placement that cannot be hashed: found for this leaf alone)
        return _spec_on(_on_mesh(mesh, comm), placements)
    if known is not None and known[0] is mesh:
        return known[1]  # type: ignore[no-any-return]
    on = memo.get((id(mesh),))
    if on is None or on[0] is not mesh:
        on = memo[(id(mesh),)] = (mesh, _on_mesh(mesh, comm))
    found = _spec_on(on[1], placements)
    # Equal specs are one object (the meshes of pipeline stages are alike), as the planner's memos want.
    spec, ranks, position, own = found
    spec = memo.setdefault(("spec", spec), (None, spec))[1]
    own = memo.setdefault(("spec", own), (None, own))[1]
    found = (spec, ranks, position, own)
    memo[key] = (mesh, found)
    return found


Ranks = range | tuple[int, ...] | None
"""The rank in the group of each position of a layout; None: position i is rank i."""

_OnMesh = tuple[Mesh, int, Ranks, int | None]
"""A DeviceMesh as planning sees it: its mesh, how many replicas of it hold the same tensors, the ranks in
the group of every position of the layout, and this rank's position (None: off the mesh)."""


def _on_mesh(device_mesh: Any, comm: DistComm | None) -> _OnMesh:
    mesh, mesh_ranks = _mesh_of(device_mesh)
    copies = 1
    if comm is not None:
        # A mesh sliced from a larger one (the "dp" axis of a dp x tp mesh) has replicas
        # (the other tp ranks' "dp" meshes) holding the same tensor: its layout is the
        # spec replicated over them. Every rank finds them from the root mesh alone.
        members = comm.members
        replicas = [r for r in _replicas(device_mesh) if members.issuperset(r)]
        if len(replicas) > 1 and mesh_ranks in replicas:
            copies = len(replicas)
            mesh_ranks = tuple(g for r in replicas for g in r)
    me = this_rank()
    position = mesh_ranks.index(me) if me in mesh_ranks else None  # (a rank off the mesh holds nothing of it)
    return mesh, copies, _group_ranks(comm, mesh_ranks), position


def _spec_on(on: _OnMesh, placements: tuple[Any, ...]) -> tuple[ShardingSpec, Ranks, int | None, ShardingSpec]:
    mesh, copies, ranks, position = on
    spec = own = ShardingSpec(mesh, [_placement_of(p) for p in placements])
    if copies > 1:
        spec = ShardingSpec(
            Mesh((copies, *mesh.shape), (_free_name(mesh.axis_names), *mesh.axis_names)),
            [Replicate(), *spec.placements],
        )
    return spec, ranks, position, own


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


def _group_ranks(comm: DistComm | None, mesh_ranks: tuple[int, ...]) -> Ranks:
    """The ranks in ``comm``'s group of the global ranks ``mesh_ranks``: None where position i is rank i, a
    ``range`` where they follow one another (so the planner takes them as it takes an ``Abstract``'s).

    Remembered per call: a model's DTensors share a few meshes.
    """
    if comm is None:
        if mesh_ranks == (this_rank(),):
            return None
        raise LayoutError(
            f"its DTensor mesh holds ranks {list(mesh_ranks)}, but this save or load runs on rank {this_rank()} "
            f"alone (a process group of one rank); pass a process_group holding the mesh's ranks, and call on "
            f"each of them"
        )
    if mesh_ranks in comm.mesh_ranks:
        return comm.mesh_ranks[mesh_ranks]
    in_group = comm.in_group
    try:
        listed = tuple(in_group[g] for g in mesh_ranks)
    except KeyError as e:
        raise LayoutError(f"rank {e.args[0]} of a DTensor's mesh is not in the checkpoint process group") from None
    found: Ranks = listed
    first = listed[0] if listed else 0
    if listed == tuple(range(first, first + len(listed))):
        found = None if first == 0 else range(first, first + len(listed))
    comm.mesh_ranks[mesh_ranks] = found
    return found
