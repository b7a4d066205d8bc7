"""``save`` and ``async_save``: plan, snapshot through the staging pool, write and commit.

One process may hold the shards of every rank (ShardedLeaf.from_global makes such
leaves), which is how layouts are resharded and tested without a process group.

A program whose main thread ends with an asynchronous save in flight finishes it: the
writer is not a daemon thread, and Python joins it before the interpreter finalises.
That wait is bounded by ``ExecutorOptions.exit_timeout``: past it the save is cancelled
(it stops writing, waits for the writes issued, and commits nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import operator
import os
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from pytreeckpt.core._errors import CheckpointError, MetadataError
from pytreeckpt.core._sharding import Layout
from pytreeckpt.core._tree import broadcast_prefix, check_unique_keys, flatten
from pytreeckpt.core._values import encode_value
from pytreeckpt.distributed._comm import data_comm
from pytreeckpt.execute._executor import ChunkReuse, PieceData, write_arrays, write_items
from pytreeckpt.execute._monitor import Monitor, Progress, Span, logger
from pytreeckpt.execute._pipeline import Snapshot, staged_writes
from pytreeckpt.execute._staging import PoolAborted, staging_pool
from pytreeckpt.format import (
    ARCHIVE_DIR,
    ARRAYS_DIR,
    CHECKSUMS_FILE,
    MAX_PACKED_BYTES,
    PACKED_DIR,
    SEAL_BYTES,
    ArrayMeta,
    Compression,
    DocumentHead,
    SumsTemplate,
    ValueMeta,
    array_leaf_heads,
    array_leaf_texts,
    array_names,
    chunk_count,
    crc32c_chars,
    generation_name,
    place_checksums,
    plain_array_meta,
)
from pytreeckpt.plan import ArraySpec, ChunkingOptions, PlanCache, SavePlan, plan_save, plan_whole, spec_plan_key
from pytreeckpt.storage import ChunkSums, ExecutorOptions, Storage, in_background
from pytreeckpt.storage._location import describe

from ._load import metadata
from ._recall import Recalled, Remembered, recall, remember
from ._shared import (
    _IN_FLIGHT_LOCK,
    _SINGLE,
    PathLike,
    _agree_on_specs,
    _Carried,
    _comm,
    _gather_spans,
    _in_flight,
    _is_leaf,
    _is_value,
    _span,
    _wait_in_flight,
    _where,
    gc_paused,
)
from ._sources import _PLAIN, _array_in, _ArrayIn, _plain_data, _plain_in, _snapshot_merges

if TYPE_CHECKING:
    import numpy as np

    from pytreeckpt.distributed._comm import Comm

__all__ = ["SaveHandle", "async_save", "save"]

_T = TypeVar("_T")


@dataclass(slots=True)
class _SaveJob:
    storage: Storage
    metas: list[ArrayMeta]
    plan: SavePlan
    data: list[PieceData]
    # the metadata document's tree and user metadata (serialised), and its leaves (a value's entry;
    # None: an array's, made at the end)
    parts: tuple[DocumentHead, list[dict[str, Any] | None]]
    overwrite: bool
    timings: dict[str, float]
    monitor: Monitor
    comm: Comm | None = None
    device: list[Any] = field(default_factory=list)
    watch: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    reuse: ChunkReuse | None = None
    snap: Snapshot | None = None
    _lock: Any = None
    sums: ChunkSums | None = None
    pending: BaseException | None = None  # this rank's error in a distributed save, not yet agreed on
    cancelled: threading.Event = field(default_factory=threading.Event)  # set at exit: stop, commit nothing
    generation: int = 0  # of the stored names (see generation_name)
    derived: _Derived | None = None  # kept for the next save of a tree like this one (api/_recall.py)

    def ready(self) -> None:
        """In a distributed save, agree that every rank planned (and staged) its part: else all raise."""
        if self.comm is not None:
            pending, self.pending = self.pending, None
            self.comm.agree(pending, "preparing the save")

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
        pool.reserve(capacity, pin=any(d is not None for d in device), huge=opts.huge_pages)
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

    def _items(self, only: Sequence[int] | None = None) -> Any:
        """This process's writes: staged pieces in an asynchronous save, else views of the caller's memory
        (of arrays ``only``, if given)."""
        if self.snap is not None:
            return self._until_cancelled(self.snap.items())
        if only is not None and not only:
            return iter(())
        dtypes = [m.dtype.numpy for m in self.metas]
        items = write_items(self.plan.arrays, self.data, dtypes, None, only)
        return ((i, op.region, buf, None) for i, op, buf in items)

    def _lean(self) -> tuple[list[int], list[np.ndarray], list[int]]:
        """The small whole arrays a single-process save writes straight from the caller's memory
        (:meth:`Storage.write_small`): their indices and data; and the indices of the other arrays."""
        small: list[int] = []
        datas: list[np.ndarray] = []
        rest: list[int] = []
        if self.snap is not None or self.reuse is not None or self.comm is not None:
            return small, datas, list(range(len(self.metas)))
        small_whole = self.storage.small_whole
        for i, (meta, ap) in enumerate(zip(self.metas, self.plan.arrays, strict=True)):
            if small_whole(meta) and len(ap.writes) == 1:
                op = ap.writes[0]
                if len(op.sources) == 1 and op.sources[0].rank == op.writer:
                    src, where = self.data[i](op.writer, op.sources[0].piece)
                    if (
                        where.shape == meta.shape
                        and op.region.shape == meta.shape
                        and src.shape == meta.shape
                        and src.dtype == meta.dtype.numpy
                    ):
                        small.append(i)
                        datas.append(src)
                        continue
            rest.append(i)
        return small, datas, rest

    def _check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise CheckpointError(
                f"the save to {self.storage.url} was cancelled: the program ended while it was still running "
                f"(ExecutorOptions.exit_timeout); nothing is committed"
            )

    def _until_cancelled(self, items: Iterable[_T]) -> Iterator[_T]:
        """``items``, raising before the next one once the save is cancelled (the writes issued are waited for)."""
        for item in items:
            self._check_cancelled()
            yield item

    def persist(self) -> None:
        """Write and commit: the single-process path, or this rank's part of a distributed save."""
        if self.snap is not None and self.snap.hold:
            # With room for the whole state nothing overlaps the copy: the writer starts
            # once it is over, not competing with the caller's stall for cores (4 gloo
            # ranks on 2 cores: a stall of 1.8-2.1x a bare memcpy became 1.2-1.3x).
            self.snap.copied.wait()
        t0 = time.perf_counter()
        if self.comm is None:
            lock = self.storage.lock()
            try:
                self._name(self.storage.prepare(self.overwrite))
                total = sum(map(_NBYTES, self.metas))  # (a single process writes every element once)
                progress = self._progress("save", total)
                try:
                    with self.monitor.phase("save", "write", 0) as box:
                        small, datas, rest = self._lean()
                        sums = self._sums()
                        box[0] = 0
                        if small:
                            box[0] = self.storage.write_small(
                                [self.metas[i] for i in small], datas, lambda k, crc: sums.add_single(small[k], crc)
                            )
                            progress.advance(box[0])
                        box[0] += write_arrays(
                            self.storage,
                            self.metas,
                            self._items(rest if small else None),
                            progress=progress.advance,
                            reuse=self.reuse,
                            only=rest if small else None,
                            sums=sums,
                        )
                finally:
                    progress.close()
                t1 = time.perf_counter()
                self._check_cancelled()
                with self.monitor.phase("save", "commit", 0):
                    self._commit(None)
            except BaseException:
                self.storage.abandon()  # what this save wrote goes before its failure is reported
                raise
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

    def _sums(self) -> ChunkSums:
        """The record of every chunk this process writes (its crc32c; its hash when ``reuse``)."""
        if self.sums is None:
            self.sums = ChunkSums(self.metas)
        return self.sums

    def _name(self, generation: int) -> None:
        """Store this save's arrays under the names of ``generation`` (see :func:`generation_name`)."""
        self.generation = generation
        if generation == 0:
            return
        self.metas = [
            dataclasses.replace(m, path=generation_name(m.path, generation))
            if m.database is None
            else dataclasses.replace(m, database=generation_name(m.database, generation))
            for m in self.metas
        ]
        if self.reuse is not None:
            self.reuse.paths = [m.path for m in self.metas]

    @property
    def _ranks(self) -> Comm:
        """The ranks of a distributed save (the methods that use them run only in one)."""
        assert self.comm is not None, "a single-process save has no other ranks"
        return self.comm

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Every rank raises if any failed; rank 0 first removes what the save wrote, and all wait for that."""
        try:
            self._ranks.agree(error, what)
        except CheckpointError:
            if self._ranks.rank == 0:
                self.storage.abandon()
            self._ranks.broadcast(None)
            raise

    @property
    def _placeholder(self) -> str:
        """The database of a packed array another rank writes, until the coordinator learns which."""
        generation = self.generation
        return generation_name(PACKED_DIR, generation) if generation else PACKED_DIR

    def _texts(self) -> _Texts:
        """What the document says of the array leaves before their checksums (see _Texts): that of the last
        save of a tree like this one, under these names, if it made it."""
        derived = self.derived
        if derived is None:
            return _Texts.of(self.metas)
        made = derived.texts.get(self.generation)
        if made is not None and len(made.metas) == len(self.metas) and all(map(operator.is_, made.metas, self.metas)):
            return made
        made = derived.texts[self.generation] = _Texts.of(self.metas)
        return made

    @contextlib.contextmanager
    def _final_document(
        self, gathered: list[Any] | None
    ) -> Iterator[tuple[bytes | bytearray, tuple[str, bytes] | None, frozenset[str]]]:
        """The metadata document (valid within the block: it may be a template's text, see SumsTemplate):
        every packed array in its writer's database, every array's chunk checksums (and chunk hashes
        when they were computed); the checksums file (its name and bytes) if they are too many to keep
        in the document (``StorageOptions.max_inline_checksum_bytes``); and every name the document
        references (arrays, databases, checksums file)."""
        sums = self._sums()
        if gathered is not None:  # every rank's packed arrays and records, on rank 0 (its own among them)
            for packed, _ in gathered:
                for i, db in packed.items():
                    self.metas[i] = dataclasses.replace(self.metas[i], database=db)
            for _, other in gathered[1:]:
                sums.merge(other)
        texts = self._texts()
        databases = texts.databases
        placeholder = self._placeholder
        missing = [m.key for m in self.metas if m.database == placeholder] if placeholder in databases else []
        if missing:
            raise CheckpointError(f"internal error: no rank wrote the packed arrays {missing[:5]}")
        n = len(self.metas)
        head, entries = self.parts
        limit = self.storage.location.options.max_inline_checksum_bytes
        # Arrays alone, each of one chunk, their checksums in the document: a template's (see SumsTemplate)
        inline = self.reuse is None and len(entries) == n and texts.plain and crc32c_chars(1) * n <= limit
        single = sums.single_crc32c() if inline else None  # (None unless every array is one chunk)
        if single is not None:
            frame = head.frame(databases)
            template = texts.template
            if template is None or template.frame != frame:
                template = texts.template = SumsTemplate(cast("list[str]", texts.heads), *frame)
            with template.filled(single) as text:
                yield text, None, texts.names
            return
        crcs = sums.crc32c_all()
        hashes = [sums.chunk_hashes(i) for i in range(n)] if self.reuse is not None else [None] * n
        refs, file, blob = place_checksums(crcs, limit, generation_name(CHECKSUMS_FILE, self.generation))
        # under this save's generation's names (see _name), in their databases, with their chunks' checksums
        arrays = iter(array_leaf_texts(self.metas, crcs, hashes, refs, texts.heads))
        leaves = [e if e is not None else next(arrays) for e in entries]
        document = head.document(leaves, databases, file)
        if file is None or blob is None:
            yield document, None, texts.names
        else:
            yield document, (file.path, blob), texts.names | {file.path}

    def _commit(self, gathered: list[Any] | None) -> None:
        """Commit the final document (and its checksums file, if any), naming what it references: the
        arrays, the databases and the checksums file."""
        with self._final_document(gathered) as (document, checksums, names):
            self.storage.commit(document, checksums, names)

    def _settle_packing(self) -> None:
        """Which small arrays no single rank writes whole: they are not packed (a collective).

        Each rank knows the small arrays it alone writes (packed in its own database); rank
        0 gathers them and tells every rank the small arrays nobody writes whole, which
        are stored as arrays of their own.
        """
        comm = self._ranks
        whole = [i for i, m in enumerate(self.metas) if m.database == f"{self.storage.packed_prefix()}/{comm.rank}"]
        gathered = comm.gather(whole)
        unpacked = None
        if comm.rank == 0:
            packed = {i for got in gathered for i in got}
            unpacked = [i for i, m in enumerate(self.metas) if m.database is not None and i not in packed]
            unpacked = [i for i in unpacked if self.metas[i].database == PACKED_DIR]
        for i in comm.broadcast(unpacked):
            self.metas[i] = dataclasses.replace(self.metas[i], database=None)

    def _persist_distributed(self) -> float:
        """Rank 0 prepares the directory (holding its lock), every rank writes, rank 0 commits."""
        comm = self._ranks
        me = comm.rank
        error: BaseException | None = None
        generation = 0
        self._settle_packing()
        if me == 0:
            try:
                self._lock = self.storage.lock()
                generation = self.storage.prepare(self.overwrite)
                self._name(generation)
                self.storage.open_arrays([m for m in self.metas if m.database is None], create=True)
            except Exception as e:
                error = e
        self._agree(error, "preparing the checkpoint directory")
        generation = comm.broadcast(generation)
        if me != 0:
            self._name(generation)
        mine_db = generation_name(f"{self.storage.packed_prefix()}/{comm.rank}", generation)
        try:  # each rank alone writes its own OCDBT database (or zip archives) of packed arrays
            self.storage.open_arrays([m for m in self.metas if m.database == mine_db], create=True)
        except Exception as e:
            error = e
        self._agree(error, "creating the packed arrays")
        dtypes = [m.dtype.numpy for m in self.metas]
        transfers = data_comm(comm, "writing").post_write_transfers(
            self.plan.arrays, self.data, dtypes, direct=self.snap is None
        )
        mine = sum(op.region.size * ap.itemsize for ap in self.plan.arrays for op in ap.writes if op.writer == me)
        progress = self._progress("save", mine)
        try:
            with self.monitor.phase("save", "write", me) as box:
                staged = self.snap.items() if self.snap is not None else iter(())
                items = self._until_cancelled(itertools.chain(staged, transfers.items()))
                writes = [i for i, ap in enumerate(self.plan.arrays) if any(op.writer == me for op in ap.writes)]
                box[0] = write_arrays(
                    self.storage,
                    self.metas,
                    items,
                    create=False,
                    progress=progress.advance,
                    reuse=self.reuse,
                    sums=self._sums(),
                    only=writes,
                )
        except Exception as e:
            error = e
        finally:
            progress.close()
            with self.monitor.phase("save", "merge", me, transfers.received_bytes()):
                transfers.wait_all()
        self._agree(error, "writing the checkpoint")
        t1 = time.perf_counter()
        # What only the writers know goes to rank 0: where each packed array went, and the chunks' checksums.
        packed = {i: m.database for i, m in enumerate(self.metas) if m.database not in (None, self._placeholder)}
        gathered = comm.gather((packed, self._sums().payload()))
        if me == 0:
            try:
                self._check_cancelled()
                with self.monitor.phase("save", "commit", 0):
                    self._commit(gathered)
            except Exception as e:
                error = e
        self._agree(error, "committing the checkpoint")
        _gather_spans(comm, self.monitor)
        return t1


_PATH = operator.attrgetter("path")
_DATABASE = operator.attrgetter("database")
_NBYTES = operator.attrgetter("nbytes")


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


@dataclass(slots=True)
class _Planned:
    """A state described and planned on this rank: what save() writes and what plan_save() returns."""

    arrays: list[_ArrayIn]  # the array leaves as described (their data in the next three)
    data: list[PieceData]
    devices: list[Any]
    watches: list[tuple[torch.Tensor, ...]]
    entries: list[dict[str, Any] | None]  # a plain Python leaf's metadata, None for an array
    root: Any
    user: dict[str, Any]
    codecs: dict[str, Any]
    plan: SavePlan
    rank: int | None  # the rank planned for; None: every rank (a single process)
    memo: Remembered | None  # how the next save of such a tree recognises it (api/_recall.py)


def _plan_state(
    storage: Storage | None,
    tree: Any,
    spec: Any,
    user_metadata: Mapping[str, Any] | None,
    chunking: ChunkingOptions | None,
    namespace: str,
    comm: Comm | None,
    compression: Any,
    carried: _Carried,
    plan_only: bool = False,
) -> _Planned | None:
    """Describe the tree's leaves, agree with the other ranks, and plan this rank's part (None if this rank failed).

    In a distributed save, what a rank does before the layout agreement is carried into
    it (``carried``): a rank that raised alone would never join it and would leave the
    others waiting for its timeout.
    """
    if chunking is not None:
        options = chunking
    else:
        options = storage.chunking if storage is not None else ChunkingOptions()
    context = (None if comm is None else comm.world, None if comm is None else comm.rank, options, plan_only, namespace)
    if spec is None and compression is None:
        got = recall(tree, context)
        if got is not None:  # a tree like one saved before: its description and plan, with this tree's data
            return _recalled(got, user_metadata, comm, carried)
    arrays: list[_ArrayIn] = []
    entries: list[dict[str, Any] | None] = []
    values: list[str] = []
    user: dict[str, Any] = {}
    codecs: dict[str, Any] = {}
    root: Any = None
    leaves: list[Any] = []
    keys: list[str] = []
    kinds: dict[Any, Any] = {}  # what Abstract leaves of one spec, shape, dtype and placement share
    with carried.catch():
        leaves, paths, root = flatten(tree, _is_leaf, namespace=namespace, keys=keys)
        keys = check_unique_keys(paths, keys)
        user = _user_metadata(user_metadata)
        leaf_specs = broadcast_prefix(spec, root, lambda x: isinstance(x, Layout), len(leaves), namespace=namespace)
        codecs = _compressions(compression, root, keys, len(leaves), namespace)
        for key, leaf, sp in zip(keys, leaves, leaf_specs, strict=True):
            if comm is None and sp is None and type(leaf) in _PLAIN and not leaf.is_cuda:
                arrays.append(_plain_in(key, leaf))  # the common case, many thousand times per save: kept lean
                entries.append(None)
                continue
            try:  # (what carried.catch(key) does, without entering a block per leaf)
                if _is_value(leaf):
                    entries.append(_value_entry(key, leaf))
                    values.append(key)
                else:
                    arrays.append(_array_in(key, leaf, sp, comm, plan_only, kinds))
                    entries.append(None)
            except Exception as e:
                carried.carry(e, key)
                break
    # In a single process of one rank, arrays held whole as one chunk are planned by
    # plan_whole, without tables (the same plans: tests/test_plan.py); the others by plan_save.
    whole: list[bool] = []
    if comm is None and all(a.layout is _SINGLE and a.ranks is None for a in arrays):
        limit = options.single_chunk_bytes
        whole = [0 not in a.shape and math.prod(a.shape) * a.dtype.itemsize <= limit for a in arrays]
    specs: list[ArraySpec] = []
    with carried.catch():
        specs = [a.spec() for a, w in itertools.zip_longest(arrays, whole) if not w]
    base: tuple[Any, ...] | None = None
    agreed: tuple[tuple[Any, ...], bytes] | None = None
    dtypes = [a.dtype.name for a in arrays]
    if comm is not None:
        agreed = _agree_on_specs(comm, specs, dtypes, "save", carried.error, values)
        base = None if agreed is None else agreed[0]
        world = comm.world
    elif whole:
        world = 1  # (every array held whole by this one process)
    else:
        world = max((_span(a.layout, a.ranks) for a in arrays), default=1)
    with carried.catch():
        rank = None if comm is None else comm.rank
        plan_key = spec_plan_key(specs, world, options, rank) if base is None else (*base, world, options, rank)
        plan = _SAVE_PLANS.get_or(plan_key, lambda: plan_save(specs, world, rank=rank, options=options))
        if any(whole):
            planned = iter(plan.arrays)
            plan = SavePlan(
                world,
                tuple(
                    plan_whole(a.key, a.shape, a.dtype.itemsize) if w else next(planned)
                    for a, w in zip(arrays, whole, strict=True)
                ),
            )
        for a, ap in zip(arrays, plan.arrays, strict=True):
            if a.present is not None and comm is None:
                for op in ap.writes:
                    for frag in op.sources:
                        if frag.rank not in a.present:
                            raise CheckpointError(
                                f"leaf {_where(a.key)}: elements {frag.region} live only on rank {frag.rank}, "
                                f"whose shard is not in this ShardedLeaf (it holds ranks {sorted(a.present)})"
                            )
        data = [a.get for a in arrays]
        devices, watches = [a.device for a in arrays], [a.watch for a in arrays]
        memo = None
        if spec is None and compression is None:  # (after the data is taken: remember takes it out of arrays)
            memo = remember(context, leaves, keys, root, arrays, codecs, plan, specs, dtypes, agreed)
        return _Planned(arrays, data, devices, watches, entries, root, user, codecs, plan, rank, memo)
    return None


def _recalled(got: Recalled, user_metadata: Mapping[str, Any] | None, comm: Comm | None, carried: _Carried) -> _Planned:
    """A tree like one saved before, planned as that one was: only its data and its Python values are new."""
    was, leaves = got.was, got.leaves
    user: dict[str, Any] = {}
    entries: list[dict[str, Any] | None] = [None] * len(leaves)
    data = [a.get for a in was.arrays]  # (an Abstract's: it refuses to be read)
    watches: list[tuple[torch.Tensor, ...]] = [()] * len(data)
    with carried.catch():
        user = _user_metadata(user_metadata)
        if was.only_tensors:  # (the common case, its loops in C)
            data = list(map(_plain_data, leaves, was.regions))
            watches = list(zip(leaves))
        else:
            for i, region in zip(was.tensors, was.regions, strict=True):
                t, j = leaves[i], was.array_of[i]
                data[j] = _plain_data(t, region)
                watches[j] = (t,)
    for i in was.values:
        with carried.catch(was.keys[i]):
            entries[i] = _value_entry(was.keys[i], leaves[i])
    if comm is not None:
        values = [was.keys[i] for i in was.values]
        _agree_on_specs(comm, was.specs, was.dtypes, "save", carried.error, values, known=was.agreed)
    rank = None if comm is None else comm.rank
    devices = [None] * len(data)  # (CPU tensors and Abstract leaves)
    return _Planned(was.arrays, data, devices, watches, entries, was.root, user, was.codecs, was.plan, rank, was)


def _value_entry(key: str, leaf: Any) -> dict[str, Any]:
    """A plain Python leaf's entry in the metadata document."""
    try:
        encoded = encode_value(leaf)
    except TypeError as e:
        raise CheckpointError(f"leaf {_where(key)}: {e}") from None
    return ValueMeta(key, leaf).to_json(encoded)


def _plan_job(
    path: PathLike,
    tree: Any,
    spec: Any,
    overwrite: bool,
    user_metadata: Mapping[str, Any] | None,
    chunking: ChunkingOptions | None,
    executor: ExecutorOptions | None,
    namespace: str,
    comm: Comm | None = None,
    compression: Any = None,
    base: PathLike | None = None,
    chunk_hashes: bool = False,
) -> _SaveJob:
    t0 = time.perf_counter()
    carried = _Carried(comm)
    storage: Storage | None = None
    with carried.catch():
        storage = Storage(path, executor)
    planned = _plan_state(storage, tree, spec, user_metadata, chunking, namespace, comm, compression, carried)
    job: _SaveJob | None = None
    with carried.catch():
        assert storage is not None  # (else this rank failed before, and carried its error)
        assert planned is not None
        plan = planned.plan
        # The arrays' metadata and the tree's JSON text depend only on the tree's description and
        # where packed arrays go: a save of a tree recognised (planned.memo) takes them from the last.
        opts = storage.location.options
        memo, where = planned.memo, (storage.packed_prefix(), opts.pack_small_leaves, opts.pack_max_bytes)
        derived = None if memo is None else memo.derived.get(where)
        if derived is None:
            derived = _Derived(tuple(_array_metas(storage, planned)), DocumentHead.of(planned.root, {}).tree, {}, {})
            if memo is not None:
                memo.derived[where] = derived
        metas = list(derived.metas)
        # (the tree, values and user metadata serialised now: what cannot be is refused before any write)
        head = DocumentHead.of_tree_text(derived.tree, planned.user)
        values = head.document([e for e in planned.entries if e is not None], ())
        hashed = base is not None or chunk_hashes
        bound = derived.bounds.get(hashed)
        if bound is None:
            bound = derived.bounds[hashed] = _array_bytes_bound(metas, hashed)
        if len(values) + SEAL_BYTES + bound > opts.max_metadata_bytes:  # (SEAL_BYTES: the document's own checksum)
            it = iter(metas)
            leaf_json = [e if e is not None else next(it).to_json() for e in planned.entries]
            _check_document_size(head.document(leaf_json, (m.database for m in metas)), metas, storage)
        if comm is None or comm.rank == 0:
            storage.check_writable(overwrite)
        t1 = time.perf_counter()
        monitor = Monitor()
        me = 0 if comm is None else comm.rank
        monitor.add(Span("save", "plan", me, time.time() - (t1 - t0), time.time(), 0, threading.current_thread().name))
        reuse = _chunk_reuse(metas, base) if base is not None or chunk_hashes else None
        job = _SaveJob(
            storage,
            metas,
            plan,
            planned.data,
            (head, planned.entries),
            overwrite,
            {"plan": t1 - t0},
            monitor,
            comm,
            planned.devices,
            planned.watches,
            reuse,
            derived=derived if memo is not None else None,
        )
    if job is None:  # planning failed on this rank: it raises with the others, at their agreement after planning
        carried.fail("preparing the save")
    return job


@dataclass(frozen=True, slots=True)
class _Derived:
    """What a save derives from a tree's description for one place to store it (api/_recall.py keeps it)."""

    metas: tuple[ArrayMeta, ...]
    tree: str  # the tree's JSON text
    bounds: dict[bool, int]  # _array_bytes_bound's, with chunk hashes and without
    texts: dict[int, _Texts]  # by generation


@dataclass(slots=True)
class _Texts:
    """What a save's document says of its array leaves (these metas) before their checksums: each one's
    entry up to them (array_leaf_heads); the databases the arrays are in; every name the document
    references but its checksums file; and the document's template, once made (SumsTemplate)."""

    metas: tuple[ArrayMeta, ...]
    heads: list[str | None]
    databases: set[str | None]
    names: frozenset[str]
    plain: bool  # no leaf's entry made by to_json (compression or chunk hashes): every head a text
    template: SumsTemplate | None = None

    @classmethod
    def of(cls, metas: Sequence[ArrayMeta]) -> _Texts:
        heads = array_leaf_heads(metas)
        databases = set(map(_DATABASE, metas))
        names = frozenset(map(_PATH, metas)) | {d for d in databases if d is not None}
        return cls(tuple(metas), heads, databases, names, None not in heads)


def _array_metas(storage: Storage, planned: _Planned) -> list[ArrayMeta]:
    """Each array leaf's metadata as it will be stored (its data's checksums aside)."""
    arrays, plan, codecs = planned.arrays, planned.plan, planned.codecs
    names = array_names([a.key for a in arrays])
    databases = _databases(storage, plan, planned.rank, [codecs[a.key] is not None for a in arrays])
    return [
        plain_array_meta(
            a.key,
            a.container,
            a.dtype,
            a.shape,
            ap.chunk_shape,
            f"{ARRAYS_DIR}/{name}",
            a.saved_layout,
            codecs[a.key],
            db,
        )
        for a, ap, name, db in zip(arrays, plan.arrays, names, databases, strict=True)
    ]


def plan_save_of(
    tree: Any,
    spec: Any = None,
    *,
    chunking: ChunkingOptions | None = None,
    namespace: str = "",
    process_group: Any = None,
) -> SavePlan:
    """The save plan this rank runs for ``save(path, tree, spec)``: nothing is read or written.

    The same planning ``save`` and ``async_save`` do (the leaves described, the ranks'
    layouts agreed on, this rank's part planned, or every rank's in a single process),
    for inspecting who writes which chunks. Call it on every rank of ``process_group``
    in a distributed job, as ``save``. Leaves may be :class:`Abstract` (shape, dtype,
    spec and placement, no data): a job's plan is known before its state exists.

    >>> import torch
    >>> plan = plan_save_of({"w": torch.zeros(4, 4)})
    >>> [(a.key, a.chunk_shape, [op.writer for op in a.writes]) for a in plan.arrays]
    [('w', (4, 4), [0])]
    """
    comm = _comm(process_group)
    carried = _Carried(comm)
    with gc_paused():  # as save() plans
        planned = _plan_state(None, tree, spec, None, chunking, namespace, comm, None, carried, plan_only=True)
    if planned is None:
        carried.fail("planning the save")
    if comm is not None:
        carried.agree("planning the save")
    return planned.plan


def _user_metadata(user_metadata: Any) -> dict[str, Any]:
    """``user_metadata`` as the JSON object it will be stored as; refused unless it comes back equal."""
    if user_metadata is None:
        return {}
    if not isinstance(user_metadata, Mapping):
        raise CheckpointError(
            f"user_metadata must be a mapping from str to JSON values (a JSON object), found "
            f"{type(user_metadata).__name__}"
        )
    user = dict(user_metadata)
    try:
        again = json.loads(json.dumps(user, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"user_metadata is not a JSON object: {e}") from None
    if again != user or not _same_json_types(again, user):
        raise CheckpointError(
            "user_metadata would not come back equal: it must be a JSON object, with str keys and values that "
            "are str, int, float, bool, None, lists and dicts of them (tuples come back as lists, other keys "
            "as str)"
        )
    return user


def _same_json_types(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_json_types(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return all(_same_json_types(x, y) for x, y in zip(a, b, strict=True))
    return True


def _array_bytes_bound(metas: Sequence[ArrayMeta], hashed: bool = False) -> int:
    """More than the array leaves can add to the metadata document (their entries, the
    commas between them, their chunk checksums, and their chunk hashes if ``hashed``;
    generation suffixes on names included)."""
    layouts: dict[int, int] = {}
    total = 0
    for m in metas:
        extra = 0
        if m.layout is not None:
            extra = layouts.get(id(m.layout), -1)
            if extra < 0:
                extra = layouts[id(m.layout)] = len(json.dumps(m.layout.to_json()))
        if m.compression is not None:
            extra += len(json.dumps(m.compression.to_json()))
        # the fixed keys and short values, the key (each character at most a 12-byte escape:
        # a surrogate pair), the path and database (with room for a generation suffix), the shapes
        total += 400 + 12 * len(m.key) + len(m.path) + 44 * len(m.shape) + extra
    per_chunk = 6 + (35 if hashed else 0)  # base64 of a uint32; a quoted hex digest of 32 digits and a comma
    chunks = sum(1 if m.chunk_shape == m.shape else chunk_count(m.shape, m.chunk_shape) for m in metas)
    return total + per_chunk * chunks + 40 * len(metas)


def _check_document_size(document: bytes, metas: list[ArrayMeta], storage: Storage) -> None:
    """Refuse, before writing, a checkpoint whose metadata document its location would refuse to read."""
    options = storage.location.options
    limit = options.max_metadata_bytes
    # and the checksums: in the document (their base64, quoted), or past its limit in their file (as
    # place_checksums decides), the document then naming each array's part and the file
    inline = sum(crc32c_chars(chunk_count(m.shape, m.chunk_shape)) for m in metas)
    in_file = inline > options.max_inline_checksum_bytes
    size = len(document) + SEAL_BYTES + (48 * len(metas) + 80 if in_file else inline + 20 * len(metas))
    if size > limit:
        raise MetadataError(
            f"the metadata document of this checkpoint would hold about {size} bytes, more than the {limit} "
            f"bytes a load reads (StorageOptions.max_metadata_bytes); save it, and load it, through a Location "
            f"with a larger max_metadata_bytes"
        )


def _chunk_reuse(metas: list[ArrayMeta], base: PathLike | None) -> ChunkReuse:
    """Hash this save's chunks; with a base checkpoint, link its chunks that are unchanged."""
    reuse = ChunkReuse([m.chunk_shape for m in metas], [m.shape for m in metas], [m.path for m in metas])
    if base is None:
        return reuse
    if not isinstance(base, (str, os.PathLike)) or "://" in os.fspath(base):
        raise CheckpointError(f"an incremental base must be a local directory, found {describe(base)}")
    stored = metadata(base).arrays
    # Arrays of no chunks (a zero in their shape) have no hashes to record.
    chunked = [b for b in stored.values() if chunk_count(b.shape, b.chunk_shape)]
    if chunked and all(b.chunk_hashes is None for b in chunked):
        raise CheckpointError(
            f"the base checkpoint {describe(base)} records no chunk hashes: save it with chunk_hashes=True "
            f"(CheckpointManager(incremental=True) does) to use it as a base"
        )
    reuse.base = Path(base).absolute()
    for m in metas:
        b = stored.get(m.key)
        # Chunks are linked as files: an array packed in an OCDBT database (here or in the
        # base) has none, so it is written (it is small: that is why it was packed).
        same = (
            b is not None
            and b.chunk_hashes is not None
            and b.database is None
            and m.database in (None, PACKED_DIR)  # (PACKED_DIR: packed by another rank, or not; see _databases)
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


_SAVE_PLANS = PlanCache(4)  # the plans of the last few saves: a save in the layout of one of them reuses its plan


def _databases(storage: Storage, plan: SavePlan, rank: int | None, compressed: Sequence[bool]) -> list[str | None]:
    """Where each array goes: the database of its writer (zip archives or OCDBT) if it is small, has one writer
    and packing is on.

    In zip archives (``Storage.packed_prefix``) only uncompressed arrays are packed: the archives
    hold raw chunks, and a compressed small array is stored on its own.

    A rank planning its own part (``rank``) knows whether it alone writes an array: its
    writes cover it. A small array it writes only part of, or nothing of, gets the
    placeholder ``PACKED_DIR``: whether one other rank writes it whole is settled with the
    other ranks before the writes (:meth:`_SaveJob._settle_packing`), and its database
    reaches the coordinator after them.
    """
    opts = storage.location.options
    prefix = storage.packed_prefix()
    out: list[str | None] = []
    limit = min(opts.pack_max_bytes, MAX_PACKED_BYTES) if opts.pack_small_leaves else 0
    names: dict[int, str] = {}  # writer -> its database (one string for its many arrays)
    for ap, squeezed in zip(plan.arrays, compressed, strict=True):
        size = math.prod(ap.shape)
        if not (0 < size * ap.itemsize <= limit) or (squeezed and prefix == ARCHIVE_DIR):
            out.append(None)
            continue
        writes = ap.writes
        writers = {writes[0].writer} if len(writes) == 1 else {op.writer for op in writes}
        if rank is None:  # every write planned
            if len(writers) == 1:
                w = writers.pop()
                out.append(names.get(w) or names.setdefault(w, f"{prefix}/{w}"))
            else:
                out.append(None)
        elif writers == {rank} and sum(op.region.size for op in writes) == size:
            out.append(names.get(rank) or names.setdefault(rank, f"{prefix}/{rank}"))
        else:
            out.append(PACKED_DIR)
    return out


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
        plain Python values (int, float, bool, str, None, and enum members of those),
        nested at most 100 levels, with arrays of at most 32 dims. Every leaf's dotted
        key path must name it alone: ``{"a.b": x, "a": {"b": y}}`` is refused.
      spec: a pytree prefix of ``tree`` whose leaves are sharding specs or None. A
        tensor under a spec is the global tensor, laid out as the spec says: this
        decides the chunk grid and which rank writes what.
      overwrite: replace a committed checkpoint at ``path``.
      user_metadata: a JSON object stored with the checkpoint (str keys; str, int,
        float, bool, None, lists and dicts), refused unless it would come back equal.
      chunking: how stored arrays are chunked.
      executor: concurrency of the I/O, staging memory, progress bar.
      namespace: the optree namespace of custom pytree nodes in ``tree``.
      process_group: the ranks that save together: those of ``process_group``, else
        the whole world. When torch.distributed is initialised (at any world size) or
        a group is given, each of them calls ``save`` with its own part of the state:
        DTensors (on a mesh of all or some of the ranks: the others hold nothing of
        them), ShardedLeafs holding its shard, and plain tensors and values that every
        rank holds whole (written once in total). Checkpoint traffic runs on gloo
        groups of its own with those ranks, made once, by those ranks alone. With one
        rank (a world of one, a group of one) it runs as a single process does, with
        no group and no collective; DTensors must then be on a mesh of that rank alone.
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
      CheckpointError: naming the leaf, for anything that cannot be saved (meta, sparse,
        nested and quantized tensors, subclasses of int, float and str that are not
        enums, colliding key paths), before anything is written. In a distributed save
        every rank raises if any rank failed (the same error, naming the failed ranks and
        what failed there), and nothing is committed.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp()
    >>> pytreeckpt.save(d + "/ckpt", {"w": torch.ones(2, 3), "step": 7})
    >>> pytreeckpt.load(d + "/ckpt")["step"]
    7
    """
    _wait_in_flight()
    with gc_paused():  # the caller waits for the whole save
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
            job.ready()
            job.persist()
        finally:
            if monitor is not None:
                monitor.extend(job.monitor.spans)
            # Its objects go now, while the collector is paused: alive when it resumes, they would be
            # traversed by its first pass (15 ms for 10,000 leaves) though nothing holds them after this.
            del job


class SaveHandle:
    """A save running in the background: ``wait()``, ``done()``, per-phase ``timings`` and its ``monitor``."""

    def __init__(
        self,
        path: PathLike,
        timings: dict[str, float],
        monitor: Monitor,
        user: Monitor | None,
        *,
        cancel: threading.Event | None = None,
        exit_timeout: float | None = None,
    ) -> None:
        self.path = describe(path)
        self._cancel = cancel or threading.Event()
        self._exit_timeout = exit_timeout
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
        in_background(job.storage.options.background_nice)  # (this thread is the save's own)
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
            with contextlib.suppress(PoolAborted):  # (the writer failed and aborted the pool: wait() reports it)
                job.snapshot(snap, start, merged)
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
    with gc_paused():  # planning, in the caller's thread (the writes run with the collector as the caller left it)
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
    try:
        if job.pending is None:
            snap, start, merged = job.stage()
    except Exception as e:
        if job.comm is None:
            raise
        job.pending = e
    try:
        job.ready()  # in a distributed save: every rank planned and staged its part, or all raise
    except BaseException:
        staging_pool().free()
        raise
    handle = SaveHandle(
        path, job.timings, job.monitor, monitor, cancel=job.cancelled, exit_timeout=job.storage.options.exit_timeout
    )
    _settle_at_exit_once()
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


_EXIT_HOOKED: list[bool] = []  # _settle_at_exit is registered


def _settle_at_exit_once() -> None:
    """Register :func:`_settle_at_exit` to run when the main thread ends, before Python joins the other threads.

    ``threading._register_atexit`` (what ``concurrent.futures`` uses) runs there; a hook
    registered with :mod:`atexit` would run only after the writer has been joined, too
    late to bound the wait. Where it is missing the writer is still joined, without a bound.
    """
    with _IN_FLIGHT_LOCK:
        if _EXIT_HOOKED:
            return
        _EXIT_HOOKED.append(True)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # the interpreter is exiting already
            register(_settle_at_exit)


def _settle_at_exit() -> None:
    """Wait for the save in flight, at most its ``exit_timeout``; then cancel it (it commits nothing)."""
    with _IN_FLIGHT_LOCK:
        pending = list(_in_flight)
    for h in pending:
        if not h._done.wait(h._exit_timeout):
            h._cancel.set()
            logger.warning(
                "the asynchronous save to %s was still running %s s after the program ended: cancelled, "
                "nothing is committed there (ExecutorOptions.exit_timeout)",
                h.path,
                h._exit_timeout,
            )


def _quietly(fn: Any, *args: Any) -> None:
    """Run ``fn`` on a thread whose errors are reported elsewhere (wait_snapshot and wait)."""
    with contextlib.suppress(BaseException):
        fn(*args)
