"""Leaves held whole by the process: torch tensors (and Parameters) and numpy arrays.

In a single process such a leaf is the whole array, laid out as the spec tree says (one
piece if no spec); in a distributed save every rank holds it whole and it is written once
in total. A load fills a tensor or array of the stored shape and dtype; without a target
it makes one of the stored container.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pytreeckpt.core._dtypes import TORCH_NAMES, dtype_of_numpy, dtype_of_torch, numpy_view
from pytreeckpt.core._errors import CheckpointError, LayoutError, where
from pytreeckpt.core._per_rank import PER_RANK
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import Layout, Mesh, Piece, Replicate, ShardingSpec
from pytreeckpt.format import ArrayMeta, ValueMeta

from ._dests import full_dest, stored_for
from ._kind import SINGLE, ArrayIn, Describing, LeafKind, Matching
from ._sources import check_ndim, check_spec, check_tensor, layout_error, numpy_source, resolved, tensor_source

__all__ = ["NumpyKind", "TensorKind", "plain_in"]

PLAIN = (torch.Tensor, torch.nn.Parameter)

_WHOLE: dict[tuple[int, ...], tuple[Region, dict[int, tuple[Piece, ...]]]] = {}  # shape -> its region, pieces


def plain_in(key: str, leaf: torch.Tensor) -> ArrayIn:
    """A plain tensor in host memory saved by a single process: one piece, the whole tensor."""
    check_tensor(key, leaf)
    shape = tuple(leaf.shape)
    whole = _WHOLE.get(shape)
    if whole is None:
        if len(_WHOLE) >= 4096:  # (a bound: a process saving tensors of ever new shapes)
            _WHOLE.clear()
        region = Region.full(shape)
        whole = _WHOLE[shape] = (region, {0: (Piece(region, 0),)})
    region, pieces = whole  # (shared by the arrays of one shape: nothing changes them)
    view = numpy_view(resolved(leaf))

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        return view, region

    return ArrayIn(key, "torch", dtype_of_torch(leaf.dtype), shape, SINGLE, None, pieces, get, watch=(leaf,))


def _whole_in(
    key: str, container: str, data: Any, dtype: Any, shape: tuple[int, ...], spec: Any, d: Describing
) -> None:
    """A leaf the process holds whole: laid out by ``spec`` in a single process, else replicated on every rank."""
    comm = d.comm
    ranks: tuple[int, ...] | None = None
    replica = False
    if spec is PER_RANK:  # this rank's own: stored as its alone, written by it
        whole: Layout = SINGLE
        held: Any = (0,) if comm is None else (comm.rank,)
        ranks = None if comm is None else held
    elif comm is None:
        whole = spec if spec is not None else SINGLE
        held = range(whole.world_size)
    elif spec is None:
        whole = ShardingSpec(Mesh(comm.world), [Replicate()])  # every rank holds it whole: written once in total
        held, replica = (comm.rank,), True
    else:
        raise CheckpointError(
            f"leaf {where(key)}: in a distributed save a plain tensor is this rank's full copy; to save it sharded "
            f"wrap this rank's shard as ShardedLeaf(global_shape, dtype, spec, {{rank: shard}}) or use a DTensor"
        )
    pieces = {r: whole.pieces_of(0 if ranks else r, shape) for r in held}
    if isinstance(data, torch.Tensor):
        get, device = tensor_source(data, pieces)
        watch: tuple[torch.Tensor, ...] = (data,)
    else:
        get, device, watch = numpy_source(data, pieces), None, ()
    saved = None if spec is PER_RANK else spec
    d.array(
        ArrayIn(
            key,
            container,
            dtype,
            shape,
            whole,
            saved,
            pieces,
            get,
            device=device,
            watch=watch,
            ranks=ranks,
            replica=replica,
        )
    )


class TensorKind(LeafKind):
    """A torch tensor or Parameter (DTensors are a kind of their own, asked first)."""

    name = "tensor"
    container = "torch"

    def claims(self, t: type) -> bool:
        return issubclass(t, torch.Tensor)

    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        if d.comm is None and spec is None and type(leaf) in PLAIN and not leaf.is_cuda:
            d.array(plain_in(key, leaf))  # the common case, many thousand times per save: kept lean
            return
        if spec is not PER_RANK:
            check_spec(key, spec)
        try:
            check_tensor(key, leaf)
            _whole_in(key, "torch", leaf, dtype_of_torch(leaf.dtype), tuple(int(s) for s in leaf.shape), spec, d)
        except (LayoutError, ValueError) as e:
            raise layout_error(key, e) from None

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        if leaf is None:  # a load without a target: a new tensor as stored
            _as_stored(i, stored, m, torch_only=True)
            return
        small_whole = m.small_whole
        if (
            small_whole is not None
            and not m.inplace
            and type(leaf) in PLAIN
            and leaf.device.type == "cpu"
            and type(stored) is ArrayMeta
            and small_whole(stored)
            and tuple(leaf.shape) == stored.shape
            and stored.dtype.name in TORCH_NAMES
            and (leaf.dtype == stored.dtype.torch or (m.cast and m.castable(key, stored, dtype_of_torch(leaf.dtype))))
        ):
            m.small.append((i, stored, leaf))  # read straight from its archive, without a plan
            return
        array = stored_for(key, stored, leaf, m)
        if array is None:
            return
        m.dests.append((i, full_dest(array, False, leaf.device, leaf, m.comm, m.inplace, buffers=m.buffers)))


def _as_stored(i: int, stored: ArrayMeta | ValueMeta, m: Matching, *, torch_only: bool) -> None:
    """A stored array as a new leaf of its container: small whole ones read without a plan (a single process;
    for the torch container, of the dtypes torch has)."""
    assert isinstance(stored, ArrayMeta)
    small_whole = m.small_whole
    if small_whole is not None and small_whole(stored) and (not torch_only or stored.dtype.name in TORCH_NAMES):
        m.small.append((i, stored, None))
        return
    m.dests.append((i, full_dest(stored, stored.container == "numpy", None, None, m.comm, buffers=m.buffers)))


class NumpyKind(LeafKind):
    """A numpy array or scalar; also what any leaf of no other kind is taken as (what ``np.asarray`` makes of it)."""

    name = "numpy"
    container = "numpy"

    def claims(self, t: type) -> bool:
        return issubclass(t, (np.ndarray, np.generic))

    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        if spec is not PER_RANK:
            check_spec(key, spec)
        try:
            if isinstance(leaf, np.ma.MaskedArray):
                raise CheckpointError(
                    f"leaf {where(key)} is a numpy masked array, whose mask would be lost; save its data and "
                    f"mask as two arrays (leaf.data, np.ma.getmaskarray(leaf))"
                )
            arr = np.asarray(leaf)
            check_ndim(key, arr.ndim)
            _whole_in(key, "numpy", arr, dtype_of_numpy(arr.dtype), tuple(int(s) for s in arr.shape), spec, d)
        except (LayoutError, ValueError) as e:
            raise layout_error(key, e) from None

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        if leaf is None:  # a load without a target: a new numpy array as stored
            _as_stored(i, stored, m, torch_only=False)
            return
        array = m.stored_array(key, stored)
        if array is None:
            return
        arr = np.asarray(leaf)
        try:
            dtype_of_numpy(arr.dtype)
        except ValueError as e:
            m.problems.append(f"leaf {where(key)}: {e}")
            return
        fit = m.fitting(key, array, tuple(arr.shape), dtype_of_numpy(arr.dtype))
        if fit is None:
            return
        array = fit
        param = leaf if m.inplace else None
        m.dests.append((i, full_dest(array, True, None, param, m.comm, m.inplace, buffers=m.buffers)))
