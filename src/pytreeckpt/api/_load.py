"""``load``, ``load_slice``, ``metadata`` and ``verify``: read a checkpoint into a new tree."""

from __future__ import annotations

import ctypes
import dataclasses
import fnmatch
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from pytreeckpt.core._dtypes import TORCH_NAMES, dtype_of_numpy, dtype_of_torch, numpy_view
from pytreeckpt.core._errors import CheckpointError, LayoutError, MetadataError, NotCommittedError, TargetMismatchError
from pytreeckpt.core._leaf import Abstract, ShardedLeaf, piece_view
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import ExplicitRegions, Layout, Mesh, Piece, Replicate, ShardingSpec
from pytreeckpt.core._slots import slots_constructor
from pytreeckpt.core._tree import KeyEntry, Node, flatten, keystr, leaf_node, typed_keystr
from pytreeckpt.core._values import resolve_value
from pytreeckpt.distributed._comm import data_comm
from pytreeckpt.execute._executor import read_arrays
from pytreeckpt.execute._memory import AllocationFailed, Prefault, empty_host, empty_numpy
from pytreeckpt.execute._monitor import Monitor, Progress, Span
from pytreeckpt.format import (
    ArrayMeta,
    CheckpointDoc,
    ValueMeta,
    parse_document,
)
from pytreeckpt.plan import ArraySpec, LoadPlan, PlanCache, array_spec_of, plan_load, spec_plan_key
from pytreeckpt.storage import ExecutorOptions, Storage, available_memory
from pytreeckpt.storage._location import describe

from ._shared import (
    _SINGLE,
    PathLike,
    _agree_on_specs,
    _Carried,
    _comm,
    _gather_spans,
    _is_dtensor,
    _is_leaf,
    _is_value,
    _position,
    _rank_of,
    _span,
    _wait_in_flight,
    _where,
    gc_paused,
)

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

_T = TypeVar("_T")

__all__ = ["CheckpointMetadata", "VerifyReport", "load", "load_slice", "metadata", "read_array", "verify"]


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What a checkpoint holds, read from its metadata alone.

    Attributes:
      tree: the stored tree, with an :class:`Abstract` for every tensor leaf (numpy
        leaves too) and plain Python leaves' values; usable as a load target.
      arrays: the stored arrays by key path: dtype, shape, chunk grid, saved layout.
      user_metadata: the JSON object given at save time.
      version: the format version.
    """

    tree: Any
    arrays: Mapping[str, ArrayMeta]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    version: int = 1

    @property
    def nbytes(self) -> int:
        if isinstance(self.arrays, _Arrays):
            return self.arrays.nbytes
        return sum(a.nbytes for a in self.arrays.values())


def _open(
    path: PathLike, namespace: str, executor: ExecutorOptions | None, seen: list[bytes] | None = None
) -> tuple[Storage, CheckpointDoc]:
    """The location and its parsed metadata document; the document's bytes appended to ``seen`` when given (to
    tell, after a failure, whether the checkpoint was replaced meanwhile: :func:`_again_if_replaced`)."""
    storage = Storage(path, executor)
    raw = storage.read_metadata()
    if seen is not None:
        seen.append(raw)
    return storage, _parse(storage, raw, namespace)


def _parse(storage: Storage, raw: bytes, namespace: str) -> CheckpointDoc:
    """The metadata document, within the location's size limit and this machine's memory."""
    limit = storage.location.options.max_metadata_bytes
    doc = parse_document(raw, namespace=namespace, max_bytes=limit, available=available_memory())
    if doc.checksums is not None:  # (read as the arrays read need them)
        doc.checksums.reader = storage.read_checksums
    return doc


def _check_memory(where: PathLike, claims: Sequence[tuple[str, int]]) -> None:
    """Refuse, before allocating, what the metadata claims beyond this machine's memory.

    ``claims`` are ``(key, bytes)`` of the buffers a load makes from the metadata's own
    shapes (a target's shapes are the caller's).
    """
    total = sum(n for _, n in claims)
    available = available_memory()
    if available is None or total <= available:
        return
    key, largest = max(claims, key=lambda c: c[1])
    raise CheckpointError(
        f"loading {describe(where)} would allocate {total} bytes for {len(claims)} arrays as the metadata claims "
        f"them (the largest, leaf {key!r}, {largest} bytes), more than the {available} bytes this machine has "
        f"available (MemAvailable and free swap, within the process's address-space limit); load part of it "
        f"(include=, a target tree, load_slice)"
    )


def metadata(path: PathLike, *, namespace: str = "") -> CheckpointMetadata:
    """Read a committed checkpoint's metadata (no array data is read).

    A checkpoint written by an older pytreeckpt may hold two leaves of one key path
    (``{"a.b": x, "a": {"b": y}}``); ``arrays[key]`` then raises a MetadataError naming
    both, rather than pick one. The tree holds both.
    """
    _, doc = _open(path, namespace, None)
    leaves = [leaf.value if isinstance(leaf, ValueMeta) else _abstract_of(leaf) for leaf in doc.leaves]
    arrays = _Arrays(path, doc)
    return CheckpointMetadata(doc.tree.unflatten(leaves), arrays, doc.user_metadata, doc.version)


class _Arrays(Mapping[str, ArrayMeta]):
    """The stored arrays by key path; a key path two leaves share raises instead of naming one of them."""

    def __init__(self, path: PathLike, doc: CheckpointDoc) -> None:
        self._where = describe(path)
        self._ambiguous = _ambiguous_keys(doc)
        self._metas = {leaf.key: leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta)}
        self._all = tuple(leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta))

    def __getitem__(self, key: str) -> ArrayMeta:
        if key in self._ambiguous:
            raise _ambiguity_error(key, self._ambiguous[key], self._where)
        return self._metas[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._metas)

    def __len__(self) -> int:
        return len(self._metas)

    def __repr__(self) -> str:
        many = self._ambiguous
        return repr({k: f"<{len(many[k])} leaves>" if k in many else v for k, v in self._metas.items()})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._all)


def _ambiguous_keys(doc: CheckpointDoc) -> dict[str, list[tuple[KeyEntry, ...]]]:
    """Key paths that name several leaves (documents of older versions), with their typed paths."""
    by_key: dict[str, list[tuple[KeyEntry, ...]]] = {}
    for p, leaf in zip(doc.tree.paths(), doc.leaves, strict=True):
        by_key.setdefault(leaf.key, []).append(p)
    return {k: ps for k, ps in by_key.items() if len(ps) > 1}


def _ambiguity_error(key: str, paths: Sequence[tuple[KeyEntry, ...]], where: str) -> MetadataError:
    return MetadataError(
        f"key path {key!r} names {len(paths)} leaves of the checkpoint at {where} "
        f"({' and '.join(typed_keystr(p) for p in paths)}; it was written by an older pytreeckpt, which allowed "
        f"that): load it whole, with load(path) or a target tree, which tells them apart"
    )


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
      path: the checkpoint.
      problems: ``(key path, chunk index or None for the whole array, message)`` for
        every damaged array or chunk.
      arrays: arrays checked.
      chunks: chunks read.
      nbytes: bytes read.
      unrecorded: arrays whose metadata records no chunk checksums (checkpoints written
        before it did): each chunk's own checksum was checked, not that it is the chunk
        the metadata describes.
      unreadable: ``(key path, chunk index or None, message)`` for every array directory
        or chunk this process may not read (permission denied): not checked, and not
        damage either; ``ok`` is False while any remain.
    """

    path: str
    problems: tuple[tuple[str, tuple[int, ...] | None, str], ...]
    arrays: int
    chunks: int
    nbytes: int
    unrecorded: tuple[str, ...] = ()
    unreadable: tuple[tuple[str, tuple[int, ...] | None, str], ...] = ()

    @property
    def ok(self) -> bool:
        """Every chunk was read and found as the metadata describes it."""
        return not self.problems and not self.unreadable

    @property
    def damaged_leaves(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(key for key, _, _ in self.problems))


def verify(path: PathLike, *, executor: ExecutorOptions | None = None) -> VerifyReport:
    """Read every chunk of every array of a checkpoint and check it as a load would.

    Each chunk is checked against the checksum the metadata records for it (so a chunk
    moved, swapped or taken from another checkpoint is found), and its own checksum,
    size, presence, file kind and place are checked; a load fails on exactly these.

    A checkpoint replaced while it is verified (another process saving there) is verified
    again, as :func:`load` starts again; the report is of one checkpoint, whole.

    Raises:
      NotCommittedError: ``path`` holds no committed checkpoint, or it was removed, or
        replaced 4 times, while it was verified.
      MetadataError: the metadata document itself is damaged.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> pytreeckpt.save(d, {"w": torch.ones(4)})
    >>> pytreeckpt.verify(d).ok
    True
    """

    def attempt(seen: list[bytes]) -> VerifyReport:
        storage, doc = _open(path, "", executor, seen)
        metas = [leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta)]
        problems, unreadable, chunks, nbytes = storage.verify(metas)
        if problems and _replaced(storage, seen[0]):  # (its arrays deleted by the new commit: not damage)
            raise CheckpointError(f"{describe(path)} was replaced while it was verified: {problems[0][2]}")
        unrecorded = tuple(m.key for m in metas if not m.records_crc32c)
        return VerifyReport(
            describe(path), tuple(problems), len(metas), chunks, nbytes, unrecorded, unreadable=tuple(unreadable)
        )

    return _again_if_replaced(path, executor, "verified", attempt)


def _abstract_of(meta: ArrayMeta) -> Any:
    try:
        return Abstract(meta.shape, meta.dtype.torch)
    except KeyError:  # numpy-only dtypes
        return meta


@dataclass(slots=True)
class _Dest:
    """Destination memory of one target leaf."""

    meta: ArrayMeta
    layout: Layout  # the target's layout
    pieces: Mapping[int, tuple[Piece, ...]]  # the pieces of the ranks whose memory this process holds
    locals: dict[int, Any]  # rank -> torch tensor or numpy array (CPU)
    finish: Any  # callable: () -> result leaf
    device_bytes: int = 0  # bytes copied to a device by finish()
    ranks: range | tuple[int, ...] | None = None  # the rank of each position of ``layout``; None: position i on rank i

    def spec(self) -> ArraySpec:
        meta = self.meta
        return array_spec_of(meta.key, meta.shape, meta.dtype.itemsize, self.layout, self.ranks)

    def get(self, rank: int, pi: int) -> tuple[np.ndarray, Region]:
        piece = self.pieces[rank][pi]
        local = self.locals[rank]
        if isinstance(local, np.ndarray):
            # numpy destinations are full arrays: the single piece is the whole array
            return local, piece.region
        return numpy_view(piece_view(local, piece)), piece.region


def _fillable(t: torch.Tensor) -> bool:
    """Whether reads can land straight in tensor ``t``'s memory (else they land in a buffer copied into it)."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _into(target: torch.Tensor, buffer: torch.Tensor) -> None:
    """Copy a read buffer into the target tensor it stands for, in place (a Parameter's autograd aside)."""
    with torch.no_grad():
        target.copy_(buffer.to(target.device, non_blocking=True))


def _small_result(meta: ArrayMeta, value: bytes, target: Any) -> Any:
    """A whole small array's result from its stored chunk (``meta.nbytes`` bytes of elements, checked).

    A new tensor (a Parameter for a Parameter target), or a numpy array for the numpy
    container with no target. The bytes are copied with ``memmove``: a tensor a numpy
    view was ever taken of can no longer be resized, which a tensor torch itself loaded can.
    """
    if meta.container == "numpy" and target is None:
        return np.frombuffer(value, meta.dtype.numpy, math.prod(meta.shape)).reshape(meta.shape).copy()
    t = torch.empty(meta.shape, dtype=meta.dtype.torch)
    ctypes.memmove(t.data_ptr(), value, meta.nbytes)  # (the sizes agree: Storage.read_small checked the chunk's)
    if target is not None and type(target) is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=target.requires_grad)
    return t


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _naming_leaf(make: Callable[Concatenate[ArrayMeta, _P], _R]) -> Callable[Concatenate[ArrayMeta, _P], _R]:
    """``make(meta, ...)``, a buffer it cannot allocate said as a CheckpointError naming ``meta``'s leaf."""

    @functools.wraps(make)
    def named(meta: ArrayMeta, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return make(meta, *args, **kwargs)
        except AllocationFailed as e:
            raise CheckpointError(f"leaf {meta.key!r}: {e}") from e

    return named


@_naming_leaf
def _full_dest(
    meta: ArrayMeta,
    as_numpy: bool,
    device: torch.device | None,
    param: Any,
    comm: Comm | None = None,
    inplace: bool = False,
    *,
    buffers: _Buffers,
) -> _Dest:
    """A whole tensor: held by the one rank of a single process, or by every rank of a group.

    With ``inplace`` the reads land in ``param`` (the target tensor or numpy array) itself,
    or, where its memory cannot take them (a device, a non-contiguous view), in a buffer
    copied into it; the result is ``param``.
    """
    me = 0 if comm is None else comm.rank
    layout = _SINGLE if comm is None else ShardingSpec(Mesh(comm.world), [Replicate()])
    pieces = {me: layout.pieces_of(me, meta.shape)}
    if as_numpy:
        if inplace and isinstance(param, np.ndarray):
            target = param
            if target.flags.c_contiguous and target.flags.writeable and target.dtype == meta.dtype.numpy:
                return _Dest(meta, layout, pieces, {me: target}, lambda: target)
            buf = buffers.numpy(meta.shape, meta.dtype.numpy)

            def copied() -> Any:
                np.copyto(target, buf, casting="no")
                return target

            return _Dest(meta, layout, pieces, {me: buf}, copied)
        arr = buffers.numpy(meta.shape, meta.dtype.numpy)
        return _Dest(meta, layout, pieces, {me: arr}, lambda: arr)
    if inplace and isinstance(param, torch.Tensor):
        own = param
        if _fillable(own):
            return _Dest(meta, layout, pieces, {me: own.detach()}, lambda: own)
        staged = buffers.tensor(meta.shape, meta.dtype.torch, pinned=own.device.type == "cuda")

        def filled() -> Any:
            _into(own, staged)
            return own

        moved = staged.numel() * staged.element_size() if own.device.type != "cpu" else 0
        return _Dest(meta, layout, pieces, {me: staged}, filled, moved)
    on_device = device is not None and device.type != "cpu"
    t = buffers.tensor(meta.shape, meta.dtype.torch, pinned=device is not None and device.type == "cuda")

    def finish() -> Any:
        out = t.to(device, non_blocking=True) if on_device else t
        if isinstance(param, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=param.requires_grad)
        return out

    return _Dest(meta, layout, pieces, {me: t}, finish, t.numel() * t.element_size() if on_device else 0)


@dataclass(slots=True)
class _Buffers:
    """Where a load's new host memory comes from.

    ``huge``: its pages advised huge (``ExecutorOptions.huge_pages``); ``meta``: a load that
    is only planned (``plan_load_of``) gets tensors on the meta device (shapes, no memory),
    one per shape and dtype. ``fresh`` records every buffer made, as (address, bytes), for
    :class:`Prefault`.
    """

    huge: bool = True
    meta: bool = False
    fresh: list[tuple[int, int]] = field(default_factory=list)
    _shapes: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(default_factory=dict)
    # this rank's shards in a distributed load, by (spec, shape, placement) objects (a model's layers share
    # theirs): :func:`_own_shard`'s
    shards: dict[tuple[int, tuple[int, ...], int], tuple[Any, ...]] = field(default_factory=dict)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """Host memory for a read; pinned when it goes on to a CUDA device (the copy is then asynchronous)."""
        if self.meta:
            got = self._shapes.get((shape, dtype))
            if got is None:
                got = self._shapes[shape, dtype] = torch.empty(shape, dtype=dtype, device="meta")
            return got
        t = empty_host(shape, dtype, pin=pinned and torch.cuda.is_available(), huge=self.huge)
        self.fresh.append((t.data_ptr(), t.numel() * t.element_size()))
        return t

    def numpy(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        a = empty_numpy(shape, dtype, huge=self.huge and not self.meta)
        if not self.meta:
            self.fresh.append((a.ctypes.data, a.nbytes))
        return a


_dest_of: Callable[..., _Dest] = slots_constructor(_Dest)  # (every field, in order)


def _own_shard(
    spec: Layout, placement: range | tuple[int, ...] | None, shape: tuple[int, ...], comm: Comm, key: str
) -> tuple[Any, ...]:
    """This rank's shard of a leaf of ``spec``, ``placement`` and ``shape``: (spec, placement, its position
    (None: it holds none), its rank, its shard's shape, its pieces by rank)."""
    problem = _spec_problem(key, spec, shape)
    if problem is not None:
        raise LayoutError(problem)
    try:
        position = _position(key, spec, placement, comm)
    except LayoutError as e:
        raise LayoutError(f"leaf {_where(key)}: {e}") from None
    if position is None:
        return spec, placement, None, None, None, {}
    rank = position if placement is None else placement[position]
    return spec, placement, position, rank, spec.local_shape(position, shape), {rank: spec.pieces_of(position, shape)}


def _own_shard_dest(meta: ArrayMeta, own: tuple[Any, ...], buffers: _Buffers) -> _Dest:
    """:func:`_sharded_dest` of a new leaf on the host in a distributed load: this rank's shard (``own``, from
    :func:`_own_shard`), read into new host memory."""
    shape, dtype = meta.shape, meta.dtype.torch
    spec, placement, position, rank, local_shape, pieces = own
    # (finish: a partial, not a closure, for the many thousand leaves of a rank's load: one object, not seven)
    if position is None:
        none = functools.partial(ShardedLeaf, shape, dtype, spec, {}, placement)
        return _dest_of(meta, spec, {}, {}, none, 0, placement)
    local = buffers.tensor(local_shape, dtype, False)
    finish = functools.partial(ShardedLeaf, shape, dtype, spec, {position: local}, placement)
    return _dest_of(meta, spec, pieces, {rank: local}, finish, 0, placement)


def _own_shard_of(
    spec: Layout, placement: range | tuple[int, ...] | None, meta: ArrayMeta, comm: Comm, buffers: _Buffers
) -> tuple[Any, ...]:
    """:func:`_own_shard` of a target leaf, memoised in ``buffers`` on its spec, shape and placement objects."""
    kind = (id(spec), meta.shape, id(placement))
    mine = buffers.shards.get(kind)
    if mine is None or mine[0] is not spec or mine[1] is not placement:
        mine = buffers.shards[kind] = _own_shard(spec, placement, meta.shape, comm, meta.key)
        # (the target leaf keeps its spec and placement alive: their ids stay theirs for the load)
    return mine  # type: ignore[no-any-return]


@_naming_leaf
def _sharded_dest(
    meta: ArrayMeta,
    spec: Layout,
    ranks: Sequence[int],
    devices: dict[int, torch.device],
    comm: Comm | None = None,
    into: ShardedLeaf | None = None,
    placement: range | tuple[int, ...] | None = None,
    *,
    buffers: _Buffers,
) -> _Dest:
    """The shards of ``ranks`` (positions of ``spec``) on their global ranks (``placement``, None: the same);
    in a distributed load this rank's position is filled.

    With ``into`` (a load in place) the reads land in its own shards, and the result is ``into``.
    Pieces and memory go by global rank, the result's shards by position.
    """
    if comm is not None:
        mine = _own_shard_of(spec, placement, meta, comm, buffers)
        if into is None and not devices:  # (a new leaf on the host, this rank's shard: what follows, for one)
            return _own_shard_dest(meta, mine, buffers)
        position = mine[2]
        ranks = [] if position is None else [position]
    rank_of = _rank_of(placement)
    if placement is not None:  # memory and devices by global rank from here on
        devices = {rank_of(p): d for p, d in devices.items()}
    pieces = {rank_of(p): spec.pieces_of(p, meta.shape) for p in ranks}
    position_of = {rank_of(p): p for p in ranks}
    ranks = [rank_of(p) for p in ranks]
    moved = {r for r in ranks if r in devices and devices[r].type != "cpu"}
    if into is not None:
        leaf = into
        missing = [position_of[r] for r in ranks if position_of[r] not in leaf.shards]
        if missing:
            raise LayoutError(
                f"leaf {_where(meta.key)}: loading in place needs the shards of ranks {missing}, which the target "
                f"ShardedLeaf does not hold"
            )
        own = {r: leaf.shards[position_of[r]] for r in ranks}
        direct = {r: t for r, t in own.items() if _fillable(t)}
        staged = {
            r: buffers.tensor(tuple(own[r].shape), meta.dtype.torch, devices[r].type == "cuda")
            for r in ranks
            if r not in direct
        }

        def filled() -> ShardedLeaf:
            for r, b in staged.items():
                _into(own[r], b)
            return leaf

        held = {r: direct[r].detach() if r in direct else staged[r] for r in ranks}
        h2d = sum(b.numel() * b.element_size() for r, b in staged.items() if r in moved)
        return _Dest(meta, spec, pieces, held, filled, h2d, placement)

    locals_ = {
        r: buffers.tensor(
            spec.local_shape(position_of[r], meta.shape), meta.dtype.torch, r in moved and devices[r].type == "cuda"
        )
        for r in ranks
    }

    def finish() -> ShardedLeaf:
        shards = {position_of[r]: t.to(devices[r], non_blocking=True) if r in moved else t for r, t in locals_.items()}
        return ShardedLeaf(meta.shape, meta.dtype.torch, spec, shards, placement)

    device_bytes = sum(locals_[r].numel() * locals_[r].element_size() for r in moved)
    return _Dest(meta, spec, pieces, dict(locals_), finish, device_bytes, placement)


def _spec_problem(key: str, spec: Layout, shape: tuple[int, ...]) -> str | None:
    """Why a target's ``spec`` cannot lay out its ``shape`` (an :class:`Abstract` is made without checking)."""
    try:
        spec.check(shape)
    except LayoutError as e:
        return f"leaf {_where(key)}: the target's spec does not fit its shape {shape}: {e}"
    return None


def _target_problem(key: str, stored: ArrayMeta, shape: tuple[int, ...], dtype_name: str) -> str | None:
    if stored.shape != shape:
        return f"leaf {_where(key)}: the checkpoint has shape {stored.shape}, the target has {shape}"
    if stored.dtype.name != dtype_name:
        return f"leaf {_where(key)}: the checkpoint has dtype {stored.dtype.name}, the target has {dtype_name}"
    return None


def load(
    path: PathLike,
    target: Any = None,
    *,
    namespace: str = "",
    executor: ExecutorOptions | None = None,
    process_group: Any = None,
    include: str | Sequence[str] | None = None,
    monitor: Monitor | None = None,
    inplace: bool = False,
) -> Any:
    """Load a checkpoint, functionally: return a new tree (or, with ``inplace``, fill the target's tensors).

    Args:
      path: a committed checkpoint: a path, URL, kvstore spec or :class:`Location`.
      target: None to rebuild the stored tree with full tensors (numpy leaves come back
        as numpy arrays); or a tree whose structure the result takes, whose leaves say
        what to load: a tensor or numpy array (full, same shape and dtype, on the
        tensor's device), a :class:`ShardedLeaf` (its spec and ranks: resharding), an
        :class:`Abstract` (a full tensor, or the shards of its spec), a DTensor (its
        mesh and placements), or a plain Python value (replaced by the stored value;
        a stored enum member comes back as a member of the target leaf's enum type, or
        of its own type if that type's module is imported). Stored leaves the target
        lacks are not read. A tensor on the meta device holds no memory to load into
        and is refused.
      namespace: the optree namespace of custom pytree nodes.
      executor: concurrency of the I/O.
      include: key-path globs (``fnmatch``, e.g. ``"model.layers.*.weight"``): load only
        the matching leaves, and return them as a flat dict from key path to leaf.
        Other leaves are not read. Only with ``target=None``.
      process_group: the ranks that load together: those of ``process_group``, else
        the whole world. When torch.distributed is initialised (at any world size) or
        a group is given, each of them calls ``load`` and gets its own part: its
        DTensor shards (nothing of a DTensor whose mesh it is not on), its shard of
        each ShardedLeaf or Abstract spec, and full copies of plain tensors. Each rank
        reads only its regions; a region several ranks want is read once and sent on.
        With one rank it runs as a single process does (DTensors on a mesh of that
        rank alone). If any rank fails, every rank raises the same error.
      monitor: a :class:`Monitor` that records the time and bytes of every phase
        (on rank 0, every rank's).
      inplace: fill the target's own tensors instead of making new ones, and return
        them (the same objects: tensors, Parameters, DTensors, the shards of a
        ShardedLeaf, writeable numpy arrays). Reads land straight in their memory; a
        tensor whose memory cannot take them (on a GPU, or a non-contiguous view) gets a
        buffer of its own size, copied into it once read. Peak memory is the state plus
        at most those buffers, not twice the state as ``load`` then
        ``load_state_dict``. Leaves with no memory (:class:`Abstract`) and plain Python
        values come back as ``load`` makes them. If the load fails, the target's tensors
        may hold part of the checkpoint (the error says so). Needs ``target``.

    Raises:
      NotCommittedError: ``path`` holds no committed checkpoint.
      TargetMismatchError: listing every target leaf that the checkpoint lacks or that
        differs in shape, dtype or kind, meta-device targets, and enum members whose
        type is neither imported nor given by the target.
      MetadataError: the metadata is malformed or unsafe, or ``include`` selects a key
        path that names several leaves (documents of older versions).
    """
    # A save in flight may be running collectives on the checkpoint groups, and may be
    # writing the very checkpoint asked for: let it finish first.
    if inplace and (target is None or include is not None):
        raise CheckpointError("load(..., inplace=True) fills the tensors of a target: pass target, and no include")
    _wait_in_flight()
    comm = _comm(process_group)
    spans = Monitor()
    with gc_paused():
        try:
            if comm is not None:
                return _load(path, target, namespace, executor, include, comm, spans, inplace=inplace)
            return _again_if_replaced(
                path,
                executor,
                "loaded",
                lambda seen: _load(path, target, namespace, executor, include, comm, spans, seen, inplace=inplace),
            )
        except BaseException as e:
            if inplace and not isinstance(e, TargetMismatchError):  # (a mismatch is found before any read)
                e.add_note("load(..., inplace=True) failed: the target's tensors may hold part of the checkpoint")
            raise
        finally:
            if monitor is not None:
                monitor.extend(spans.spans)


def plan_load_of(
    path: PathLike,
    target: Any = None,
    *,
    namespace: str = "",
    executor: ExecutorOptions | None = None,
    process_group: Any = None,
) -> LoadPlan:
    """The load plan this rank runs for ``load(path, target)``: the metadata is read, no array.

    The same planning ``load`` does (rank 0 reads the metadata and sends it to the
    others, the target is matched against it, the ranks' layouts agreed on, this rank's
    part planned, or every rank's in a single process), for inspecting who reads which
    stored boxes into which ranks' pieces. Call it on every rank of ``process_group`` in
    a distributed job, as ``load``. Each plan array is a target leaf that is an array, in
    the target's order.
    """
    _wait_in_flight()
    with gc_paused():
        plan: LoadPlan = _load(path, target, namespace, executor, None, _comm(process_group), Monitor(), plan_only=True)
    return plan


LOAD_ATTEMPTS = 4
"""How many times a read starts again when the checkpoint is replaced under it (another process saving there)."""


def _again_if_replaced(
    path: PathLike, executor: ExecutorOptions | None, what: str, read: Callable[[list[bytes]], _T]
) -> _T:
    """``read(seen)``, started again when it failed because the checkpoint was replaced under it.

    ``read`` appends the metadata document it read to ``seen``; after its failure the
    document is read again (:func:`_raise_unless_replaced`), and ``read`` starts again if
    it changed, up to ``LOAD_ATTEMPTS`` times in all: then a NotCommittedError says the
    checkpoint kept being replaced while it was being ``what``.
    """
    seen: list[bytes] = []
    attempts = 0
    while True:
        seen.clear()
        try:
            return read(seen)
        except (CheckpointError, OSError) as e:
            if not seen or isinstance(e, (NotCommittedError, TargetMismatchError)):
                raise
            _raise_unless_replaced(path, executor, seen[0], e, what)
            attempts += 1
            if attempts == LOAD_ATTEMPTS:
                raise NotCommittedError(
                    f"{describe(path)} was replaced {attempts} times while it was being {what} (another "
                    f"process saving there); the last failure: {e}"
                ) from e


def _replaced(storage: Storage, document: bytes) -> bool:
    """Whether the metadata document at ``storage`` is no longer ``document`` (or is gone)."""
    try:
        return storage.read_metadata() != document
    except NotCommittedError:
        return True


def _raise_unless_replaced(
    path: PathLike, executor: ExecutorOptions | None, document: bytes, error: Exception, what: str = "loaded"
) -> None:
    """Return if the read that read ``document`` and failed with ``error`` lost a race with a new save there.

    Each save names its arrays anew and deletes the replaced ones only after its commit,
    so a read of the old document may find its arrays gone: the new document is then
    read instead. When the document is unchanged the failure is the checkpoint's own,
    and ``error`` is raised (as a CheckpointError); NotCommittedError when it is gone.
    """
    try:
        now = Storage(path, executor).read_metadata()
    except NotCommittedError:
        raise NotCommittedError(f"{describe(path)} was removed while it was being {what}") from error
    if now != document:
        return
    if isinstance(error, CheckpointError):
        raise error
    raise CheckpointError(f"{describe(path)} could not be {what}: {error}") from error


def _load(
    path: PathLike,
    target: Any,
    namespace: str,
    executor: ExecutorOptions | None,
    include: str | Sequence[str] | None,
    comm: Comm | None,
    monitor: Monitor,
    seen: list[bytes] | None = None,
    plan_only: bool = False,
    inplace: bool = False,
) -> Any:
    me = 0 if comm is None else comm.rank
    t0 = time.time()
    # In a distributed load, what a rank does before a collective is carried into it: a
    # rank that raised alone would leave the others waiting for the collective's timeout.
    carried = _Carried(comm)
    raw = None
    with carried.catch():
        storage = Storage(path, executor)
        buffers = _Buffers(huge=storage.options.huge_pages, meta=plan_only)
        if comm is None or comm.rank == 0:
            raw = storage.read_metadata()
            if seen is not None:
                seen.append(raw)  # to tell, after a failure, whether the checkpoint was replaced meanwhile
    if comm is not None:
        carried.agree("reading the checkpoint metadata")
        raw = comm.broadcast(raw)
    assert raw is not None
    results: list[Any] = []
    dests: list[tuple[int, _Dest]] = []
    with carried.catch():
        doc = _parse(storage, raw, namespace)
        t_paths: list[tuple[KeyEntry, ...]] | None = None  # the target's key paths (None: the stored tree's)
        if include is None and target is None:  # the stored tree: its leaves in order, no paths to match
            t_leaves: list[Any] = [None] * len(doc.leaves)
            structure: Node = doc.tree
            target_given = False
            stored_of: list[ArrayMeta | ValueMeta | None] = list(doc.leaves)
        else:
            stored_paths = doc.tree.paths()
            by_path = dict(zip(stored_paths, doc.leaves, strict=True))
        if include is not None:
            if target is not None:
                raise TargetMismatchError("include= selects leaves of the stored tree; give it with target=None")
            patterns = [include] if isinstance(include, str) else list(include)
            chosen = [
                (p, leaf)
                for p, leaf in zip(stored_paths, doc.leaves, strict=True)
                if any(fnmatch.fnmatchcase(leaf.key, pat) for pat in patterns)
            ]
            ambiguous = _ambiguous_keys(doc)
            for _, leaf in chosen:
                if leaf.key in ambiguous:
                    raise _ambiguity_error(leaf.key, ambiguous[leaf.key], describe(path))
            t_leaves = [None] * len(chosen)
            t_paths = [p for p, _ in chosen]
            structure = Node(
                "dict", [("s", leaf.key) for _, leaf in chosen], [leaf_node(i) for i in range(len(chosen))]
            )
            target_given = False
        elif target is not None:
            target_given = True
            t_leaves, t_paths, structure = flatten(target, _is_leaf, namespace=namespace)
        if t_paths is not None:
            stored_of = [by_path.get(p) for p in t_paths]
        # Before any destination is allocated: the stored bytes must back every claimed shape.
        wanted = [m for m in stored_of if isinstance(m, ArrayMeta)]
        if not plan_only:  # (a plan reads no array: it needs only the metadata)
            storage.check_stored_sizes(wanted)
        if not target_given:  # whole arrays of the shapes the metadata claims (a target's shapes are the caller's)
            _check_memory(path, [(m.key, m.nbytes) for m in wanted])
        problems: list[str] = []
        results = [None] * len(t_leaves)
        # Whole small arrays read straight from their archives into new memory, without a plan:
        # (result index, stored, target or None)
        lean = comm is None and not plan_only
        small: list[tuple[int, ArrayMeta, Any]] = []
        for i, (leaf, stored) in enumerate(zip(t_leaves, stored_of, strict=True)):
            if (
                not target_given
                and lean
                and type(stored) is ArrayMeta
                and storage.small_whole(stored)
                and (stored.container == "numpy" or stored.dtype.name in TORCH_NAMES)
            ):
                small.append((i, stored, None))
                continue
            # (a leaf found by its path has the key the save gave that path: keystr's, made once then)
            key = stored.key if stored is not None else keystr(t_paths[i])  # type: ignore[index]
            if stored is None:
                problems.append(f"leaf {_where(key)} of the target is not in the checkpoint")
                continue
            if not target_given:
                if isinstance(stored, ValueMeta):
                    results[i] = _value(key, stored.value, None, problems)
                else:
                    dests.append(
                        (i, _full_dest(stored, stored.container == "numpy", None, None, comm, buffers=buffers))
                    )
                continue
            if (
                lean
                and not inplace
                and (type(leaf) is torch.Tensor or type(leaf) is torch.nn.Parameter)
                and leaf.device.type == "cpu"
                and isinstance(stored, ArrayMeta)
                and storage.small_whole(stored)
                and tuple(leaf.shape) == stored.shape
                and stored.dtype.name in TORCH_NAMES
                and leaf.dtype == stored.dtype.torch
            ):
                small.append((i, stored, leaf))
                continue
            if _is_value(leaf):
                if isinstance(stored, ValueMeta):
                    results[i] = _value(key, stored.value, leaf, problems)
                else:
                    problems.append(
                        f"leaf {_where(key)}: the checkpoint has an array of shape {stored.shape} and dtype "
                        f"{stored.dtype.name}, the target has a {type(leaf).__name__}"
                    )
                continue
            if isinstance(stored, ValueMeta):
                problems.append(
                    f"leaf {_where(key)}: the checkpoint has the value {stored.value!r}, the target has an array"
                )
                continue
            try:  # (what carried.catch(key) does, without entering a block per leaf)
                problem, dest = _dest_for(key, stored, leaf, buffers, comm, inplace)
            except Exception as e:
                carried.carry(e, key)
                continue
            if problem is not None:
                problems.append(problem)
            elif dest is not None:
                dests.append((i, dest))
        if problems:
            raise TargetMismatchError(
                f"the target does not match the checkpoint at {describe(path)}:\n  " + "\n  ".join(problems)
            )
    specs: list[ArraySpec] = []
    with carried.catch():
        specs = [d.spec() for _, d in dests]
    base: tuple[Any, ...] | None = None
    if comm is not None:
        agreed = _agree_on_specs(comm, specs, [d.meta.dtype.name for _, d in dests], "load", carried.error)
        base = None if agreed is None else agreed[0]
        world = comm.world
    else:
        world = max((_span(d.layout, d.ranks) for _, d in dests), default=1)
    rank = None if comm is None else comm.rank
    chunks = [d.meta.chunk_shape for _, d in dests]
    plan = LoadPlan(world, ())
    with carried.catch():
        extra = (world, rank, tuple(chunks))
        plan_key = spec_plan_key(specs, *extra) if base is None else (*base, *extra)
        plan = _LOAD_PLANS.get_or(plan_key, lambda: plan_load(chunks, specs, world, rank=rank))
        if comm is None:
            plan = _held(plan, [d.pieces for _, d in dests])
    carried.agree("planning the load")
    if plan_only:
        return plan
    metas = [d.meta for _, d in dests]
    getters = [d.get for _, d in dests]
    thread = threading.current_thread().name
    monitor.add(Span("load", "plan", me, t0, time.time(), 0, thread))
    h2d_bytes, h2d_seconds = [0], [0.0]

    def finish(k: int) -> None:
        """Make array ``k``'s result leaf: for a device target, start its host-to-device copy."""
        i, d = dests[k]
        start = time.perf_counter()
        results[i] = d.finish()
        if d.device_bytes:
            h2d_bytes[0] += d.device_bytes
            h2d_seconds[0] += time.perf_counter() - start

    mine = sum(op.region.size * ap.itemsize for ap in plan.arrays for op in ap.reads if comm is None or op.reader == me)
    small_bytes = sum(m.nbytes for _, m, _ in small)
    mine += small_bytes
    progress = Progress.maybe(storage.options.progress and me == 0, "load", mine)
    try:
        if small:
            with monitor.phase("load", "read", me) as box:
                for (i, meta, leaf), value in zip(small, storage.read_small([m for _, m, _ in small]), strict=True):
                    results[i] = _small_result(meta, value, leaf)
                box[0] = small_bytes
            progress.advance(small_bytes)
        if comm is None:
            # each array's host-to-device copy starts as soon as it is read, overlapping later reads
            with monitor.phase("load", "read", me) as box, Prefault(buffers.fresh):
                box[0] = read_arrays(
                    storage, metas, plan.arrays, getters, None, array_done=finish, progress=progress.advance
                )
        else:
            error = None
            after, forward = data_comm(comm, "reading").read_forwarding(
                plan.arrays, getters, [m.dtype.numpy for m in metas]
            )
            try:
                with monitor.phase("load", "read", me) as box, Prefault(buffers.fresh):
                    box[0] = read_arrays(
                        storage, metas, plan.arrays, getters, comm.rank, after=after, progress=progress.advance
                    )
            except Exception as e:
                error = e
            finally:
                with monitor.phase("load", "transfer", me):
                    forward()  # every posted transfer completes, even after a failed read
            if error is None:
                try:  # (a failure here too must reach the agreement, or the others would wait for this rank)
                    for k in range(len(dests)):
                        finish(k)
                except Exception as e:
                    error = e
            comm.agree(error, "loading the checkpoint")
    finally:
        progress.close()
    if h2d_bytes[0]:
        end = time.time()
        monitor.add(Span("load", "h2d", me, end - h2d_seconds[0], end, h2d_bytes[0], thread))
    if comm is not None:
        _gather_spans(comm, monitor)
    return structure.unflatten(results)


_LOAD_PLANS = PlanCache(4)  # the plans of the last few loads: a load into the layout of one of them reuses its plan


def _held(plan: LoadPlan, held: Sequence[Mapping[int, Any]]) -> LoadPlan:
    """``plan`` without the reads into ranks whose memory this process does not hold (a ShardedLeaf of some ranks)."""
    arrays = []
    for ap, ranks in zip(plan.arrays, held, strict=True):
        reads = ap.reads
        if any(t.rank not in ranks for op in reads for t in op.targets):
            kept = ((op, tuple(t for t in op.targets if t.rank in ranks)) for op in reads)
            reads = tuple(dataclasses.replace(op, targets=ts) for op, ts in kept if ts)
            ap = dataclasses.replace(ap, reads=reads)
        arrays.append(ap)
    return dataclasses.replace(plan, arrays=tuple(arrays))


def _value(key: str, value: Any, like: Any, problems: list[str]) -> Any:
    """A stored Python value as the target asks for it (enum members), or a problem noted."""
    try:
        return resolve_value(value, like)
    except TypeError as e:
        problems.append(f"leaf {_where(key)}: {e}")
        return None


def _dtensor_dest(meta: ArrayMeta, leaf: Any, comm: Comm | None, inplace: bool = False, *, buffers: _Buffers) -> _Dest:
    """This rank's local shard of a DTensor target, in the target's own mesh and placements.

    With ``inplace`` the reads land in the DTensor's own local tensor, and the result is ``leaf``.
    """
    from torch.distributed.tensor import DTensor

    from pytreeckpt.distributed._comm import dtensor_layout

    # (in a single process, a process group of one rank, its mesh must be this rank alone)
    layout, ranks, position, _ = dtensor_layout(leaf, comm)
    me = 0 if comm is None else comm.rank
    pieces = {me: layout.pieces_of(position, meta.shape) if position is not None else ()}
    local_target = leaf.to_local()
    on_device = local_target.device.type != "cpu"
    if inplace:
        if _fillable(local_target):
            return _Dest(meta, layout, pieces, {me: local_target.detach()}, lambda: leaf, 0, ranks)
        staged = buffers.tensor(tuple(local_target.shape), meta.dtype.torch, local_target.is_cuda)

        def filled() -> Any:
            _into(local_target, staged)
            return leaf

        return _Dest(
            meta,
            layout,
            pieces,
            {me: staged},
            filled,
            staged.numel() * staged.element_size() if on_device else 0,
            ranks,
        )
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

    return _Dest(
        meta, layout, pieces, {me: local}, finish, local.numel() * local.element_size() if on_device else 0, ranks
    )


def read_array(
    path: PathLike, meta: ArrayMeta, region: Region | None = None, executor: ExecutorOptions | None = None
) -> torch.Tensor:
    """A stored array, or the box ``region`` of it, as a CPU tensor (``meta`` from :func:`metadata`).

    Only the chunks the region touches are read.
    """
    return _read_region(Storage(path, executor), path, meta, region)


def _read_region(storage: Storage, path: PathLike, meta: ArrayMeta, region: Region | None) -> torch.Tensor:
    """:func:`read_array` on ``storage`` (the location ``path``)."""
    storage.check_stored_sizes([meta])
    region = Region.full(meta.shape) if region is None else region
    _check_memory(path, [(meta.key, region.size * meta.dtype.itemsize)])
    buffers = _Buffers(huge=storage.options.huge_pages)
    try:
        out = buffers.tensor(region.shape, meta.dtype.torch, pinned=False)
    except AllocationFailed as e:
        raise CheckpointError(f"leaf {meta.key!r}: {e}") from e

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        return numpy_view(out), region

    plan = plan_load(
        [meta.chunk_shape], [ArraySpec(meta.key, meta.shape, meta.dtype.itemsize, ExplicitRegions([[region]]))], 1
    )
    with Prefault(buffers.fresh):
        read_arrays(storage, [meta], plan.arrays, [get], rank=None)
    return out


def _region_of(index: Any, shape: tuple[int, ...], key: str) -> Region:
    """A box from an index of ints and step-1 slices (missing trailing dims are whole)."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape):
        raise TargetMismatchError(f"leaf {_where(key)}: index {index!r} has more dims than shape {shape}")
    offset, extent = [], []
    for d, n in enumerate(shape):
        it = items[d] if d < len(items) else slice(None)
        if isinstance(it, int) and not isinstance(it, bool):
            i = it + n if it < 0 else it
            if not 0 <= i < n:
                raise TargetMismatchError(f"leaf {_where(key)}: index {it} is out of range for dim {d} of size {n}")
            offset.append(i)
            extent.append(1)
        elif isinstance(it, slice) and it.step in (None, 1):
            lo, hi, _ = it.indices(n)
            offset.append(lo)
            extent.append(max(0, hi - lo))
        else:
            raise TargetMismatchError(f"leaf {_where(key)}: only ints and step-1 slices select a box, found {it!r}")
    return Region(tuple(offset), tuple(extent))


def load_slice(path: PathLike, key: str, index: Any = (), *, executor: ExecutorOptions | None = None) -> torch.Tensor:
    """Read part of one stored tensor, by key path and index, reading only the chunks it touches.

    ``index`` is an int, a step-1 slice or a tuple of them, as in ``t[index]`` (ints keep
    their dim, of size 1).

    A checkpoint replaced while it is read (another process saving there) is read again,
    from the new metadata, as :func:`load` does.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> pytreeckpt.save(d, {"emb": torch.arange(12.0).reshape(4, 3)})
    >>> pytreeckpt.load_slice(d, "emb", (slice(1, 3), 2))
    tensor([[5.],
            [8.]])
    """

    def attempt(seen: list[bytes]) -> torch.Tensor:
        storage, doc = _open(path, "", executor, seen)
        meta = _Arrays(path, doc).get(key)
        if meta is None:
            raise TargetMismatchError(f"leaf {_where(key)} is not an array of the checkpoint at {describe(path)}")
        return _read_region(storage, path, meta, _region_of(index, meta.shape, key))

    return _again_if_replaced(path, executor, "read", attempt)


def _meta_problem(key: str, leaf: Any) -> str | None:
    """A target on the meta device has no memory to load into: refused, saying how to make some."""
    if type(leaf) is Abstract:
        return None
    tensors = list(leaf.shards.values()) if isinstance(leaf, ShardedLeaf) else [leaf]
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return (
            f"leaf {_where(key)}: the target is a tensor on the meta device, which holds no data; materialise "
            f"the module with module.to_empty(device=...) first, or pass Abstract(shape, dtype) to get a new tensor"
        )
    return None


def _dest_for(
    key: str, stored: ArrayMeta, leaf: Any, buffers: _Buffers, comm: Comm | None = None, inplace: bool = False
) -> tuple[str | None, _Dest | None]:
    if comm is not None and type(leaf) is Abstract and leaf.spec is not None and not inplace:
        # (a rank's new shard of a sharded Abstract target: every leaf of a job's first load, thousands a rank)
        problem = _target_problem(key, stored, leaf.shape, dtype_of_torch(leaf.dtype).name)
        if problem:
            return problem, None
        return None, _own_shard_dest(stored, _own_shard_of(leaf.spec, leaf.placement, stored, comm, buffers), buffers)
    meta_problem = _meta_problem(key, leaf)
    if meta_problem is not None:
        return meta_problem, None
    if isinstance(leaf, ShardedLeaf):
        problem = _target_problem(key, stored, leaf.shape, dtype_of_torch(leaf.dtype).name)
        devices = {r: t.device for r, t in leaf.shards.items()}
        into = leaf if inplace else None
        if problem:
            return problem, None
        return None, _sharded_dest(
            stored, leaf.spec, sorted(leaf.shards), devices, comm, into, leaf.placement, buffers=buffers
        )
    if isinstance(leaf, Abstract):
        problem = _target_problem(key, stored, leaf.shape, dtype_of_torch(leaf.dtype).name)
        if problem:
            return problem, None
        if leaf.spec is None:
            return None, _full_dest(stored, False, None, None, comm, buffers=buffers)
        problem = _spec_problem(key, leaf.spec, leaf.shape)
        if problem:
            return problem, None
        positions = range(leaf.spec.world_size) if comm is None else ()  # (all, one process; a group: its own)
        return None, _sharded_dest(stored, leaf.spec, positions, {}, comm, None, leaf.placement, buffers=buffers)
    if isinstance(leaf, torch.Tensor):
        problem = _target_problem(key, stored, tuple(leaf.shape), dtype_of_torch(leaf.dtype).name)
        if problem:
            return problem, None
        if _is_dtensor(leaf):
            try:
                return None, _dtensor_dest(stored, leaf, comm, inplace, buffers=buffers)
            except LayoutError as e:
                return f"leaf {_where(key)}: {e}", None
        return None, _full_dest(stored, False, leaf.device, leaf, comm, inplace, buffers=buffers)
    arr = np.asarray(leaf)
    try:
        name = dtype_of_numpy(arr.dtype).name
    except ValueError as e:
        return f"leaf {_where(key)}: {e}", None
    problem = _target_problem(key, stored, tuple(arr.shape), name)
    return problem, None if problem else _full_dest(
        stored, True, None, leaf if inplace else None, comm, inplace, buffers=buffers
    )
