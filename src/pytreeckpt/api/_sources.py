"""The leaves a save reads from: each tensor leaf's layout, and getters of its pieces in local memory."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pytreeckpt.core._dtypes import DType, dtype_of_numpy, dtype_of_torch, numpy_view
from pytreeckpt.core._errors import CheckpointError, LayoutError
from pytreeckpt.core._leaf import Abstract, ShardedLeaf, piece_view
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import Layout, Mesh, Piece, Replicate, ShardingSpec
from pytreeckpt.core._slots import slots_constructor
from pytreeckpt.execute._executor import PieceData
from pytreeckpt.format import MAX_NDIM
from pytreeckpt.plan import ArraySpec, array_spec_of

from ._shared import (
    _SINGLE,
    _is_dtensor,
    _position,
    _rank_of,
    _where,
)

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm


@dataclass(slots=True)
class _ArrayIn:
    """A tensor leaf on its way to storage."""

    key: str
    container: str
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout
    saved_layout: Layout | None
    pieces: Mapping[int, tuple[Piece, ...]]  # the pieces of the ranks whose data this process holds
    get: PieceData
    present: frozenset[int] | None = None  # ranks whose data is here; None: all
    device: Any = None  # DeviceData for leaves on a CUDA device, else None
    watch: tuple[torch.Tensor, ...] = ()  # tensors whose version counters tell of a change during a snapshot
    ranks: range | tuple[int, ...] | None = None  # the rank of each position of ``layout``; None: position i on rank i

    def spec(self) -> ArraySpec:
        """What the planner needs of this array: its key, shape, element size and placed layout."""
        return array_spec_of(self.key, self.shape, self.dtype.itemsize, self.layout, self.ranks)


def _global_source(arr: np.ndarray, pieces: Mapping[int, tuple[Piece, ...]]) -> PieceData:
    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        region = pieces[rank][pi].region
        return arr[region.slices()], region

    return get


def _numpy_source(arr: np.ndarray, pieces: Mapping[int, tuple[Piece, ...]]) -> PieceData:
    """Getters of the pieces of a numpy array held whole, in the machine's byte order.

    Every path after this one (the staging copy, chunk files, TensorStore, chunk hashes)
    takes an array's elements as native integers or floats, so an array of the other
    byte order (``>f4`` on a little-endian machine) is converted here, once, when its
    data is first asked for.
    """
    if arr.dtype.isnative:
        return _global_source(arr, pieces)
    native: list[PieceData] = []
    lock = threading.Lock()

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        with lock:
            if not native:
                native.append(_global_source(arr.astype(arr.dtype.newbyteorder("=")), pieces))
        return native[0](rank, pi)

    return get


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its conjugate and negative bits applied (a copy only if one is set): what numpy can view."""
    if t.is_conj() or t.is_neg():  # (asking is half the cost of two resolve calls that return t)
        return t.resolve_conj().resolve_neg()
    return t


def _check_tensor(key: str, t: torch.Tensor) -> None:
    """Refuse, naming the leaf, a tensor whose elements cannot be stored as one dense array."""
    where = _where(key)
    if t.is_meta:
        raise CheckpointError(
            f"leaf {where} is a tensor on the meta device, which holds no data to save; materialise it first "
            f"(module.to_empty(device=...) and initialise or load its values)"
        )
    if t.is_nested:
        raise CheckpointError(f"leaf {where} is a nested tensor, which cannot be stored; save t.unbind()")
    if t.layout != torch.strided:
        raise CheckpointError(
            f"leaf {where} is a tensor of layout {t.layout}, which cannot be stored; save t.to_dense(), or "
            f"its indices and values as tensors of their own"
        )
    if t.is_quantized:
        raise CheckpointError(
            f"leaf {where} is a quantized tensor (dtype {t.dtype}), which cannot be stored; save "
            f"t.dequantize(), or t.int_repr() with its scale and zero point"
        )
    _check_ndim(key, t.dim())


def _check_ndim(key: str, ndim: int) -> None:
    if ndim > MAX_NDIM:
        raise CheckpointError(
            f"leaf {_where(key)} has {ndim} dims; a stored array has at most {MAX_NDIM} (the zarr v3 arrays "
            f"TensorStore opens); reshape it before saving"
        )


def _shard_sources(
    shards: Mapping[int, torch.Tensor], pieces: Mapping[int, tuple[Piece, ...]]
) -> tuple[PieceData, Any]:
    """Getters of the pieces of ranks' local tensors: numpy views of CPU memory, and for
    CUDA shards also views on the device (the CPU copy is then made only if asked for)."""
    cpu: dict[int, torch.Tensor] = {}

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        if rank not in shards:
            raise CheckpointError(f"internal error: data of rank {rank} asked for, this process holds {sorted(shards)}")
        if rank not in cpu:
            cpu[rank] = _resolved(shards[rank].detach().cpu())
        piece = pieces[rank][pi]
        return numpy_view(piece_view(cpu[rank], piece)), piece.region

    if not any(t.is_cuda for t in shards.values()):
        return get, None

    def device(rank: int, pi: int) -> tuple[torch.Tensor, Region]:
        piece = pieces[rank][pi]
        return piece_view(shards[rank].detach(), piece), piece.region

    return get, device


def _tensor_source(t: torch.Tensor, pieces: Mapping[int, tuple[Piece, ...]]) -> tuple[PieceData, Any]:
    """Getters of the pieces of a global tensor held whole (every rank's piece is a box of it)."""
    if not t.is_cuda:
        return _global_source(numpy_view(_resolved(t.detach().cpu())), pieces), None
    held: list[np.ndarray] = []

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        if not held:
            held.append(numpy_view(_resolved(t.detach().cpu())))
        return _global_source(held[0], pieces)(rank, pi)

    def device(rank: int, pi: int) -> tuple[torch.Tensor, Region]:
        region = pieces[rank][pi].region
        return t.detach()[region.slices()], region

    return get, device


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _abstract_in(
    key: str, leaf: Abstract, spec: Any, comm: Comm | None, kinds: dict[Any, Any] | None = None
) -> _ArrayIn:
    """An Abstract leaf, planned (for :func:`pytreeckpt.plan_save`) as a tensor whose data is never read.

    ``kinds`` (one per save) keeps what leaves of one spec, shape, dtype and placement
    *objects* share (a model's layers do): their layout, this rank's pieces and dtype.
    """
    if spec is not None and spec != leaf.spec:
        raise CheckpointError(
            f"leaf {_where(key)} is an Abstract in layout {leaf.spec}, but the spec tree gives {spec}"
        )
    placement, saved = leaf.placement, leaf.spec
    kind = (id(saved), leaf.shape, leaf.dtype, id(placement))
    got = None if kinds is None else kinds.get(kind)
    if got is None or got[0] is not saved or got[1] is not placement:
        _check_ndim(key, len(leaf.shape))
        if saved is not None:
            try:
                saved.check(leaf.shape)
            except LayoutError as e:
                raise LayoutError(f"leaf {_where(key)}: {e}") from None
        layout = (
            leaf.spec
            if leaf.spec is not None
            else (_SINGLE if comm is None else ShardingSpec(Mesh(comm.world), [Replicate()]))
        )
        if comm is not None:
            position = _position(key, layout, placement, comm)
            pieces = {comm.rank: layout.pieces_of(position, leaf.shape) if position is not None else ()}
        else:
            rank_of = _rank_of(placement)
            pieces = {rank_of(p): layout.pieces_of(p, leaf.shape) for p in range(layout.world_size)}
        got = (leaf.spec, placement, layout, pieces, dtype_of_torch(leaf.dtype))
        if kinds is not None:
            kinds[kind] = got  # (the leaf keeps its spec and placement alive, so their ids stay theirs)
    _, _, layout, pieces, dtype = got
    return _array_in_of(key, "torch", dtype, leaf.shape, layout, saved, pieces, _no_data, None, None, (), placement)


_array_in_of: Callable[..., _ArrayIn] = slots_constructor(_ArrayIn)  # (every field, in order)


def _no_data(rank: int, pi: int) -> tuple[np.ndarray, Region]:
    """The data getter of every Abstract leaf: it has none (they are planned only, never saved: :func:`_array_in`)."""
    raise CheckpointError("an Abstract placeholder has no data (a plan only)")


_WHOLE: dict[tuple[int, ...], tuple[Region, dict[int, tuple[Piece, ...]]]] = {}  # shape -> its region, pieces


def _plain_in(key: str, leaf: torch.Tensor) -> _ArrayIn:
    """A plain tensor in host memory saved by a single process: one piece, the whole tensor."""
    _check_tensor(key, leaf)
    shape = tuple(leaf.shape)
    whole = _WHOLE.get(shape)
    if whole is None:
        if len(_WHOLE) >= 4096:  # (a bound: a process saving tensors of ever new shapes)
            _WHOLE.clear()
        region = Region.full(shape)
        whole = _WHOLE[shape] = (region, {0: (Piece(region, 0),)})
    region, pieces = whole  # (shared by the arrays of one shape: nothing changes them)
    view = numpy_view(_resolved(leaf))

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        return view, region

    return _ArrayIn(key, "torch", dtype_of_torch(leaf.dtype), shape, _SINGLE, None, pieces, get, watch=(leaf,))


def _plain_data(leaf: torch.Tensor, region: Region) -> PieceData:
    """The getter of a plain tensor's one piece, ``region`` (the whole tensor), for a save that
    recognised its tree (api/_recall.py) and so skips :func:`_plain_in`: its numpy view is made
    when its data is asked for (a whole array's, once), not while the save plans."""

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        return numpy_view(_resolved(leaf)), region

    return get


def _array_in(
    key: str,
    leaf: Any,
    spec: Any,
    comm: Comm | None = None,
    plan_only: bool = False,
    kinds: dict[Any, Any] | None = None,
) -> _ArrayIn:
    """Describe one tensor leaf for planning; ``comm`` is the DistComm in a distributed save.

    With ``plan_only`` (a plan asked for, nothing written) an :class:`Abstract` leaf is
    planned as a tensor of its shape, dtype, spec and placement whose data is never read.
    """
    if comm is None and spec is None and type(leaf) in _PLAIN and not leaf.is_cuda:
        return _plain_in(key, leaf)  # the common case, many thousand times per save: kept lean
    if isinstance(leaf, Abstract):
        if not plan_only:
            raise CheckpointError(f"leaf {_where(key)} is an Abstract placeholder, which has no data to save")
        return _abstract_in(key, leaf, spec, comm, kinds)
    if spec is not None and not isinstance(spec, Layout):
        raise CheckpointError(
            f"spec for leaf {_where(key)} must be a ShardingSpec, FlatRanges, ExplicitRegions or None, found {spec!r}"
        )
    try:
        if _is_dtensor(leaf):
            # In a single process (a process group of one rank) its mesh must be this rank alone.
            from pytreeckpt.distributed._comm import dtensor_layout

            layout, ranks, position, own = dtensor_layout(leaf, comm)
            local = leaf.to_local()
            _check_tensor(key, local)
            _check_ndim(key, leaf.dim())
            shape = tuple(leaf.shape)
            pieces = {
                0 if comm is None else comm.rank: layout.pieces_of(position, shape) if position is not None else ()
            }
            get, device = _shard_sources(dict.fromkeys(pieces, local), pieces)
            dtype = dtype_of_torch(leaf.dtype)
            return _ArrayIn(
                key, "torch", dtype, shape, layout, own, pieces, get, device=device, watch=(local,), ranks=ranks
            )
        if isinstance(leaf, ShardedLeaf):
            if spec is not None and spec != leaf.spec:
                raise CheckpointError(
                    f"leaf {_where(key)} is a ShardedLeaf in layout {leaf.spec}, but the spec tree gives {spec}"
                )
            _check_ndim(key, len(leaf.shape))
            for shard in leaf.shards.values():
                _check_tensor(key, shard)
            # Pieces and data by global rank; shards by position (the same unless a placement says otherwise).
            rank_of = _rank_of(leaf.placement)
            if comm is not None:
                position = _position(key, leaf.spec, leaf.placement, comm)
                if position is not None and position not in leaf.shards:
                    raise CheckpointError(
                        f"leaf {_where(key)}: rank {comm.rank} saves a ShardedLeaf without its own shard "
                        f"(position {position}; it holds positions {sorted(leaf.shards)})"
                    )
                positions: tuple[int, ...] = () if position is None else (position,)
                pieces = {comm.rank: leaf.spec.pieces_of(position, leaf.shape) if position is not None else ()}
            else:
                positions = tuple(leaf.shards)
                pieces = {rank_of(p): leaf.spec.pieces_of(p, leaf.shape) for p in positions}
            present = frozenset(pieces) if comm is None else frozenset({comm.rank})
            get, device = _shard_sources({rank_of(p): leaf.shards[p] for p in positions}, pieces)
            watch = tuple(leaf.shards[p] for p in positions)
            dtype = dtype_of_torch(leaf.dtype)
            return _ArrayIn(
                key,
                "torch",
                dtype,
                leaf.shape,
                leaf.spec,
                leaf.spec,
                pieces,
                get,
                present,
                device,
                watch,
                ranks=leaf.placement,
            )
        tensor: torch.Tensor | None = None
        if isinstance(leaf, torch.Tensor):
            _check_tensor(key, leaf)
            tensor = leaf
            dtype = dtype_of_torch(leaf.dtype)
            local_shape = tuple(int(s) for s in leaf.shape)
            container = "torch"
        else:
            if isinstance(leaf, np.ma.MaskedArray):
                raise CheckpointError(
                    f"leaf {_where(key)} is a numpy masked array, whose mask would be lost; save its data and "
                    f"mask as two arrays (leaf.data, np.ma.getmaskarray(leaf))"
                )
            arr = np.asarray(leaf)
            _check_ndim(key, arr.ndim)
            dtype = dtype_of_numpy(arr.dtype)
            local_shape = tuple(int(s) for s in arr.shape)
            container = "numpy"
        whole: Layout | None = None
        if comm is None:
            whole = spec if spec is not None else _SINGLE
        elif spec is None:
            # Every rank holds the whole tensor: replicated, written once in total.
            whole = ShardingSpec(Mesh(comm.world), [Replicate()])
        if whole is not None:
            held = range(whole.world_size) if comm is None else (comm.rank,)
            pieces = {r: whole.pieces_of(r, local_shape) for r in held}
            if tensor is not None:
                get, device = _tensor_source(tensor, pieces)
            else:
                get, device = _numpy_source(arr, pieces), None
            watch = () if tensor is None else (tensor,)
            return _ArrayIn(key, container, dtype, local_shape, whole, spec, pieces, get, device=device, watch=watch)
        raise CheckpointError(
            f"leaf {_where(key)}: in a distributed save a plain tensor is this rank's full copy; to save it sharded "
            f"wrap this rank's shard as ShardedLeaf(global_shape, dtype, spec, {{rank: shard}}) or use a DTensor"
        )
    except (LayoutError, ValueError) as e:
        if isinstance(e, CheckpointError) and not isinstance(e, LayoutError):
            raise
        raise LayoutError(f"leaf {_where(key)}: {e}") from None


def _snapshot_merges(plans: Sequence[Any], data: Sequence[PieceData], me: int) -> tuple[list[PieceData], int]:
    """Copy this rank's fragments of merged writes: per local piece, the box spanning them.

    (Direct writes go through the staging pool; merge fragments travel to their writer.)
    Returns the getters of the copies and the bytes copied.
    """
    out: list[PieceData] = []
    copied = 0
    for plan, get in zip(plans, data, strict=True):
        boxes: dict[tuple[int, int], Region] = {}
        for op in plan.writes:
            if op.is_direct:
                continue
            for frag in op.sources:
                if frag.rank == me:
                    k = (frag.rank, frag.piece)
                    boxes[k] = frag.region if k not in boxes else _span(boxes[k], frag.region)
        copies: dict[tuple[int, int], tuple[np.ndarray, Region]] = {}
        for (rank, pi), box in boxes.items():
            view, where = get(rank, pi)
            copies[(rank, pi)] = (np.array(view[box.relative_to(where).slices()], copy=True), box)
            copied += copies[(rank, pi)][0].nbytes
        out.append(_copies_source(copies) if copies else get)
    return out, copied


def _copies_source(copies: dict[tuple[int, int], tuple[np.ndarray, Region]]) -> PieceData:
    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        return copies[(rank, pi)]

    return get


def _span(a: Region, b: Region) -> Region:
    lo = tuple(min(x, y) for x, y in zip(a.offset, b.offset, strict=True))
    hi = tuple(max(x, y) for x, y in zip(a.stop, b.stop, strict=True))
    return Region(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))
