"""torch.distributed DTensors: laid out by their mesh and placements, each rank holding its local shard.

Recognised by their type's name and module, so that a process that never imports
torch.distributed does not import it here; the translation to and from the library's
specs is :mod:`pytreeckpt.distributed`'s.
"""

from __future__ import annotations

from typing import Any

from pytreeckpt.core._dtypes import dtype_of_torch
from pytreeckpt.core._errors import LayoutError, where
from pytreeckpt.format import ArrayMeta, ValueMeta

from ._dests import fillable, into, stored_for
from ._kind import Buffers, Describing, Dest, LeafKind, Matching, array_in_of, dest_of
from ._sources import check_spec, check_tensor, layout_error, shard_sources

__all__ = ["DTensorKind"]


class DTensorKind(LeafKind):
    """A DTensor: this rank's local shard of a global tensor on a device mesh."""

    name = "dtensor"

    def claims(self, t: type) -> bool:
        return t.__name__ == "DTensor" and t.__module__.startswith("torch.distributed")

    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        check_spec(key, spec)
        comm = d.comm
        try:
            local = leaf.to_local()
            check_tensor(key, local)
            dist = _DIST or _distributed()
            mesh = leaf.device_mesh
            # What DTensors of one mesh, placements, shape and dtype share (a model's layers do): found once.
            kind = (id(mesh), dist.placements_key(leaf.placements), leaf.shape, leaf.dtype)
            got = d.kinds.get(kind)
            if got is None or got[0] is not mesh:
                # In a single process (a process group of one rank) its mesh must be this rank alone.
                layout, ranks, mine, own = dist.dtensor_layout(leaf, comm)
                shape = tuple(leaf.shape)
                me = 0 if comm is None else comm.rank
                pieces = {me: layout.pieces_of(mine, shape) if mine is not None else ()}
                got = d.kinds[kind] = (mesh, layout, own, ranks, pieces, dtype_of_torch(leaf.dtype), shape, me)
            _, layout, own, ranks, pieces, dtype, shape, me = got
            get, device = shard_sources({me: local}, pieces)
            d.array(
                array_in_of(key, "torch", dtype, shape, layout, own, pieces, get, None, device, (local,), ranks, False)
            )
        except (LayoutError, ValueError) as e:
            raise layout_error(key, e) from None

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        array = stored_for(key, stored, leaf, m)
        if array is None:
            return
        try:
            m.dests.append((i, _dtensor_dest(array, leaf, m.comm, m.inplace, buffers=m.buffers, kinds=m.kinds)))
        except LayoutError as e:
            m.problems.append(f"leaf {where(key)}: {e}")


_DIST: Any = None  # pytreeckpt.distributed._dtensor, once a DTensor is met (torch.distributed is imported by then)


def _distributed() -> Any:
    global _DIST
    from pytreeckpt.distributed import _dtensor

    _DIST = _dtensor
    return _dtensor


def _dtensor_dest(
    meta: ArrayMeta, leaf: Any, comm: Any, inplace: bool = False, *, buffers: Buffers, kinds: dict[Any, Any]
) -> Dest:
    """This rank's local shard of a DTensor target, in the target's own mesh and placements.

    With ``inplace`` the reads land in the DTensor's own local tensor, and the result is ``leaf``.
    ``kinds`` (one per load) keeps what targets of one mesh, placements and shape share.
    """
    dist = _DIST or _distributed()
    mesh = leaf.device_mesh
    kind = (id(mesh), dist.placements_key(leaf.placements), meta.shape)
    got = kinds.get(kind)
    if got is None or got[0] is not mesh:
        # (in a single process, a process group of one rank, its mesh must be this rank alone)
        layout, ranks, mine, _ = dist.dtensor_layout(leaf, comm)
        me = 0 if comm is None else comm.rank
        pieces = {me: layout.pieces_of(mine, meta.shape) if mine is not None else ()}
        got = kinds[kind] = (mesh, layout, ranks, pieces, me)
    _, layout, ranks, pieces, me = got
    local_target = leaf.to_local()
    on_device = local_target.device.type != "cpu"
    if inplace:
        if fillable(local_target):
            made: Dest = dest_of(meta, layout, pieces, {me: local_target.detach()}, lambda: leaf, 0, ranks, None)
            return made
        staged = buffers.tensor(tuple(local_target.shape), meta.dtype.torch, local_target.is_cuda)

        def filled() -> Any:
            into(local_target, staged)
            return leaf

        moved = staged.numel() * staged.element_size() if on_device else 0
        made = dest_of(meta, layout, pieces, {me: staged}, filled, moved, ranks, None)
        return made
    local = buffers.tensor(tuple(local_target.shape), meta.dtype.torch, local_target.is_cuda)

    def finish() -> Any:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local.to(local_target.device, non_blocking=True) if on_device else local,
            leaf.device_mesh,
            leaf.placements,
            run_check=False,
            shape=leaf.shape,
            stride=leaf.stride(),
        )

    moved = local.numel() * local.element_size() if on_device else 0
    made = dest_of(meta, layout, pieces, {me: local}, finish, moved, ranks, None)
    return made
