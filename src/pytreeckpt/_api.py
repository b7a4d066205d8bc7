"""The functional API: ``save``, ``load`` and ``metadata``, in one process.

One process may hold the shards of every rank (ShardedLeaf.from_global makes such
leaves), which is how layouts are resharded and tested without a process group.
"""

from __future__ import annotations

import fnmatch
import os
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from ._dtypes import DType, dtype_of_numpy, dtype_of_torch, numpy_view
from ._errors import CheckpointError, LayoutError, TargetMismatchError
from ._executor import ExecutorOptions, PieceData, Storage, write_items
from ._format import ARRAYS_DIR, ArrayMeta, ValueMeta, array_names, build_document, parse_document
from ._leaf import Abstract, ShardedLeaf, piece_view
from ._plan import ArrayLayout, ChunkingOptions, SavePlan, plan_load
from ._plan_cache import cached_plan_save
from ._region import Region
from ._sharding import Layout, Mesh, Piece, Replicate, ShardingSpec
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

PathLike = str | os.PathLike[str]
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


def _global_source(arr: np.ndarray, pieces: tuple[tuple[Piece, ...], ...]) -> PieceData:
    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        region = pieces[rank][pi].region
        return arr[region.slices()], region

    return get


def _sharded_source(leaf: ShardedLeaf, pieces: tuple[tuple[Piece, ...], ...]) -> PieceData:
    cpu = {r: t.detach().cpu() for r, t in leaf.shards.items()}

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        piece = pieces[rank][pi]
        return numpy_view(piece_view(cpu[rank], piece)), piece.region

    return get


def _local_source(local: torch.Tensor, me: int, pieces: tuple[tuple[Piece, ...], ...]) -> PieceData:
    cpu = local.detach().cpu()

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        if rank != me:
            raise CheckpointError(f"internal error: rank {me} asked for data of rank {rank}")
        piece = pieces[rank][pi]
        return numpy_view(piece_view(cpu, piece)), piece.region

    return get


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
            return _ArrayIn(
                key,
                "torch",
                dtype_of_torch(leaf.dtype),
                tuple(leaf.shape),
                layout,
                layout,
                pieces,
                _local_source(local, comm.rank, pieces),
            )
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
                source = _local_source(leaf.shards[comm.rank], comm.rank, pieces)
                present = frozenset({comm.rank})
            else:
                source = _sharded_source(leaf, pieces)
                present = frozenset(leaf.shards)
            return _ArrayIn(
                key,
                "torch",
                dtype_of_torch(leaf.dtype),
                leaf.shape,
                leaf.spec,
                leaf.spec,
                pieces,
                source,
                present,
            )
        if isinstance(leaf, torch.Tensor):
            dtype = dtype_of_torch(leaf.dtype)
            arr = numpy_view(leaf.detach().cpu())
            container = "torch"
        else:
            arr = np.asarray(leaf)
            dtype = dtype_of_numpy(arr.dtype)
            container = "numpy"
        local_shape = tuple(int(s) for s in arr.shape)
        if comm is None:
            single: Layout = spec if spec is not None else _SINGLE
            pieces = single.rank_pieces(local_shape)
            return _ArrayIn(key, container, dtype, local_shape, single, spec, pieces, _global_source(arr, pieces))
        if spec is None:
            # Every rank holds the whole tensor: replicated, written once in total.
            layout = ShardingSpec(Mesh(comm.world), [Replicate()])
            pieces = layout.rank_pieces(local_shape)
            return _ArrayIn(key, container, dtype, local_shape, layout, None, pieces, _global_source(arr, pieces))
        raise CheckpointError(
            f"leaf {_where(key)}: in a distributed save a plain tensor is this rank's full copy; to save it sharded "
            f"wrap this rank's shard as ShardedLeaf(global_shape, dtype, spec, {{rank: shard}}) or use a DTensor"
        )
    except (LayoutError, ValueError) as e:
        if isinstance(e, CheckpointError) and not isinstance(e, LayoutError):
            raise
        raise LayoutError(f"leaf {_where(key)}: {e}") from None


def _snapshot(plans: Sequence[Any], data: Sequence[PieceData], me: int | None) -> list[PieceData]:
    """Copy what this process's writes read: per local piece, the box spanning the fragments used."""
    out: list[PieceData] = []
    for plan, get in zip(plans, data, strict=True):
        boxes: dict[tuple[int, int], Region] = {}
        for op in plan.writes:
            for frag in op.sources:
                if me is None or frag.rank == me:
                    k = (frag.rank, frag.piece)
                    boxes[k] = frag.region if k not in boxes else _span(boxes[k], frag.region)
        copies: dict[tuple[int, int], tuple[np.ndarray, Region]] = {}
        for (rank, pi), box in boxes.items():
            view, where = get(rank, pi)
            copies[(rank, pi)] = (np.array(view[box.relative_to(where).slices()], copy=True), box)
        out.append(_copies_source(copies))
    return out


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
    comm: Any = None
    _lock: Any = None

    def snapshot(self) -> None:
        t0 = time.perf_counter()
        self.data = _snapshot(self.plan.arrays, self.data, None if self.comm is None else self.comm.rank)
        self.timings["snapshot"] = time.perf_counter() - t0

    def persist(self) -> None:
        """Write and commit: the single-process path, or this rank's part of a distributed save."""
        dtypes = [m.dtype.numpy for m in self.metas]
        t0 = time.perf_counter()
        if self.comm is None:
            lock = self.storage.lock()
            try:
                self.storage.prepare(self.overwrite)
                items = ((i, op.region, buf) for i, op, buf in write_items(self.plan.arrays, self.data, dtypes, None))
                self.storage.write(self.metas, items)
                t1 = time.perf_counter()
                self.storage.commit(self.document)
            finally:
                lock.release()
        else:
            try:
                t1 = self._persist_distributed(dtypes)
            finally:
                if self._lock is not None:
                    self._lock.release()
                    self._lock = None
        self.timings["write"] = t1 - t0
        self.timings["commit"] = time.perf_counter() - t1

    def _persist_distributed(self, dtypes: list[np.dtype]) -> float:
        """Rank 0 prepares the directory (holding its lock), every rank writes, rank 0 commits."""
        comm = self.comm
        error: BaseException | None = None
        if comm.rank == 0:
            try:
                self._lock = self.storage.lock()
                self.storage.prepare(self.overwrite)
                self.storage.open_arrays(self.metas, create=True)
            except Exception as e:
                error = e
        comm.agree(error, "preparing the checkpoint directory")
        transfers = comm.post_write_transfers(self.plan.arrays, self.data, dtypes)
        try:
            self.storage.write(self.metas, transfers.items(), create=False)
        except Exception as e:
            error = e
        finally:
            transfers.wait_all()
        comm.agree(error, "writing the checkpoint")
        t1 = time.perf_counter()
        if comm.rank == 0:
            try:
                self.storage.commit(self.document)
            except Exception as e:
                error = e
        comm.agree(error, "committing the checkpoint")
        return t1


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
) -> _SaveJob:
    t0 = time.perf_counter()
    leaves, paths, root = flatten(tree, _is_leaf, namespace=namespace)
    specs = broadcast_prefix(spec, root, lambda x: isinstance(x, Layout), len(leaves), namespace=namespace)
    keys = [keystr(p) for p in paths]
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
    plan = cached_plan_save([ArrayLayout(a.key, a.shape, a.dtype.itemsize, a.pieces) for a in arrays], world, chunking)
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
        ArrayMeta(a.key, a.container, a.dtype, a.shape, ap.chunk_shape, f"{ARRAYS_DIR}/{name}", a.saved_layout)
        for a, ap, name in zip(arrays, plan.arrays, names, strict=True)
    ]
    it = iter(metas)
    leaf_json = [e if e is not None else next(it).to_json() for e in entries]
    document = build_document(root, leaf_json, dict(user_metadata or {}))
    storage = Storage(path, executor)
    if comm is None or comm.rank == 0:
        storage.check_writable(overwrite)
    timings = {"plan": time.perf_counter() - t0}
    return _SaveJob(storage, metas, plan, [a.get for a in arrays], document, overwrite, timings, comm)


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
) -> None:
    """Save a pytree as a checkpoint at ``path``, returning once it is committed.

    Args:
      path: a directory; created if missing. An interrupted, uncommitted save there is
        cleared; a committed checkpoint is replaced only with ``overwrite=True``.
      tree: a pytree whose leaves are tensors, numpy arrays, :class:`ShardedLeaf` or
        plain Python values (int, float, bool, str, None).
      spec: a pytree prefix of ``tree`` whose leaves are sharding specs or None. A
        tensor under a spec is the global tensor, laid out as the spec says: this
        decides the chunk grid and which rank writes what.
      overwrite: replace a committed checkpoint at ``path``.
      user_metadata: a JSON object stored with the checkpoint.
      chunking: how stored arrays are chunked.
      executor: concurrency of the I/O.
      namespace: the optree namespace of custom pytree nodes in ``tree``.
      process_group: when torch.distributed is initialised with several ranks, every
        rank calls ``save`` with its own part of the state: DTensors, ShardedLeafs
        holding its shard, and plain tensors and values that every rank holds whole
        (written once in total). Checkpoint traffic runs on a gloo group of its own,
        or on ``process_group`` if given.

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
    job = _plan_job(path, tree, spec, overwrite, user_metadata, chunking, executor, namespace, _comm(process_group))
    # The caller is blocked until the commit, so the state cannot change under the
    # writes: they read straight from the caller's memory, without a snapshot.
    job.persist()


class SaveHandle:
    """A save running in the background: ``wait()``, ``done()`` and per-phase ``timings``."""

    def __init__(self, path: PathLike, timings: dict[str, float]) -> None:
        self.path = os.fspath(path)
        self._timings = timings
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._reported = False

    def _run(self, job: _SaveJob) -> None:
        try:
            job.persist()
        except BaseException as e:
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
            job.data = []  # release the staging memory
            self._done.set()

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
) -> SaveHandle:
    """Like :func:`save`, but returns once the state is copied; writing and commit run behind.

    The caller may change the tree's tensors as soon as this returns. A new save first
    waits for the one in flight. Arguments are those of :func:`save`.

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
    _wait_in_flight()
    job = _plan_job(path, tree, spec, overwrite, user_metadata, chunking, executor, namespace, _comm(process_group))
    job.snapshot()
    handle = SaveHandle(path, job.timings)
    thread = threading.Thread(target=handle._run, args=(job,), name="pytreeckpt-save", daemon=False)
    with _IN_FLIGHT_LOCK:
        _in_flight.append(handle)
    thread.start()
    return handle


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
    return VerifyReport(os.fspath(path), tuple(problems), len(metas), chunks, nbytes)


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
    t = torch.empty(meta.shape, dtype=meta.dtype.torch)

    def finish() -> Any:
        out = t if device is None or device.type == "cpu" else t.to(device)
        if isinstance(param, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=param.requires_grad)
        return out

    return _Dest(meta, pieces, {me: t}, finish)


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
    locals_ = {r: torch.empty(spec.local_shape(r, meta.shape), dtype=meta.dtype.torch) for r in ranks}

    def finish() -> ShardedLeaf:
        shards = {r: t.to(devices[r]) if r in devices else t for r, t in locals_.items()}
        return ShardedLeaf(meta.shape, meta.dtype.torch, spec, shards)

    return _Dest(meta, pieces, dict(locals_), finish)


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
) -> Any:
    """Load a checkpoint, functionally: return a new tree.

    Args:
      path: a committed checkpoint.
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
            f"the target does not match the checkpoint at {os.fspath(path)}:\n  " + "\n  ".join(problems)
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
    if comm is None:
        storage.read(metas, plan.arrays, getters, rank=None)
    else:
        error = None
        after, finish = comm.read_forwarding(plan.arrays, getters, [m.dtype.numpy for m in metas])
        try:
            storage.read(metas, plan.arrays, getters, rank=comm.rank, after=after)
        except Exception as e:
            error = e
        finally:
            finish()  # every posted transfer completes, even after a failed read
        comm.agree(error, "loading the checkpoint")
    for i, d in dests:
        results[i] = d.finish()
    return structure.unflatten(results)


def _dtensor_dest(meta: ArrayMeta, leaf: Any, comm: Any) -> _Dest:
    """This rank's local shard of a DTensor target, in the target's own mesh and placements."""
    from torch.distributed.tensor import DTensor

    from ._distributed import dtensor_layout

    _, pieces = dtensor_layout(leaf, comm.world, comm.group)
    local_target = leaf.to_local()
    local = torch.empty(tuple(local_target.shape), dtype=meta.dtype.torch)

    def finish() -> Any:
        return DTensor.from_local(
            local.to(local_target.device),
            leaf.device_mesh,
            leaf.placements,
            run_check=False,
            shape=leaf.shape,
            stride=leaf.stride(),
        )

    return _Dest(meta, pieces, {comm.rank: local}, finish)


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
        raise TargetMismatchError(f"leaf {_where(key)} is not an array of the checkpoint at {os.fspath(path)}")
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
