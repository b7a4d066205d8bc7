"""What a save reads a leaf's pieces from: checks of a tensor's storability, and getters of its pieces in memory."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pytreeckpt.core._dtypes import numpy_view
from pytreeckpt.core._errors import CheckpointError, LayoutError, where
from pytreeckpt.core._leaf import piece_view
from pytreeckpt.core._per_rank import PER_RANK
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import Layout, Piece
from pytreeckpt.execute._executor import PieceData
from pytreeckpt.format import MAX_NDIM

__all__ = [
    "check_ndim",
    "check_spec",
    "check_tensor",
    "global_source",
    "layout_error",
    "no_data",
    "numpy_source",
    "plain_data",
    "resolved",
    "shard_sources",
    "tensor_source",
]


def global_source(arr: np.ndarray, pieces: Mapping[int, tuple[Piece, ...]]) -> PieceData:
    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        region = pieces[rank][pi].region
        return arr[region.slices()], region

    return get


def numpy_source(arr: np.ndarray, pieces: Mapping[int, tuple[Piece, ...]]) -> PieceData:
    """Getters of the pieces of a numpy array held whole, in the machine's byte order.

    Every path after this one (the staging copy, chunk files, TensorStore, chunk hashes)
    takes an array's elements as native integers or floats, so an array of the other
    byte order (``>f4`` on a little-endian machine) is converted here, once, when its
    data is first asked for.
    """
    if arr.dtype.isnative:
        return global_source(arr, pieces)
    native: list[PieceData] = []
    lock = threading.Lock()

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        with lock:
            if not native:
                native.append(global_source(arr.astype(arr.dtype.newbyteorder("=")), pieces))
        return native[0](rank, pi)

    return get


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its conjugate and negative bits applied (a copy only if one is set): what numpy can view."""
    if t.is_conj() or t.is_neg():  # (asking is half the cost of two resolve calls that return t)
        return t.resolve_conj().resolve_neg()
    return t


def check_spec(key: str, spec: Any) -> None:
    """Refuse a spec tree's leaf that is not a layout."""
    if spec is PER_RANK:
        raise CheckpointError(
            f"leaf {where(key)}: PER_RANK marks state each rank holds whole for itself (a tensor, a numpy array, a "
            f"value); this leaf is sharded across ranks already (its shards are each rank's own)"
        )
    if spec is not None and not isinstance(spec, Layout):
        raise CheckpointError(
            f"spec for leaf {where(key)} must be a ShardingSpec, FlatRanges, ExplicitRegions or None, found {spec!r}"
        )


def check_tensor(key: str, t: torch.Tensor) -> None:
    """Refuse, naming the leaf, a tensor whose elements cannot be stored as one dense array."""
    if not (t.is_meta or t.is_nested or t.layout != torch.strided or t.is_quantized):
        check_ndim(key, t.dim())
        return
    at = where(key)
    if t.is_meta:
        raise CheckpointError(
            f"leaf {at} is a tensor on the meta device, which holds no data to save; materialise it first "
            f"(module.to_empty(device=...) and initialise or load its values)"
        )
    if t.is_nested:
        raise CheckpointError(f"leaf {at} is a nested tensor, which cannot be stored; save t.unbind()")
    if t.layout != torch.strided:
        raise CheckpointError(
            f"leaf {at} is a tensor of layout {t.layout}, which cannot be stored; save t.to_dense(), or "
            f"its indices and values as tensors of their own"
        )
    if t.is_quantized:
        raise CheckpointError(
            f"leaf {at} is a quantized tensor (dtype {t.dtype}), which cannot be stored; save "
            f"t.dequantize(), or t.int_repr() with its scale and zero point"
        )
    check_ndim(key, t.dim())


def check_ndim(key: str, ndim: int) -> None:
    if ndim > MAX_NDIM:
        raise CheckpointError(
            f"leaf {where(key)} has {ndim} dims; a stored array has at most {MAX_NDIM} (the zarr v3 arrays "
            f"TensorStore opens); reshape it before saving"
        )


def layout_error(key: str, e: Exception) -> Exception:
    """A LayoutError or ValueError met describing leaf ``key``, as the LayoutError naming it (others as they are)."""
    if isinstance(e, CheckpointError) and not isinstance(e, LayoutError):
        return e
    return LayoutError(f"leaf {where(key)}: {e}")


def shard_sources(shards: Mapping[int, torch.Tensor], pieces: Mapping[int, tuple[Piece, ...]]) -> tuple[PieceData, Any]:
    """Getters of the pieces of ranks' local tensors: numpy views of CPU memory, and for
    CUDA shards also views on the device (the CPU copy is then made only if asked for)."""
    cpu: dict[int, torch.Tensor] = {}

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        if rank not in shards:
            raise CheckpointError(f"internal error: data of rank {rank} asked for, this process holds {sorted(shards)}")
        if rank not in cpu:
            cpu[rank] = resolved(shards[rank].detach().cpu())
        piece = pieces[rank][pi]
        return numpy_view(piece_view(cpu[rank], piece)), piece.region

    for t in shards.values():
        if t.is_cuda:
            break
    else:  # (no CUDA shard: a loop, not any() over a generator, at thousands of leaves a save)
        return get, None

    def device(rank: int, pi: int) -> tuple[torch.Tensor, Region]:
        piece = pieces[rank][pi]
        return piece_view(shards[rank].detach(), piece), piece.region

    return get, device


def tensor_source(t: torch.Tensor, pieces: Mapping[int, tuple[Piece, ...]]) -> tuple[PieceData, Any]:
    """Getters of the pieces of a global tensor held whole (every rank's piece is a box of it)."""
    if not t.is_cuda:
        return global_source(numpy_view(resolved(t.detach().cpu())), pieces), None
    held: list[np.ndarray] = []

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        if not held:
            held.append(numpy_view(resolved(t.detach().cpu())))
        return global_source(held[0], pieces)(rank, pi)

    def device(rank: int, pi: int) -> tuple[torch.Tensor, Region]:
        region = pieces[rank][pi].region
        return t.detach()[region.slices()], region

    return get, device


def plain_data(leaf: torch.Tensor, region: Region) -> PieceData:
    """The getter of a plain tensor's one piece, ``region`` (the whole tensor), for a save that
    recognised its tree (saving/_recall.py) and so skips describing it: its numpy view is made
    when its data is asked for (a whole array's, once), not while the save plans."""

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        return numpy_view(resolved(leaf)), region

    return get


def no_data(rank: int, pi: int) -> tuple[np.ndarray, Region]:
    """The data getter of every Abstract leaf: it has none (they are planned only, never saved)."""
    raise CheckpointError("an Abstract placeholder has no data (a plan only)")
