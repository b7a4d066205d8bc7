"""Where a load's reads land for a leaf held whole, and the pieces every destination shares."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from pytreeckpt.core._dtypes import dtype_of_torch
from pytreeckpt.core._errors import CheckpointError, where
from pytreeckpt.core._leaf import Abstract, ShardedLeaf
from pytreeckpt.core._sharding import Mesh, Replicate, ShardingSpec
from pytreeckpt.execute._memory import AllocationFailed
from pytreeckpt.format import ArrayMeta, ValueMeta

from ._kind import SINGLE, Buffers, Dest, Matching

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

__all__ = ["fillable", "full_dest", "into", "meta_problem", "naming_leaf", "small_result", "stored_for"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def fillable(t: torch.Tensor) -> bool:
    """Whether reads can land straight in tensor ``t``'s memory (else they land in a buffer copied into it)."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def into(target: torch.Tensor, buffer: torch.Tensor) -> None:
    """Copy a read buffer into the target tensor it stands for, in place (a Parameter's autograd aside)."""
    with torch.no_grad():
        target.copy_(buffer.to(target.device, non_blocking=True))


def small_result(meta: ArrayMeta, value: bytes, target: Any) -> Any:
    """A whole small array's result from its stored chunk (``meta.nbytes`` bytes of elements, checked).

    A new tensor (a Parameter for a Parameter target) of the target's dtype (cast to it, when
    the load casts), or a numpy array for the numpy container with no target. The bytes are
    copied with ``memmove``: a tensor a numpy view was ever taken of can no longer be
    resized, which a tensor torch itself loaded can.
    """
    if meta.container == "numpy" and target is None:
        return np.frombuffer(value, meta.dtype.numpy, math.prod(meta.shape)).reshape(meta.shape).copy()
    t = torch.empty(meta.shape, dtype=meta.dtype.torch)
    ctypes.memmove(t.data_ptr(), value, meta.nbytes)  # (the sizes agree: Storage.read_small checked the chunk's)
    if target is not None and target.dtype != t.dtype:  # load(..., cast=True): converted as Tensor.to does
        t = t.to(target.dtype)
    if target is not None and type(target) is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=target.requires_grad)
    return t


def naming_leaf(make: Callable[Concatenate[ArrayMeta, _P], _R]) -> Callable[Concatenate[ArrayMeta, _P], _R]:
    """``make(meta, ...)``, a buffer it cannot allocate said as a CheckpointError naming ``meta``'s leaf."""

    @functools.wraps(make)
    def named(meta: ArrayMeta, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return make(meta, *args, **kwargs)
        except AllocationFailed as e:
            raise CheckpointError(f"leaf {meta.key!r}: {e}") from e

    return named


def meta_problem(key: str, leaf: Any) -> str | None:
    """A target on the meta device has no memory to load into: refused, saying how to make some."""
    if isinstance(leaf, torch.Tensor):
        meta = leaf.is_meta
    else:
        shards = leaf.shards.values() if isinstance(leaf, ShardedLeaf) else ()
        meta = any(isinstance(t, torch.Tensor) and t.is_meta for t in shards)
    if meta:
        return (
            f"leaf {where(key)}: the target is a tensor on the meta device, which holds no data; materialise "
            f"the module with module.to_empty(device=...) first, or pass Abstract(shape, dtype) to get a new tensor"
        )
    return None


def stored_for(key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> ArrayMeta | None:
    """The stored array a target ``leaf`` of torch's kinds (a tensor, DTensor, ShardedLeaf or Abstract: its
    ``shape`` and torch ``dtype``) loads; None, the mismatch noted in ``m``, for a stored value, a target
    on the meta device, or another shape or dtype."""
    array = m.stored_array(key, stored)
    if array is None:
        return None
    if not isinstance(leaf, Abstract):  # (an Abstract holds no memory, on the meta device or elsewhere)
        problem = meta_problem(key, leaf)
        if problem is not None:
            m.problems.append(problem)
            return None
    shape, dtype = leaf.shape, dtype_of_torch(leaf.dtype)
    if array.shape != shape or array.dtype is not dtype:  # (compared at once: at thousands of leaves they agree)
        return m.fitting(key, array, tuple(shape), dtype)  # (another dtype: a stand-in to cast to, with cast=True)
    return array


@naming_leaf
def full_dest(
    meta: ArrayMeta,
    as_numpy: bool,
    device: torch.device | None,
    param: Any,
    comm: Comm | None = None,
    inplace: bool = False,
    *,
    buffers: Buffers,
) -> Dest:
    """A whole tensor: held by the one rank of a single process, or by every rank of a group.

    With ``inplace`` the reads land in ``param`` (the target tensor or numpy array) itself,
    or, where its memory cannot take them (a device, a non-contiguous view), in a buffer
    copied into it; the result is ``param``.
    """
    me = 0 if comm is None else comm.rank
    layout = SINGLE if comm is None else ShardingSpec(Mesh(comm.world), [Replicate()])
    pieces = {me: layout.pieces_of(me, meta.shape)}
    if as_numpy:
        if inplace and isinstance(param, np.ndarray):
            target = param
            if target.flags.c_contiguous and target.flags.writeable and target.dtype == meta.dtype.numpy:
                return Dest(meta, layout, pieces, {me: target}, lambda: target)
            buf = buffers.numpy(meta.shape, meta.dtype.numpy)

            def copied() -> Any:
                np.copyto(target, buf, casting="no")
                return target

            return Dest(meta, layout, pieces, {me: buf}, copied)
        arr = buffers.numpy(meta.shape, meta.dtype.numpy)
        return Dest(meta, layout, pieces, {me: arr}, lambda: arr)
    if inplace and isinstance(param, torch.Tensor):
        own = param
        if fillable(own):
            return Dest(meta, layout, pieces, {me: own.detach()}, lambda: own)
        staged = buffers.tensor(meta.shape, meta.dtype.torch, pinned=own.device.type == "cuda")

        def filled() -> Any:
            into(own, staged)
            return own

        moved = staged.numel() * staged.element_size() if own.device.type != "cpu" else 0
        return Dest(meta, layout, pieces, {me: staged}, filled, moved)
    on_device = device is not None and device.type != "cpu"
    t = buffers.tensor(meta.shape, meta.dtype.torch, pinned=device is not None and device.type == "cuda")

    def finish() -> Any:
        out = t.to(device, non_blocking=True) if on_device else t
        if isinstance(param, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=param.requires_grad)
        return out

    return Dest(meta, layout, pieces, {me: t}, finish, t.numel() * t.element_size() if on_device else 0)
