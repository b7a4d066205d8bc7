"""A save's job on this rank: stage a snapshot (async saves), write its part, and commit (rank 0).

The job is made by ``_prepare``; ``save`` runs :meth:`SaveJob.persist` in the caller's
thread, ``async_save`` stages a snapshot (:meth:`SaveJob.stage`, :meth:`SaveJob.snapshot`)
and persists on a writer thread (``_handle``). In a distributed save every rank writes its
part, the writers' packed databases and chunk checksums go to rank 0, and rank 0 commits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch

from pytreeckpt.core._errors import CheckpointError, CheckpointTimeoutError
from pytreeckpt.core._region import Region
from pytreeckpt.distributed._agree import own_spans, take_spans
from pytreeckpt.distributed._comm import data_comm
from pytreeckpt.execute._executor import (
    ChunkReuse,
    PieceData,
    small_whole_sources,
    write_arrays,
    write_items,
    write_small_whole,
)
from pytreeckpt.execute._monitor import Monitor, Progress, Span
from pytreeckpt.execute._pipeline import SmallBatch, Snapshot, small_batches, staged_writes
from pytreeckpt.execute._staging import staged_bytes, staging_pool
from pytreeckpt.format import (
    CHECKSUMS_FILE,
    PACKED_DIR,
    ArrayMeta,
    DocumentHead,
    SumsTemplate,
    array_leaf_heads,
    array_leaf_texts,
    crc32c_chars,
    generation_name,
    place_checksums,
)
from pytreeckpt.plan import SavePlan
from pytreeckpt.storage import ChunkSums, Storage

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

__all__ = ["Derived", "SaveJob"]

_T = TypeVar("_T")

# The largest array an asynchronous save copies in a batch of small whole arrays (``Snapshot.small``): below it
# a staged piece's own cost (planning it, ~30 us) outweighs its copy; above, the pipeline's pieces overlap writes.
_SMALL_BATCH_BYTES = 64 << 10


@dataclass(slots=True)
class SaveJob:
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
    derived: Derived | None = None  # kept for the next save of a tree like this one (saving/_recall.py)
    rest: list[int] | None = None  # an async save's arrays not in the snapshot's batches of small ones (None: all)

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
            self.data, merged = snapshot_merges(self.plan.arrays, self.data, self.comm.rank)
        opts = self.storage.options
        rank = None if self.comm is None else self.comm.rank
        device = self.device or [None] * len(self.metas)
        small: list[SmallBatch] = []
        rest: list[int] | None = None
        if self.comm is None and self.reuse is None:
            # the small whole arrays in batches, as a blocking save writes them (write_small_whole)
            on_device = [d is not None for d in device]
            arrays, sources, rest = small_whole_sources(
                self.storage, self.metas, self.plan.arrays, self.data, _SMALL_BATCH_BYTES, on_device
            )
            small = small_batches(arrays, sources, opts.staging_piece_bytes)
        writes = staged_writes(self.plan.arrays, rank, opts.staging_piece_bytes, rest)
        pieces = itertools.chain((b.nbytes for b in small), (w.nbytes for w in writes))
        sizes = [staged_bytes(n) for n in pieces]
        need = sum(sizes)
        capacity = need if opts.staging_bytes is None else min(need, opts.staging_bytes)
        capacity = max(capacity, max(sizes, default=0))
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
            small=small,
        )
        self.rest = rest
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
                        sums = self._sums()
                        box[0], only = 0, None
                        if self.snap is None and self.reuse is None:
                            box[0], only = write_small_whole(
                                self.storage, self.metas, self.plan.arrays, self.data, progress.advance, sums
                            )
                        elif self.snap is not None and self.snap.small:
                            box[0], only = self._write_small_staged(progress.advance, sums), self.rest
                        box[0] += write_arrays(
                            self.storage,
                            self.metas,
                            self._items(only),
                            progress=progress.advance,
                            reuse=self.reuse,
                            only=only,
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

    def _write_small_staged(self, progress: Any, sums: ChunkSums) -> int:
        """The snapshot's batches of small whole arrays (:func:`small_batches`), each in one :meth:`Storage.write_small`
        call as a blocking save writes them; returns the bytes written."""
        assert self.snap is not None
        written = 0
        for arrays, views, release in self._until_cancelled(self.snap.small_items()):
            try:
                n = self.storage.write_small([self.metas[i] for i in arrays], views, _recorder(sums, arrays))
            finally:
                release()
            written += n
            progress(n)
        return written

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
        except CheckpointError as e:
            if self._ranks.rank == 0:
                self.storage.abandon()
            if not isinstance(e, CheckpointTimeoutError):  # (after a timeout no rank waits for the removal)
                self._ranks.broadcast(None, 0, f"removing what the save wrote ({what} failed)")
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
        gathered = comm.gather(whole, "planning the packed arrays")
        unpacked = None
        if comm.rank == 0:
            packed = {i for got in gathered for i in got}
            unpacked = [i for i, m in enumerate(self.metas) if m.database is not None and i not in packed]
            unpacked = [i for i in unpacked if self.metas[i].database == PACKED_DIR]
        for i in comm.broadcast(unpacked, 0, "planning the packed arrays", meet=False):
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
        generation = comm.broadcast(generation, 0, "preparing the checkpoint directory", meet=False)
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
        # (with every rank's spans, to rank 0's monitor: each rank's last phase has ended)
        gathered = comm.gather((packed, self._sums().payload(), own_spans(self.monitor, me)), "writing the checkpoint")
        if me == 0:
            take_spans(self.monitor, [g[2] for g in gathered])
            try:
                self._check_cancelled()
                with self.monitor.phase("save", "commit", 0):
                    self._commit([g[:2] for g in gathered])
            except Exception as e:
                error = e
        try:
            self._agree(error, "committing the checkpoint")
        except CheckpointTimeoutError as e:  # a rank did not come after rank 0's commit: say what is on disk
            e.add_note(
                f"rank 0 committed the checkpoint at {self.storage.url} before this wait: it is whole and loadable"
                if me == 0 and error is None
                else f"rank 0 had committed the checkpoint at {self.storage.url} before this wait, unless it failed "
                f"(then nothing is committed): load it to see"
            )
            raise
        return t1


_PATH = operator.attrgetter("path")
_DATABASE = operator.attrgetter("database")
_NBYTES = operator.attrgetter("nbytes")


def _recorder(sums: ChunkSums, arrays: Sequence[int]) -> Callable[[int, int], None]:
    """``record(k, crc32c)`` of :meth:`Storage.write_small` for arrays ``arrays``: each one's single chunk."""

    def record(k: int, crc: int) -> None:
        sums.add_single(arrays[k], crc)

    return record


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


@dataclass(frozen=True, slots=True)
class Derived:
    """What a save derives from a tree's description for one place to store it (saving/_recall.py keeps it)."""

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


def snapshot_merges(plans: Sequence[Any], data: Sequence[PieceData], me: int) -> tuple[list[PieceData], int]:
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
