"""The functional API: ``save``, ``load`` and ``metadata``, in one process.

One process may hold the shards of every rank (ShardedLeaf.from_global makes such
leaves), which is how layouts are resharded and tested without a process group.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import math
import os
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from ._dtypes import DType, dtype_of_numpy, dtype_of_torch, numpy_view
from ._errors import CheckpointError, LayoutError, TargetMismatchError
from ._executor import ChunkReuse, ExecutorOptions, PieceData, Storage, write_items
from ._format import (
    ARRAYS_DIR,
    MAX_PACKED_BYTES,
    PACKED_DIR,
    ArrayMeta,
    Compression,
    ValueMeta,
    array_names,
    build_document,
    parse_document,
    with_chunk_hashes,
)
from ._leaf import Abstract, ShardedLeaf, piece_view
from ._location import Where, describe
from ._monitor import Monitor, Progress, Span
from ._pipeline import Snapshot, staged_writes
from ._plan import ArrayLayout, ChunkingOptions, SavePlan, plan_load
from ._plan_cache import cached_plan_save
from ._region import Region
from ._sharding import Layout, Mesh, Piece, Replicate, ShardingSpec
from ._staging import PoolAborted, staging_pool
from ._tree import PYTHON_LEAF_TYPES, KeyEntry, Node, broadcast_prefix, encode_value, flatten, keystr

__all__ = [
    "CheckpointMetadata",
    "SaveHandle",
    "VerifyReport",
    "async_save",
    "load",
    "load_slice",
    "metadata",
    "save",
    "verify",
]

PathLike = Where  # a local path, a URL (file://, memory://, s3://, gs://), a kvstore spec or a Location
_SINGLE = ShardingSpec(Mesh(1), [Replicate()])


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray, np.generic, ShardedLeaf, Abstract, *PYTHON_LEAF_TYPES))


def _is_value(x: Any) -> bool:
    """A plain Python leaf, stored inline (numpy scalars, though float subclasses, are arrays)."""
    return isinstance(x, PYTHON_LEAF_TYPES) and not isinstance(x, np.generic)


def _where(key: str) -> str:
    return repr(key) if key else "(root)"


def _is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and type(x).__module__.startswith("torch.distributed")


def _comm(process_group: Any) -> Any:
    """The DistComm of a distributed save or load, or None in a single process."""
    from ._distributed import DistComm, checkpoint_group, distributed_active

    if not distributed_active(process_group):
        return None
    return DistComm(checkpoint_group(process_group))


@dataclass(slots=True)
class _ArrayIn:
    """A tensor leaf on its way to storage."""

    key: str
    container: str
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout
    saved_layout: Layout | None
    pieces: tuple[tuple[Piece, ...], ...]
    get: PieceData
    present: frozenset[int] | None = None  # ranks whose data is here; None: all
    device: Any = None  # DeviceData for leaves on a CUDA device, else None
    watch: tuple[torch.Tensor, ...] = ()  # tensors whose version counters tell of a change during a snapshot


def _global_source(arr: np.ndarray, pieces: tuple[tuple[Piece, ...], ...]) -> PieceData:
    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        region = pieces[rank][pi].region
        return arr[region.slices()], region

    return get


def _shard_sources(shards: Mapping[int, torch.Tensor], pieces: tuple[tuple[Piece, ...], ...]) -> tuple[PieceData, Any]:
    """Getters of the pieces of ranks' local tensors: numpy views of CPU memory, and for
    CUDA shards also views on the device (the CPU copy is then made only if asked for)."""
    cpu: dict[int, torch.Tensor] = {}

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        if rank not in shards:
            raise CheckpointError(f"internal error: data of rank {rank} asked for, this process holds {sorted(shards)}")
        if rank not in cpu:
            cpu[rank] = shards[rank].detach().cpu()
        piece = pieces[rank][pi]
        return numpy_view(piece_view(cpu[rank], piece)), piece.region

    if not any(t.is_cuda for t in shards.values()):
        return get, None

    def device(rank: int, pi: int) -> tuple[torch.Tensor, Region]:
        piece = pieces[rank][pi]
        return piece_view(shards[rank].detach(), piece), piece.region

    return get, device


def _tensor_source(t: torch.Tensor, pieces: tuple[tuple[Piece, ...], ...]) -> tuple[PieceData, Any]:
    """Getters of the pieces of a global tensor held whole (every rank's piece is a box of it)."""
    if not t.is_cuda:
        return _global_source(numpy_view(t.detach().cpu()), pieces), None
    held: list[np.ndarray] = []

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        if not held:
            held.append(numpy_view(t.detach().cpu()))
        return _global_source(held[0], pieces)(rank, pi)

    def device(rank: int, pi: int) -> tuple[torch.Tensor, Region]:
        region = pieces[rank][pi].region
        return t.detach()[region.slices()], region

    return get, device


def _pad(pieces: tuple[tuple[Piece, ...], ...], world: int, key: str) -> tuple[tuple[Piece, ...], ...]:
    if len(pieces) > world:
        raise LayoutError(f"leaf {_where(key)}: its spec spans {len(pieces)} ranks but the process group has {world}")
    return pieces + ((),) * (world - len(pieces))


def _array_in(key: str, leaf: Any, spec: Any, comm: Any = None) -> _ArrayIn:
    """Describe one tensor leaf for planning; ``comm`` is the DistComm in a distributed save."""
    if isinstance(leaf, Abstract):
        raise CheckpointError(f"leaf {_where(key)} is an Abstract placeholder, which has no data to save")
    if spec is not None and not isinstance(spec, Layout):
        raise CheckpointError(
            f"spec for leaf {_where(key)} must be a ShardingSpec, FlatRanges, ExplicitRegions or None, found {spec!r}"
        )
    try:
        if _is_dtensor(leaf):
            if comm is None:
                raise CheckpointError(
                    f"leaf {_where(key)} is a DTensor but torch.distributed is not initialised with more than one "
                    f"rank; convert it with .full_tensor() or to a ShardedLeaf"
                )
            from ._distributed import dtensor_layout

            layout, pieces = dtensor_layout(leaf, comm.world, comm.group)
            local = leaf.to_local()
            get, device = _shard_sources({comm.rank: local}, pieces)
            dtype = dtype_of_torch(leaf.dtype)
            shape = tuple(leaf.shape)
            return _ArrayIn(key, "torch", dtype, shape, layout, layout, pieces, get, device=device, watch=(local,))
        if isinstance(leaf, ShardedLeaf):
            if spec is not None and spec != leaf.spec:
                raise CheckpointError(
                    f"leaf {_where(key)} is a ShardedLeaf in layout {leaf.spec}, but the spec tree gives {spec}"
                )
            pieces = leaf.spec.rank_pieces(leaf.shape)
            if comm is not None:
                pieces = _pad(pieces, comm.world, key)
                if comm.rank not in leaf.shards:
                    raise CheckpointError(
                        f"leaf {_where(key)}: rank {comm.rank} saves a ShardedLeaf without its own shard "
                        f"(it holds ranks {sorted(leaf.shards)})"
                    )
                get, device = _shard_sources({comm.rank: leaf.shards[comm.rank]}, pieces)
                present = frozenset({comm.rank})
            else:
                get, device = _shard_sources(leaf.shards, pieces)
                present = frozenset(leaf.shards)
            watch = tuple(leaf.shards[r] for r in sorted(present))
            dtype = dtype_of_torch(leaf.dtype)
            return _ArrayIn(key, "torch", dtype, leaf.shape, leaf.spec, leaf.spec, pieces, get, present, device, watch)
        tensor: torch.Tensor | None = None
        if isinstance(leaf, torch.Tensor):
            tensor = leaf
            dtype = dtype_of_torch(leaf.dtype)
            local_shape = tuple(int(s) for s in leaf.shape)
            container = "torch"
        else:
            arr = np.asarray(leaf)
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
            pieces = whole.rank_pieces(local_shape)
            if tensor is not None:
                get, device = _tensor_source(tensor, pieces)
            else:
                get, device = _global_source(arr, pieces), None
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


@dataclass(slots=True)
class _SaveJob:
    storage: Storage
    metas: list[ArrayMeta]
    plan: SavePlan
    data: list[PieceData]
    document: bytes
    overwrite: bool
    timings: dict[str, float]
    monitor: Monitor
    comm: Any = None
    device: list[Any] = field(default_factory=list)
    watch: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    reuse: ChunkReuse | None = None
    snap: Snapshot | None = None
    _lock: Any = None

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else int(self.comm.rank)

    def _progress(self, what: str, nbytes: int) -> Progress:
        return Progress.maybe(self.storage.options.progress and self.rank == 0, what, nbytes)

    def stage(self) -> tuple[Snapshot, float, int]:
        """Prepare the pipelined snapshot: the pieces to copy and a staging pool to hold them.

        In a distributed save this rank's fragments of merged writes are copied here,
        before the writer starts sending them. Returns the snapshot, the start time of
        the caller's stall and the bytes copied so far.
        """
        start = time.time()
        merged = 0
        if self.comm is not None:
            self.data, merged = _snapshot_merges(self.plan.arrays, self.data, self.comm.rank)
        opts = self.storage.options
        rank = None if self.comm is None else self.comm.rank
        writes = staged_writes(self.plan.arrays, rank, opts.staging_piece_bytes)
        sizes = [-(-max(w.nbytes, 1) // 64) * 64 for w in writes]
        need = sum(sizes)
        capacity = need if opts.staging_bytes is None else min(need, opts.staging_bytes)
        capacity = max(capacity, max(sizes, default=0))
        device = self.device or [None] * len(self.metas)
        pool = staging_pool()
        pool.reserve(capacity, pin=any(d is not None for d in device))
        torch_dtypes = [_torch_dtype_or_none(m) for m in self.metas]
        dtypes = [m.dtype.numpy for m in self.metas]
        watch = [_versions(ts) for ts in self.watch] if self.watch else []
        self.snap = Snapshot(
            writes,
            self.data,
            device,
            dtypes,
            torch_dtypes,
            pool,
            hold=capacity >= need,
            watch=watch,
            keys=[m.key for m in self.metas],
        )
        return self.snap, start, merged

    def snapshot(self, snap: Snapshot, start: float, merged: int) -> None:
        """The caller's part of an asynchronous save: copy the pieces, feeding the writer as they are ready."""
        progress = self._progress("snapshot", snap.nbytes)
        try:
            snap.run(progress.advance if progress.stream else None)
        finally:
            progress.close()
            end = time.time()
            thread = threading.current_thread().name
            self.monitor.add(Span("save", "snapshot", self.rank, start, end, merged + snap.copied_bytes, thread))
            self.timings["snapshot"] = end - start

    def _items(self) -> Any:
        """This process's writes: staged pieces in an asynchronous save, else views of the caller's memory."""
        if self.snap is not None:
            return self.snap.items()
        dtypes = [m.dtype.numpy for m in self.metas]
        return ((i, op.region, buf, None) for i, op, buf in write_items(self.plan.arrays, self.data, dtypes, None))

    def persist(self) -> None:
        """Write and commit: the single-process path, or this rank's part of a distributed save."""
        t0 = time.perf_counter()
        if self.comm is None:
            lock = self.storage.lock()
            try:
                self.storage.prepare(self.overwrite)
                total = sum(op.region.size * ap.itemsize for ap in self.plan.arrays for op in ap.writes)
                progress = self._progress("save", total)
                try:
                    with self.monitor.phase("save", "write", 0) as box:
                        box[0] = self.storage.write(
                            self.metas, self._items(), progress=progress.advance, reuse=self.reuse
                        )
                finally:
                    progress.close()
                t1 = time.perf_counter()
                with self.monitor.phase("save", "commit", 0):
                    self.storage.commit(self._final_document(None))
            finally:
                lock.release()
        else:
            try:
                t1 = self._persist_distributed()
            finally:
                if self._lock is not None:
                    self._lock.release()
                    self._lock = None
        self.timings["write"] = t1 - t0
        self.timings["commit"] = time.perf_counter() - t1

    def _final_document(self, gathered: list[Any] | None) -> bytes:
        """The metadata document, with every array's chunk hashes when they were computed."""
        reuse = self.reuse
        if reuse is None:
            return self.document
        if gathered is not None:  # every rank's hashes, on rank 0
            for other in gathered:
                for i, got in (other or {}).items():
                    reuse.hashes.setdefault(i, {}).update(got)
        hashes = {m.key: reuse.chunk_hashes(i) for i, m in enumerate(self.metas)}
        return with_chunk_hashes(self.document, {k: v for k, v in hashes.items() if v})

    def _persist_distributed(self) -> float:
        """Rank 0 prepares the directory (holding its lock), every rank writes, rank 0 commits."""
        comm = self.comm
        me = comm.rank
        error: BaseException | None = None
        if me == 0:
            try:
                self._lock = self.storage.lock()
                self.storage.prepare(self.overwrite)
                self.storage.open_arrays([m for m in self.metas if m.database is None], create=True)
            except Exception as e:
                error = e
        comm.agree(error, "preparing the checkpoint directory")
        try:  # each rank alone writes its own OCDBT database of packed arrays
            self.storage.open_arrays([m for m in self.metas if m.database == f"{PACKED_DIR}/{comm.rank}"], create=True)
        except Exception as e:
            error = e
        comm.agree(error, "creating the packed arrays")
        dtypes = [m.dtype.numpy for m in self.metas]
        transfers = comm.post_write_transfers(self.plan.arrays, self.data, dtypes, direct=self.snap is None)
        mine = sum(op.region.size * ap.itemsize for ap in self.plan.arrays for op in ap.writes if op.writer == me)
        progress = self._progress("save", mine)
        try:
            with self.monitor.phase("save", "write", me) as box:
                staged = self.snap.items() if self.snap is not None else iter(())
                items = itertools.chain(staged, transfers.items())
                box[0] = self.storage.write(
                    self.metas, items, create=False, progress=progress.advance, reuse=self.reuse
                )
        except Exception as e:
            error = e
        finally:
            progress.close()
            with self.monitor.phase("save", "merge", me, transfers.received_bytes()):
                transfers.wait_all()
        comm.agree(error, "writing the checkpoint")
        t1 = time.perf_counter()
        gathered = comm.gather(self.reuse.hashes) if self.reuse is not None else None
        if me == 0:
            try:
                with self.monitor.phase("save", "commit", 0):
                    self.storage.commit(self._final_document(gathered))
            except Exception as e:
                error = e
        comm.agree(error, "committing the checkpoint")
        _gather_spans(comm, self.monitor)
        return t1


def _versions(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple[torch.Tensor, int], ...]:
    out = []
    for t in tensors:
        try:
            out.append((t, t._version))
        except RuntimeError:  # inference tensors keep no version counter
            continue
    return tuple(out)


def _torch_dtype_or_none(meta: ArrayMeta) -> torch.dtype | None:
    try:
        return meta.dtype.torch
    except KeyError:  # numpy-only dtypes
        return None


def _gather_spans(comm: Any, monitor: Monitor) -> None:
    """Bring every rank's spans of this call to rank 0's monitor (the other ranks keep their own)."""
    mine = [s.to_json() for s in monitor.spans if s.rank == comm.rank]
    gathered = comm.gather(mine)
    if comm.rank == 0:
        monitor.extend([Span.from_json(s) for r, spans in enumerate(gathered) if r != 0 for s in spans])


def _plan_job(
    path: PathLike,
    tree: Any,
    spec: Any,
    overwrite: bool,
    user_metadata: Mapping[str, Any] | None,
    chunking: ChunkingOptions | None,
    executor: ExecutorOptions | None,
    namespace: str,
    comm: Any = None,
    compression: Any = None,
    base: PathLike | None = None,
    chunk_hashes: bool = False,
) -> _SaveJob:
    t0 = time.perf_counter()
    storage = Storage(path, executor)
    leaves, paths, root = flatten(tree, _is_leaf, namespace=namespace)
    specs = broadcast_prefix(spec, root, lambda x: isinstance(x, Layout), len(leaves), namespace=namespace)
    keys = [keystr(p) for p in paths]
    codecs = _compressions(compression, root, keys, len(leaves), namespace)
    arrays: list[_ArrayIn] = []
    entries: list[dict[str, Any] | None] = []
    for key, leaf, sp in zip(keys, leaves, specs, strict=True):
        if _is_value(leaf):
            entries.append(ValueMeta(key, leaf).to_json(encode_value(leaf)))
        else:
            arrays.append(_array_in(key, leaf, sp, comm))
            entries.append(None)
    if comm is not None:
        layouts = _exchange_layouts(comm, [(a.key, a.dtype.name, a.shape, a.pieces[comm.rank]) for a in arrays], "save")
        for a, pieces in zip(arrays, layouts, strict=True):
            a.pieces = pieces
        world = comm.world
    else:
        world = max((a.layout.world_size for a in arrays), default=1)
    plan = cached_plan_save(
        [ArrayLayout(a.key, a.shape, a.dtype.itemsize, a.pieces) for a in arrays], world, chunking or storage.chunking
    )
    for a, ap in zip(arrays, plan.arrays, strict=True):
        if a.present is not None:
            for op in ap.writes:
                for frag in op.sources:
                    if frag.rank not in a.present and comm is None:
                        raise CheckpointError(
                            f"leaf {_where(a.key)}: elements {frag.region} live only on rank {frag.rank}, whose shard "
                            f"is not in this ShardedLeaf (it holds ranks {sorted(a.present)})"
                        )
    names = array_names([a.key for a in arrays])
    metas = [
        ArrayMeta(
            a.key,
            a.container,
            a.dtype,
            a.shape,
            ap.chunk_shape,
            f"{ARRAYS_DIR}/{name}",
            a.saved_layout,
            codecs[a.key],
            database=db,
        )
        for a, ap, name, db in zip(arrays, plan.arrays, names, _databases(storage, plan), strict=True)
    ]
    it = iter(metas)
    leaf_json = [e if e is not None else next(it).to_json() for e in entries]
    document = build_document(root, leaf_json, dict(user_metadata or {}))
    if comm is None or comm.rank == 0:
        storage.check_writable(overwrite)
    t1 = time.perf_counter()
    monitor = Monitor()
    rank = 0 if comm is None else comm.rank
    monitor.add(Span("save", "plan", rank, time.time() - (t1 - t0), time.time(), 0, threading.current_thread().name))
    reuse = _chunk_reuse(metas, base) if base is not None or chunk_hashes else None
    return _SaveJob(
        storage,
        metas,
        plan,
        [a.get for a in arrays],
        document,
        overwrite,
        {"plan": t1 - t0},
        monitor,
        comm,
        [a.device for a in arrays],
        [a.watch for a in arrays],
        reuse,
    )


def _chunk_reuse(metas: list[ArrayMeta], base: PathLike | None) -> ChunkReuse:
    """Hash this save's chunks; with a base checkpoint, link its chunks that are unchanged."""
    reuse = ChunkReuse([m.chunk_shape for m in metas], [m.shape for m in metas], [m.path for m in metas])
    if base is None:
        return reuse
    if not isinstance(base, (str, os.PathLike)) or "://" in os.fspath(base):
        raise CheckpointError(f"an incremental base must be a local directory, found {describe(base)}")
    stored = metadata(base).arrays
    if stored and all(b.chunk_hashes is None for b in stored.values()):
        raise CheckpointError(
            f"the base checkpoint {describe(base)} records no chunk hashes: save it with chunk_hashes=True "
            f"(CheckpointManager(incremental=True) does) to use it as a base"
        )
    reuse.base = Path(base).absolute()
    for m in metas:
        b = stored.get(m.key)
        same = (
            b is not None
            and b.chunk_hashes is not None
            and (b.shape, b.dtype.name, b.chunk_shape, b.compression)
            == (m.shape, m.dtype.name, m.chunk_shape, m.compression)
        )
        reuse.base_chunks.append((b.path, b.chunk_hashes) if same and b is not None and b.chunk_hashes else None)
    return reuse


def _is_compression(x: Any) -> bool:
    return x is None or isinstance(x, (str, Compression))


def _compressions(compression: Any, root: Any, keys: list[str], n: int, namespace: str) -> dict[str, Any]:
    """Each leaf's Compression (or None) from a prefix tree of compressions."""
    if compression is None:
        return dict.fromkeys(keys)
    chosen = broadcast_prefix(compression, root, _is_compression, n, namespace=namespace)
    out = {}
    for key, c in zip(keys, chosen, strict=True):
        try:
            out[key] = Compression.parse(c)
        except ValueError as e:
            raise CheckpointError(f"leaf {_where(key)}: {e}") from None
    return out


def _databases(storage: Storage, plan: SavePlan) -> list[str | None]:
    """Where each array goes: the OCDBT database of its writer if it is small, has one writer and packing is on."""
    opts = storage.location.options
    out: list[str | None] = []
    for ap in plan.arrays:
        nbytes = math.prod(ap.shape) * ap.itemsize
        one_writer = len({op.writer for op in ap.writes}) == 1
        packed = opts.pack_small_leaves and one_writer and 0 < nbytes <= min(opts.pack_max_bytes, MAX_PACKED_BYTES)
        out.append(f"{PACKED_DIR}/{ap.writes[0].writer}" if packed else None)
    return out


def _exchange_layouts(
    comm: Any, arrays: list[tuple[str, str, tuple[int, ...], tuple[Piece, ...]]], what: str
) -> list[tuple[tuple[Piece, ...], ...]]:
    """Gather every rank's own pieces of every array, once; check that the ranks describe the same arrays.

    A rank knows its own pieces for sure (a DTensor on a submesh says nothing of the
    ranks outside it), so each rank reports its own and all assemble the same layouts.
    """
    mine = [
        (key, dtype, list(shape), [(p.region.offset, p.region.shape, p.local_offset, p.local_box) for p in pieces])
        for key, dtype, shape, pieces in arrays
    ]
    gathered = comm.all_gather(mine)
    ref = [m[:3] for m in gathered[0]]
    for r, other in enumerate(gathered):
        desc = [m[:3] for m in other]
        if desc != ref:
            diff = next(
                (f"{a} versus {b}" for a, b in zip(ref, desc, strict=False) if a != b),
                f"{len(ref)} arrays versus {len(desc)}",
            )
            raise CheckpointError(
                f"ranks disagree on the state to {what}: rank 0 and rank {r} differ in (key, dtype, shape): {diff}"
            )
    return [
        tuple(
            tuple(Piece(Region(tuple(o), tuple(s)), lo, lb) for o, s, lo, lb in gathered[r][i][3])
            for r in range(comm.world)
        )
        for i in range(len(arrays))
    ]


def save(
    path: PathLike,
    tree: Any,
    spec: Any = None,
    *,
    overwrite: bool = False,
    user_metadata: Mapping[str, Any] | None = None,
    chunking: ChunkingOptions | None = None,
    executor: ExecutorOptions | None = None,
    namespace: str = "",
    process_group: Any = None,
    monitor: Monitor | None = None,
    compression: Any = None,
    base: PathLike | None = None,
    chunk_hashes: bool = False,
) -> None:
    """Save a pytree as a checkpoint at ``path``, returning once it is committed.

    Args:
      path: a directory (created if missing), a URL (``file://``, ``memory://``,
        ``s3://bucket/prefix``, ``gs://bucket/prefix``), a TensorStore kvstore spec, or a
        :class:`Location` with its :class:`StorageOptions`. An interrupted, uncommitted save there is
        cleared; a committed checkpoint is replaced only with ``overwrite=True``.
      tree: a pytree whose leaves are tensors, numpy arrays, :class:`ShardedLeaf` or
        plain Python values (int, float, bool, str, None).
      spec: a pytree prefix of ``tree`` whose leaves are sharding specs or None. A
        tensor under a spec is the global tensor, laid out as the spec says: this
        decides the chunk grid and which rank writes what.
      overwrite: replace a committed checkpoint at ``path``.
      user_metadata: a JSON object stored with the checkpoint.
      chunking: how stored arrays are chunked.
      executor: concurrency of the I/O, staging memory, progress bar.
      namespace: the optree namespace of custom pytree nodes in ``tree``.
      process_group: when torch.distributed is initialised with several ranks, every
        rank calls ``save`` with its own part of the state: DTensors, ShardedLeafs
        holding its shard, and plain tensors and values that every rank holds whole
        (written once in total). Checkpoint traffic runs on a gloo group of its own,
        or on ``process_group`` if given.
      monitor: a :class:`Monitor` that records the time and bytes of every phase
        (on rank 0, every rank's).
      compression: lossless compression of stored chunks, off by default: a
        :class:`Compression`, ``"zstd"``, ``"blosc"`` or None, or a pytree prefix of
        ``tree`` with one of those per subtree (like ``spec``).
      base: an earlier committed checkpoint (on a local file system): chunks whose
        content equals the base's are hard-linked from it instead of written, so a save
        after a small change writes little, and every checkpoint stays whole on its own
        (deleting the base frees nothing the new one uses). The base must have been
        saved with ``chunk_hashes`` (or a base of its own).
      chunk_hashes: record a content hash of every chunk, so that this checkpoint can be
        a ``base``; implied by ``base``.

    Raises:
      CheckpointError: naming the leaf, for anything that cannot be saved. In a
        distributed save every rank raises if any rank failed, and nothing is committed.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp()
    >>> pytreeckpt.save(d + "/ckpt", {"w": torch.ones(2, 3), "step": 7})
    >>> pytreeckpt.load(d + "/ckpt")["step"]
    7
    """
    _wait_in_flight()
    job = _plan_job(
        path,
        tree,
        spec,
        overwrite,
        user_metadata,
        chunking,
        executor,
        namespace,
        _comm(process_group),
        compression,
        base,
        chunk_hashes,
    )
    # The caller is blocked until the commit, so the state cannot change under the
    # writes: they read straight from the caller's memory, without a snapshot.
    try:
        job.persist()
    finally:
        if monitor is not None:
            monitor.extend(job.monitor.spans)


class SaveHandle:
    """A save running in the background: ``wait()``, ``done()``, per-phase ``timings`` and its ``monitor``."""

    def __init__(self, path: PathLike, timings: dict[str, float], monitor: Monitor, user: Monitor | None) -> None:
        self.path = describe(path)
        self._timings = timings
        self._monitor = monitor
        self._user = user
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._parties = 2  # the caller's snapshot and the writer: the last to finish settles the pool
        self._parties_lock = threading.Lock()
        self._copied = threading.Event()
        self._copy_error: BaseException | None = None

    def _run(self, job: _SaveJob) -> None:
        try:
            job.persist()
        except BaseException as e:
            staging_pool().abort()  # a caller still copying stops
            # The traceback's frames would keep the staging buffers alive as long as the
            # error is kept: drop their locals, keep the lines for the report.
            cause: BaseException | None = e
            seen: set[int] = set()
            while cause is not None and id(cause) not in seen:
                seen.add(id(cause))
                traceback.clear_frames(cause.__traceback__)
                cause = cause.__cause__ or cause.__context__
            self._error = e
        finally:
            job.data = []
            job.snap = None
            if self._user is not None:
                self._user.extend(self._monitor.spans)
            self._leave(job.storage.options.keep_staging)
            self._done.set()

    def _leave(self, keep: bool) -> None:
        """One side is done with the staging pool; the last frees it after a failure or when not kept."""
        with self._parties_lock:
            self._parties -= 1
            last = self._parties == 0
        if last and (self._error is not None or not keep):
            staging_pool().free()

    def _snapshot(self, job: _SaveJob, snap: Snapshot, start: float, merged: int) -> None:
        """The copy into staging memory (the caller's thread, or a thread of its own when lazy)."""
        try:
            job.snapshot(snap, start, merged)
        except PoolAborted:
            pass  # the writer failed: wait() reports it
        except BaseException as e:
            self._copy_error = e  # the writer was told and commits nothing
            raise
        finally:
            self._leave(job.storage.options.keep_staging)
            self._copied.set()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until the state is copied: from then on the caller may change it.

        Immediate for an eager snapshot. For ``snapshot="lazy"`` call it before the
        first in-place change of a saved tensor (:meth:`guard` does so for an optimizer).

        Raises:
          TimeoutError: not copied within ``timeout`` seconds.
          CheckpointError: the copy failed (for instance because a tensor was changed
            before it was copied); the save commits nothing.
        """
        if not self._copied.wait(timeout):
            raise TimeoutError(f"the snapshot for {self.path} is still being copied after {timeout} s")
        if self._copy_error is not None:
            raise self._copy_error

    def guard(self, *optimizers: torch.optim.Optimizer) -> None:
        """Make each optimizer's next ``step()`` first wait for this save's snapshot (a step pre-hook, used once).

        >>> import tempfile, torch, pytreeckpt
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> h = pytreeckpt.async_save(tempfile.mkdtemp() + "/c", model.state_dict(), snapshot="lazy")
        >>> h.guard(opt)
        >>> model(torch.ones(4)).sum().backward()  # forward and backward leave the parameters alone
        >>> opt.step()  # waits for the copy, then changes them
        >>> h.wait()
        """
        for opt in optimizers:
            hooks: list[Any] = []

            def wait_then_unhook(_opt: Any, _args: Any, _kwargs: Any, hooks: list[Any] = hooks) -> None:
                hooks[0].remove()
                self.wait_snapshot()

            hooks.append(opt.register_step_pre_hook(wait_then_unhook))

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; re-raise the background failure, if any.

        Raises:
          TimeoutError: not finished within ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"save to {self.path} still running after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error

    def _settle(self) -> None:
        """Wait; raise a failure nobody has seen yet (the next save is the last chance to report it)."""
        self._done.wait()
        if self._error is not None and not self._reported:
            self._reported = True
            raise CheckpointError(f"the previous async save to {self.path} failed: {self._error}") from self._error

    @property
    def timings(self) -> Mapping[str, float]:
        """Seconds per phase: plan, snapshot (the caller's stall), write, commit."""
        return MappingProxyType(self._timings)

    @property
    def monitor(self) -> Monitor:
        """The spans of this save (complete once it is done; on rank 0, every rank's)."""
        return self._monitor

    def __repr__(self) -> str:
        state = "failed" if self._error else "committed" if self.done() else "running"
        return f"SaveHandle({self.path!r}, {state})"


_IN_FLIGHT_LOCK = threading.Lock()
_in_flight: list[SaveHandle] = []


def _wait_in_flight() -> None:
    """Wait for the save in flight, if any; its failure surfaces here at the latest."""
    with _IN_FLIGHT_LOCK:
        pending = list(_in_flight)
        _in_flight.clear()
    for h in pending:
        h._settle()


def async_save(
    path: PathLike,
    tree: Any,
    spec: Any = None,
    *,
    overwrite: bool = False,
    user_metadata: Mapping[str, Any] | None = None,
    chunking: ChunkingOptions | None = None,
    executor: ExecutorOptions | None = None,
    namespace: str = "",
    process_group: Any = None,
    monitor: Monitor | None = None,
    snapshot: str = "eager",
    compression: Any = None,
    base: PathLike | None = None,
    chunk_hashes: bool = False,
) -> SaveHandle:
    """Like :func:`save`, but returns once the state is copied; writing and commit run behind.

    The caller may change the tree's tensors as soon as this returns. The copy goes into
    a staging pool (``ExecutorOptions.staging_bytes``), reused from save to save, piece
    by piece while the writer thread writes the pieces already copied; with a pool
    smaller than the state, the call also waits for the writes that free its memory.
    CUDA tensors are copied to pinned memory on a side stream; the caller's stream waits
    for those copies, the host does not. A new save first waits for the one in flight.
    Other arguments are those of :func:`save`.

    Args:
      snapshot: ``"eager"`` returns once the state is copied. ``"lazy"`` returns at
        once and copies on a thread of its own while training goes on, which is right
        while forward and backward passes leave parameters and optimizer state alone:
        the first in-place change must wait for :meth:`SaveHandle.wait_snapshot`
        (:meth:`SaveHandle.guard` makes an optimizer's step do so). A change that
        overtakes the copy is detected by the tensors' version counters and fails the
        save, which then commits nothing.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp()
    >>> w = torch.ones(3)
    >>> h = pytreeckpt.async_save(d + "/ckpt", {"w": w})
    >>> w.add_(1.0)  # training goes on; the checkpoint holds the state at the call
    tensor([2., 2., 2.])
    >>> h.wait()
    >>> pytreeckpt.load(d + "/ckpt")["w"]
    tensor([1., 1., 1.])
    """
    if snapshot not in ("eager", "lazy"):
        raise ValueError(f"snapshot must be 'eager' or 'lazy', found {snapshot!r}")
    _wait_in_flight()
    job = _plan_job(
        path,
        tree,
        spec,
        overwrite,
        user_metadata,
        chunking,
        executor,
        namespace,
        _comm(process_group),
        compression,
        base,
        chunk_hashes,
    )
    snap, start, merged = job.stage()
    handle = SaveHandle(path, job.timings, job.monitor, monitor)
    thread = threading.Thread(target=handle._run, args=(job,), name="pytreeckpt-save", daemon=False)
    with _IN_FLIGHT_LOCK:
        _in_flight.append(handle)
    thread.start()
    if snapshot == "lazy":
        copier = threading.Thread(
            target=_quietly, args=(handle._snapshot, job, snap, start, merged), name="pytreeckpt-snapshot"
        )
        copier.start()
        return handle
    try:
        handle._snapshot(job, snap, start, merged)
    except BaseException:
        # A copy failed: the writer was told and commits nothing; the error is reported here.
        handle._done.wait()
        handle._reported = True
        raise
    return handle


def _quietly(fn: Any, *args: Any) -> None:
    """Run ``fn`` on a thread whose errors are reported elsewhere (wait_snapshot and wait)."""
    with contextlib.suppress(BaseException):
        fn(*args)


# --------------------------------------------------------------------------- load


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
        return sum(a.nbytes for a in self.arrays.values())


def _open(path: PathLike, namespace: str, executor: ExecutorOptions | None) -> tuple[Storage, Any]:
    storage = Storage(path, executor)
    doc = parse_document(storage.read_metadata(), namespace=namespace)
    return storage, doc


def metadata(path: PathLike, *, namespace: str = "") -> CheckpointMetadata:
    """Read a committed checkpoint's metadata (no array data is read)."""
    _, doc = _open(path, namespace, None)
    leaves = [leaf.value if isinstance(leaf, ValueMeta) else _abstract_of(leaf) for leaf in doc.leaves]
    arrays = {leaf.key: leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta)}
    return CheckpointMetadata(doc.tree.unflatten(leaves), arrays, doc.user_metadata, doc.version)


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
    """

    path: str
    problems: tuple[tuple[str, tuple[int, ...] | None, str], ...]
    arrays: int
    chunks: int
    nbytes: int

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged_leaves(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(key for key, _, _ in self.problems))


def verify(path: PathLike, *, executor: ExecutorOptions | None = None) -> VerifyReport:
    """Read every chunk of every array of a checkpoint and check it (checksums, sizes, presence).

    Raises:
      NotCommittedError: ``path`` holds no committed checkpoint.
      MetadataError: the metadata document itself is damaged.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> pytreeckpt.save(d, {"w": torch.ones(4)})
    >>> pytreeckpt.verify(d).ok
    True
    """
    storage, doc = _open(path, "", executor)
    metas = [leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta)]
    problems, chunks, nbytes = storage.verify(metas)
    return VerifyReport(describe(path), tuple(problems), len(metas), chunks, nbytes)


def _abstract_of(meta: ArrayMeta) -> Any:
    try:
        return Abstract(meta.shape, meta.dtype.torch)
    except KeyError:  # numpy-only dtypes
        return meta


@dataclass(slots=True)
class _Dest:
    """Destination memory of one target leaf."""

    meta: ArrayMeta
    pieces: tuple[tuple[Piece, ...], ...]
    locals: dict[int, Any]  # rank -> torch tensor or numpy array (CPU)
    finish: Any  # callable: () -> result leaf
    device_bytes: int = 0  # bytes copied to a device by finish()

    def get(self, rank: int, pi: int) -> tuple[np.ndarray, Region]:
        piece = self.pieces[rank][pi]
        local = self.locals[rank]
        if isinstance(local, np.ndarray):
            # numpy destinations are full arrays: the single piece is the whole array
            return local, piece.region
        return numpy_view(piece_view(local, piece)), piece.region


def _full_dest(
    meta: ArrayMeta, as_numpy: bool, device: torch.device | None, param: torch.Tensor | None, comm: Any = None
) -> _Dest:
    """A whole tensor: held by the one rank of a single process, or by every rank of a group."""
    me = 0 if comm is None else comm.rank
    layout = _SINGLE if comm is None else ShardingSpec(Mesh(comm.world), [Replicate()])
    pieces = layout.rank_pieces(meta.shape)
    if as_numpy:
        arr = np.empty(meta.shape, dtype=meta.dtype.numpy)
        return _Dest(meta, pieces, {me: arr}, lambda: arr)
    on_device = device is not None and device.type != "cpu"
    t = _host_buffer(meta.shape, meta.dtype.torch, pinned=device is not None and device.type == "cuda")

    def finish() -> Any:
        out = t.to(device, non_blocking=True) if on_device else t
        if isinstance(param, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=param.requires_grad)
        return out

    return _Dest(meta, pieces, {me: t}, finish, t.numel() * t.element_size() if on_device else 0)


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """Host memory for a read; pinned when it goes on to a CUDA device (the copy is then asynchronous)."""
    return torch.empty(shape, dtype=dtype, pin_memory=pinned and torch.cuda.is_available())


def _sharded_dest(
    meta: ArrayMeta, spec: Layout, ranks: list[int], devices: dict[int, torch.device], comm: Any = None
) -> _Dest:
    """The shards of ``ranks`` in ``spec``; in a distributed load every rank's pieces count, this rank's are filled."""
    all_pieces = spec.rank_pieces(meta.shape)
    if comm is None:
        pieces = tuple(p if r in ranks else () for r, p in enumerate(all_pieces))
    else:
        pieces = _pad(all_pieces, comm.world, meta.key)
        ranks = [comm.rank] if comm.rank < spec.world_size else []
    moved = {r for r in ranks if r in devices and devices[r].type != "cpu"}
    locals_ = {
        r: _host_buffer(spec.local_shape(r, meta.shape), meta.dtype.torch, r in moved and devices[r].type == "cuda")
        for r in ranks
    }

    def finish() -> ShardedLeaf:
        shards = {r: t.to(devices[r], non_blocking=True) if r in moved else t for r, t in locals_.items()}
        return ShardedLeaf(meta.shape, meta.dtype.torch, spec, shards)

    device_bytes = sum(locals_[r].numel() * locals_[r].element_size() for r in moved)
    return _Dest(meta, pieces, dict(locals_), finish, device_bytes)


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
) -> Any:
    """Load a checkpoint, functionally: return a new tree.

    Args:
      path: a committed checkpoint: a path, URL, kvstore spec or :class:`Location`.
      target: None to rebuild the stored tree with full tensors (numpy leaves come back
        as numpy arrays); or a tree whose structure the result takes, whose leaves say
        what to load: a tensor or numpy array (full, same shape and dtype, on the
        tensor's device), a :class:`ShardedLeaf` (its spec and ranks: resharding), an
        :class:`Abstract` (a full tensor, or the shards of its spec), a DTensor (its
        mesh and placements), or a plain Python value (replaced by the stored value).
        Stored leaves the target lacks are not read.
      namespace: the optree namespace of custom pytree nodes.
      executor: concurrency of the I/O.
      include: key-path globs (``fnmatch``, e.g. ``"model.layers.*.weight"``): load only
        the matching leaves, and return them as a flat dict from key path to leaf.
        Other leaves are not read. Only with ``target=None``.
      process_group: when torch.distributed is initialised with several ranks, every
        rank calls ``load`` and gets its own part: its DTensor shards, its shard of
        each ShardedLeaf or Abstract spec, and full copies of plain tensors. Each rank
        reads only its regions; a region several ranks want is read once and sent on.
      monitor: a :class:`Monitor` that records the time and bytes of every phase
        (on rank 0, every rank's).

    Raises:
      NotCommittedError: ``path`` holds no committed checkpoint.
      TargetMismatchError: listing every target leaf that the checkpoint lacks or that
        differs in shape, dtype or kind.
      MetadataError: the metadata is malformed or unsafe.
    """
    # A save in flight may be running collectives on the checkpoint groups, and may be
    # writing the very checkpoint asked for: let it finish first.
    _wait_in_flight()
    comm = _comm(process_group)
    spans = Monitor()
    try:
        return _load(path, target, namespace, executor, include, comm, spans)
    finally:
        if monitor is not None:
            monitor.extend(spans.spans)


def _load(
    path: PathLike,
    target: Any,
    namespace: str,
    executor: ExecutorOptions | None,
    include: str | Sequence[str] | None,
    comm: Any,
    monitor: Monitor,
) -> Any:
    me = 0 if comm is None else comm.rank
    t0 = time.time()
    storage = Storage(path, executor)
    if comm is None:
        raw = storage.read_metadata()
    else:
        raw, error = None, None
        if comm.rank == 0:
            try:
                raw = storage.read_metadata()
            except Exception as e:
                error = e
        comm.agree(error, "reading the checkpoint metadata")
        raw = comm.broadcast(raw)
    assert raw is not None
    doc = parse_document(raw, namespace=namespace)
    stored_paths = doc.tree.paths()
    by_path: dict[tuple[KeyEntry, ...], ArrayMeta | ValueMeta] = dict(zip(stored_paths, doc.leaves, strict=True))
    if include is not None:
        if target is not None:
            raise TargetMismatchError("include= selects leaves of the stored tree; give it with target=None")
        patterns = [include] if isinstance(include, str) else list(include)
        chosen = [
            (p, leaf)
            for p, leaf in zip(stored_paths, doc.leaves, strict=True)
            if any(fnmatch.fnmatchcase(leaf.key, pat) for pat in patterns)
        ]
        t_leaves: list[Any] = [None] * len(chosen)
        t_paths = [p for p, _ in chosen]
        structure: Node = Node(
            "dict", [("s", leaf.key) for _, leaf in chosen], [Node("leaf", leaf=i) for i in range(len(chosen))]
        )
        target_given = False
    elif target is None:
        t_leaves = [None] * len(doc.leaves)
        t_paths = stored_paths
        structure = doc.tree
        target_given = False
    else:
        target_given = True
        t_leaves, t_paths, structure = flatten(target, _is_leaf, namespace=namespace)
    # Before any destination is allocated: the stored bytes must back every claimed shape.
    wanted = [by_path[p] for p in t_paths if isinstance(by_path.get(p), ArrayMeta)]
    storage.check_stored_sizes([m for m in wanted if isinstance(m, ArrayMeta)])
    problems: list[str] = []
    results: list[Any] = [None] * len(t_leaves)
    dests: list[tuple[int, _Dest]] = []
    for i, (leaf, p) in enumerate(zip(t_leaves, t_paths, strict=True)):
        key = keystr(p)
        stored = by_path.get(p)
        if stored is None:
            problems.append(f"leaf {_where(key)} of the target is not in the checkpoint")
            continue
        if not target_given:
            if isinstance(stored, ValueMeta):
                results[i] = stored.value
            else:
                dests.append((i, _full_dest(stored, stored.container == "numpy", None, None, comm)))
            continue
        if _is_value(leaf):
            if isinstance(stored, ValueMeta):
                results[i] = stored.value
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
        problem, dest = _dest_for(key, stored, leaf, comm)
        if problem is not None:
            problems.append(problem)
        elif dest is not None:
            dests.append((i, dest))
    if problems:
        raise TargetMismatchError(
            f"the target does not match the checkpoint at {describe(path)}:\n  " + "\n  ".join(problems)
        )
    if comm is not None:
        layouts = _exchange_layouts(
            comm, [(d.meta.key, d.meta.dtype.name, d.meta.shape, d.pieces[comm.rank]) for _, d in dests], "load"
        )
        for (_, d), pieces in zip(dests, layouts, strict=True):
            d.pieces = pieces
        world = comm.world
    else:
        world = max((len(d.pieces) for _, d in dests), default=1)
    plan = plan_load(
        [(d.meta.key, d.meta.shape, d.meta.dtype.itemsize, d.meta.chunk_shape) for _, d in dests],
        [d.pieces for _, d in dests],
        world,
    )
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
    progress = Progress.maybe(storage.options.progress and me == 0, "load", mine)
    try:
        if comm is None:
            # each array's host-to-device copy starts as soon as it is read, overlapping later reads
            with monitor.phase("load", "read", me) as box:
                box[0] = storage.read(metas, plan.arrays, getters, None, array_done=finish, progress=progress.advance)
        else:
            error = None
            after, forward = comm.read_forwarding(plan.arrays, getters, [m.dtype.numpy for m in metas])
            try:
                with monitor.phase("load", "read", me) as box:
                    box[0] = storage.read(
                        metas, plan.arrays, getters, comm.rank, after=after, progress=progress.advance
                    )
            except Exception as e:
                error = e
            finally:
                with monitor.phase("load", "transfer", me):
                    forward()  # every posted transfer completes, even after a failed read
            comm.agree(error, "loading the checkpoint")
            for k in range(len(dests)):
                finish(k)
    finally:
        progress.close()
    if h2d_bytes[0]:
        end = time.time()
        monitor.add(Span("load", "h2d", me, end - h2d_seconds[0], end, h2d_bytes[0], thread))
    if comm is not None:
        _gather_spans(comm, monitor)
    return structure.unflatten(results)


def _dtensor_dest(meta: ArrayMeta, leaf: Any, comm: Any) -> _Dest:
    """This rank's local shard of a DTensor target, in the target's own mesh and placements."""
    from torch.distributed.tensor import DTensor

    from ._distributed import dtensor_layout

    _, pieces = dtensor_layout(leaf, comm.world, comm.group)
    local_target = leaf.to_local()
    on_device = local_target.device.type != "cpu"
    local = _host_buffer(tuple(local_target.shape), meta.dtype.torch, local_target.is_cuda)

    def finish() -> Any:
        return DTensor.from_local(
            local.to(local_target.device, non_blocking=True) if on_device else local,
            leaf.device_mesh,
            leaf.placements,
            run_check=False,
            shape=leaf.shape,
            stride=leaf.stride(),
        )

    return _Dest(meta, pieces, {comm.rank: local}, finish, local.numel() * local.element_size() if on_device else 0)


def read_array(
    path: PathLike, meta: ArrayMeta, region: Region | None = None, executor: ExecutorOptions | None = None
) -> torch.Tensor:
    """A stored array, or the box ``region`` of it, as a CPU tensor (``meta`` from :func:`metadata`).

    Only the chunks the region touches are read.
    """
    storage = Storage(path, executor)
    storage.check_stored_sizes([meta])
    region = Region.full(meta.shape) if region is None else region
    out = torch.empty(region.shape, dtype=meta.dtype.torch)
    pieces = ((Piece(region, 0),),) if region.size else ((),)

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        return numpy_view(out), region

    plan = plan_load([(meta.key, meta.shape, meta.dtype.itemsize, meta.chunk_shape)], [pieces], 1)
    storage.read([meta], plan.arrays, [get], rank=None)
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

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> pytreeckpt.save(d, {"emb": torch.arange(12.0).reshape(4, 3)})
    >>> pytreeckpt.load_slice(d, "emb", (slice(1, 3), 2))
    tensor([[5.],
            [8.]])
    """
    meta = metadata(path).arrays.get(key)
    if meta is None:
        raise TargetMismatchError(f"leaf {_where(key)} is not an array of the checkpoint at {describe(path)}")
    return read_array(path, meta, _region_of(index, meta.shape, key), executor)


def _dest_for(key: str, stored: ArrayMeta, leaf: Any, comm: Any = None) -> tuple[str | None, _Dest | None]:
    if isinstance(leaf, ShardedLeaf):
        problem = _target_problem(key, stored, leaf.shape, dtype_of_torch(leaf.dtype).name)
        devices = {r: t.device for r, t in leaf.shards.items()}
        return problem, None if problem else _sharded_dest(stored, leaf.spec, sorted(leaf.shards), devices, comm)
    if isinstance(leaf, Abstract):
        problem = _target_problem(key, stored, leaf.shape, dtype_of_torch(leaf.dtype).name)
        if problem:
            return problem, None
        if leaf.spec is None:
            return None, _full_dest(stored, False, None, None, comm)
        return None, _sharded_dest(stored, leaf.spec, list(range(leaf.spec.world_size)), {}, comm)
    if isinstance(leaf, torch.Tensor):
        problem = _target_problem(key, stored, tuple(leaf.shape), dtype_of_torch(leaf.dtype).name)
        if problem:
            return problem, None
        if _is_dtensor(leaf):
            if comm is None:
                return f"leaf {_where(key)}: a DTensor target needs torch.distributed initialised with its ranks", None
            return None, _dtensor_dest(stored, leaf, comm)
        return None, _full_dest(stored, False, leaf.device, leaf, comm)
    arr = np.asarray(leaf)
    try:
        name = dtype_of_numpy(arr.dtype).name
    except ValueError as e:
        return f"leaf {_where(key)}: {e}", None
    problem = _target_problem(key, stored, tuple(arr.shape), name)
    return problem, None if problem else _full_dest(stored, True, None, None, comm)
