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
from ._kind import ArrayIn, Buffers, Describing, Dest, LeafKind, Matching
from ._sources import check_ndim, check_spec, check_tensor, layout_error, shard_sources

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
            # In a single process (a process group of one rank) its mesh must be this rank alone.
            from pytreeckpt.distributed._dtensor import dtensor_layout

            layout, ranks, mine, own = dtensor_layout(leaf, comm)
            local = leaf.to_local()
            check_tensor(key, local)
            check_ndim(key, leaf.dim())
            shape = tuple(leaf.shape)
            pieces = {0 if comm is None else comm.rank: layout.pieces_of(mine, shape) if mine is not None else ()}
            get, device = shard_sources(dict.fromkeys(pieces, local), pieces)
            dtype = dtype_of_torch(leaf.dtype)
            d.array(
                ArrayIn(
                    key, "torch", dtype, shape, layout, own, pieces, get, device=device, watch=(local,), ranks=ranks
                )
            )
        except (LayoutError, ValueError) as e:
            raise layout_error(key, e) from None

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        array = stored_for(key, stored, leaf, m)
        if array is None:
            return
        try:
            m.dests.append((i, _dtensor_dest(array, leaf, m.comm, m.inplace, buffers=m.buffers)))
        except LayoutError as e:
            m.problems.append(f"leaf {where(key)}: {e}")


def _dtensor_dest(meta: ArrayMeta, leaf: Any, comm: Any, inplace: bool = False, *, buffers: Buffers) -> Dest:
    """This rank's local shard of a DTensor target, in the target's own mesh and placements.

    With ``inplace`` the reads land in the DTensor's own local tensor, and the result is ``leaf``.
    """
    from torch.distributed.tensor import DTensor

    from pytreeckpt.distributed._dtensor import dtensor_layout

    # (in a single process, a process group of one rank, its mesh must be this rank alone)
    layout, ranks, mine, _ = dtensor_layout(leaf, comm)
    me = 0 if comm is None else comm.rank
    pieces = {me: layout.pieces_of(mine, meta.shape) if mine is not None else ()}
    local_target = leaf.to_local()
    on_device = local_target.device.type != "cpu"
    if inplace:
        if fillable(local_target):
            return Dest(meta, layout, pieces, {me: local_target.detach()}, lambda: leaf, 0, ranks)
        staged = buffers.tensor(tuple(local_target.shape), meta.dtype.torch, local_target.is_cuda)

        def filled() -> Any:
            into(local_target, staged)
            return leaf

        moved = staged.numel() * staged.element_size() if on_device else 0
        return Dest(meta, layout, pieces, {me: staged}, filled, moved, ranks)
    local = buffers.tensor(tuple(local_target.shape), meta.dtype.torch, local_target.is_cuda)

    def finish() -> Any:
        return DTensor.from_local(
            local.to(local_target.device, non_blocking=True) if on_device else local,
            leaf.device_mesh,
            leaf.placements,
            run_check=False,
            shape=leaf.shape,
            stride=leaf.stride(),
        )

    moved = local.numel() * local.element_size() if on_device else 0
    return Dest(meta, layout, pieces, {me: local}, finish, moved, ranks)
