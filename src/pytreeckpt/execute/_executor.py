"""Runs this rank's part of a plan against a :class:`~pytreeckpt.storage.Storage`.

The writes of a :class:`~pytreeckpt.plan.SavePlan` and the reads of a
:class:`~pytreeckpt.plan.LoadPlan` go out as futures with a bound on the bytes in flight.
Data comes and goes through callbacks that map ``(rank, piece)`` to numpy views of
rank-local memory, so the same executor serves one process holding every rank and (with
transfers done by the distributed adapter) one rank among many."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pytreeckpt.core._dtypes import DType
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.format import (
    ArrayMeta,
)
from pytreeckpt.plan import ArrayLoadPlan, ArraySavePlan, ReadOp, WriteOp
from pytreeckpt.storage import ChunkSums, Storage, Window, chunk_crc, chunk_hash

from ._cast import convert

__all__ = [
    "ChunkReuse",
    "PieceData",
    "WriteItem",
    "assemble",
    "read_arrays",
    "small_whole_sources",
    "write_arrays",
    "write_items",
    "write_small_whole",
]

logger = logging.getLogger("pytreeckpt")


PieceData = Callable[[int, int], tuple[np.ndarray, Region]]
"""``(rank, piece) -> (view, region)``: a numpy view of the local memory holding that
piece, and the global region it covers."""


WriteItem = tuple[int, Region, np.ndarray, Callable[[], None] | None]
"""``(array index, region, data, done)``: one write; ``done`` runs when it has finished."""


def write_arrays(
    storage: Storage,
    metas: Sequence[ArrayMeta],
    items: Iterable[WriteItem],
    create: bool = True,
    progress: Callable[[int], None] | None = None,
    reuse: ChunkReuse | None = None,
    only: Iterable[int] | None = None,
    sums: ChunkSums | None = None,
) -> int:
    """Write ``(array index, region, data, done)`` items, a bounded number of bytes at a time.

    ``only`` gives the indices of the arrays the items write (None: any of ``metas``);
    only those are opened.

    ``items`` may be a generator that assembles each buffer when asked, so memory
    stays bounded by ``max_inflight_bytes``; ``done`` (or None) is called once the
    write of that buffer has finished, well or not, so its memory may be reused.
    With ``create=False`` the arrays must exist already (another rank created them).
    ``progress(nbytes)`` is called as writes finish. With ``reuse`` every chunk's
    content is hashed, and a chunk equal to the base checkpoint's is hard-linked from
    it instead of written. ``sums`` records every chunk's crc32c (and hash): chunk
    files written here give theirs as they are written, other chunks are checksummed
    from the data before TensorStore encodes it. Returns the bytes written.
    """
    wanted = range(len(metas)) if only is None else sorted(set(only))
    stores = dict(zip(wanted, storage.open_arrays([metas[i] for i in wanted], create=create), strict=True))
    window = Window(storage.options.max_inflight_bytes, storage.waits)
    written = 0
    try:
        for i, region, buf, done in items:
            parts = [(region, buf)] if reuse is None else reuse.keep(i, region, buf, storage, sums)
            if not parts:  # every chunk linked from the base
                if done is not None:
                    done()
                if progress is not None:
                    progress(buf.nbytes)
                continue
            if len(parts) == 1 and storage.handles_packed(metas[i]) and storage.handles_files(metas[i], buf):
                # A packed array's bytes are copied into its database's transaction at once:
                # no write in flight to wait for, unless this one filled the transaction.
                committed = storage.write_packed(metas[i], region, buf, None if sums is None else sums.recorder(i))
                written += buf.nbytes
                if committed.done() and committed.exception() is None:
                    if done is not None:
                        done()
                    if progress is not None:
                        progress(buf.nbytes)
                    continue
                if done is not None or progress is not None:
                    committed.add_done_callback(_finished(done, progress, buf.nbytes))
                window.add(committed, buf.nbytes, f"leaf {metas[i].key!r}: writing {region}")
                continue
            done_all = done if len(parts) == 1 else _after_all(len(parts), done)
            for part, data in parts:
                nbytes = data.nbytes
                written += nbytes
                future: Any
                if storage.handles_files(metas[i], data):
                    future = storage.write_chunk_files(metas[i], part, data, None if sums is None else sums.recorder(i))
                else:
                    if sums is not None:
                        sums.add_region(i, metas[i], part, data)
                    future = stores[i][part.slices()].write(data)
                    storage.note_chunks(metas[i], part)
                if done_all is not None or progress is not None:
                    future.add_done_callback(_finished(done_all, progress, nbytes))
                window.add(future, nbytes, f"leaf {metas[i].key!r}: writing {part}")
    except BaseException:
        # The items failed (a copy, a transfer): let the writes already issued finish
        # before the failure is reported, so nothing writes into the directory after it.
        window.drain_quietly()
        raise
    window.drain()
    storage.sync()
    return written


def write_small_whole(
    storage: Storage,
    metas: Sequence[ArrayMeta],
    plans: Sequence[ArraySavePlan],
    data: Sequence[PieceData],
    progress: Callable[[int], None],
    sums: ChunkSums,
) -> tuple[int, list[int] | None]:
    """Before :func:`write_arrays`, in a single process's save straight from the caller's memory (no
    staging, no base checkpoint): the small arrays written whole from one piece that
    :meth:`Storage.small_whole` takes, in one batch per database (:meth:`Storage.write_small`, in
    this thread: the lean path of many small leaves).

    Returns the bytes written and the arrays :func:`write_arrays` is left to write (None: all).
    """
    small, datas, rest = small_whole_sources(storage, metas, plans, data)
    if not small:
        return 0, None
    written = storage.write_small([metas[i] for i in small], datas, lambda k, crc: sums.add_single(small[k], crc))
    progress(written)
    return written, rest


def small_whole_sources(
    storage: Storage,
    metas: Sequence[ArrayMeta],
    plans: Sequence[ArraySavePlan],
    data: Sequence[PieceData],
    max_bytes: int | None = None,
    skip: Sequence[bool] | None = None,
) -> tuple[list[int], list[np.ndarray], list[int]]:
    """The arrays of a single process's save that :meth:`Storage.write_small` may write in one batch (each
    whole from one piece of the writer's memory, taken by :meth:`Storage.small_whole`; of at most
    ``max_bytes`` when given; not ``skip[i]``), with views of their memory, and the other arrays."""
    small: list[int] = []
    datas: list[np.ndarray] = []
    rest: list[int] = []
    small_whole = storage.small_whole
    for i, (meta, ap) in enumerate(zip(metas, plans, strict=True)):
        if (
            small_whole(meta)
            and len(ap.writes) == 1
            and (max_bytes is None or meta.nbytes <= max_bytes)
            and (skip is None or not skip[i])
        ):
            op = ap.writes[0]
            if len(op.sources) == 1 and op.sources[0].rank == op.writer:
                src, where = data[i](op.writer, op.sources[0].piece)
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


def read_arrays(
    storage: Storage,
    metas: Sequence[ArrayMeta],
    plans: Sequence[ArrayLoadPlan],
    dest: Sequence[PieceData],
    rank: int | None,
    after: Callable[[int, ReadOp, np.ndarray], None] | None = None,
    array_done: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
    casts: Sequence[DType | None] | None = None,
) -> int:
    """Run the reads of ``rank`` (every rank when None) straight into destination memory.

    Each region lands in the reader's own target and is copied to the other targets
    in this process; ``after(array index, op, data)`` then runs, e.g. to send it on
    to targets on other ranks. ``array_done(i)`` runs once every read of array ``i``
    has landed (while later arrays are still being read), ``progress(nbytes)`` as
    reads land. ``casts[i]``, when not None, is the dtype of array ``i``'s destinations
    (another than the stored one): each read lands in a buffer of the stored dtype, of
    its region's size (within one chunk), converted into the reader's target
    (:func:`~pytreeckpt.execute._cast.convert`) before the rest. Returns the bytes read.
    """
    storage.check_files(metas)
    stores = storage.open_arrays(metas, create=False)
    window = Window(storage.options.max_inflight_bytes, storage.waits)
    read = 0
    for i, (meta, plan, store, get) in enumerate(zip(metas, plans, stores, dest, strict=True)):
        mine = [op for op in plan.reads if rank is None or op.reader == rank]
        if not mine and array_done is not None:
            array_done(i)
        cast = None if casts is None else casts[i]
        if cast is not None:
            read += _read_cast(storage, meta, store, mine, get, rank, cast, window, after, array_done, progress, i)
            continue
        if mine and storage.handles_packed(meta) and _whole_into_one(mine, meta):
            # A packed array read whole into one target: one key-value read per chunk (from zip archives, one
            # read of all its chunks, which follow one another).
            t = mine[0].targets[0]
            view, where = get(t.rank, t.piece)
            if where.shape == meta.shape and view.dtype == meta.dtype.numpy:
                nbytes = meta.nbytes
                reads = storage.read_packed_whole(meta, store, view)
                landed = [(op, view[op.region.relative_to(where).slices()]) for op in mine] if after else []
                window.add(
                    reads,
                    nbytes,
                    f"leaf {meta.key!r}: reading {meta.path!r}",
                    _then(after, progress, array_done, i, landed, nbytes),
                )
                read += nbytes
                continue
        landing: list[list[np.ndarray]] = []  # per read: its reader's target first, then the others here
        for op in mine:
            outs = []
            for t in sorted(op.targets, key=lambda t: t.rank != op.reader):
                if rank is None or t.rank == rank:
                    view, where = get(t.rank, t.piece)
                    outs.append(view[t.region.relative_to(where).slices()])
            landing.append(outs)
        starts = storage.read_chunks(
            meta, store, [(op.region, outs[0]) for op, outs in zip(mine, landing, strict=True)]
        )
        for n, (op, outs) in enumerate(zip(mine, landing, strict=True)):
            first = outs[0]
            nbytes = op.region.size * plan.itemsize
            future = starts[n]()

            def fan_out(
                first: np.ndarray = first,
                rest: list[np.ndarray] = outs[1:],
                i: int = i,
                op: ReadOp = op,
                last: bool = n == len(mine) - 1,
                nbytes: int = nbytes,
            ) -> None:
                for o in rest:
                    o[...] = first
                if after is not None:
                    after(i, op, first)
                if progress is not None:
                    progress(nbytes)
                if last and array_done is not None:
                    array_done(i)

            read += nbytes
            window.add(future, nbytes, f"leaf {meta.key!r}: reading {op.region} of {meta.path!r}", fan_out)
    window.drain()
    return read


def _whole_into_one(mine: Sequence[ReadOp], meta: ArrayMeta) -> bool:
    """Whether the reads ``mine`` (each within one chunk) are the whole array, each into the same one target."""
    first = mine[0].targets[0]
    return (
        all(len(op.targets) == 1 and op.targets[0].rank == first.rank for op in mine)
        and all(op.targets[0].piece == first.piece and op.targets[0].region == op.region for op in mine)
        and sum(op.region.size for op in mine) == math.prod(meta.shape)
    )


def _read_cast(
    storage: Storage,
    meta: ArrayMeta,
    store: Any,
    mine: Sequence[ReadOp],
    get: PieceData,
    rank: int | None,
    cast: DType,
    window: Window,
    after: Callable[[int, ReadOp, np.ndarray], None] | None,
    array_done: Callable[[int], None] | None,
    progress: Callable[[int], None] | None,
    i: int,
) -> int:
    """The reads ``mine`` of array ``i``, each into a buffer of the stored dtype converted into its targets
    (of dtype ``cast``). The reads of one chunk are started together (the chunk is read once), their
    buffers made just before: what is in memory beyond the targets is the window's bytes in flight."""
    chunk = meta.chunk_shape
    by_chunk: dict[tuple[int, ...], list[ReadOp]] = {}
    for op in mine:  # (every planned read lies within one chunk)
        by_chunk.setdefault(tuple(o // c for o, c in zip(op.region.offset, chunk, strict=True)), []).append(op)
    itemsize = meta.dtype.itemsize
    stored = meta.dtype
    read = 0
    left = len(mine)
    for ops in by_chunk.values():
        bufs = [np.empty(op.region.shape, dtype=stored.numpy) for op in ops]
        starts = storage.read_chunks(meta, store, [(op.region, b) for op, b in zip(ops, bufs, strict=True)])
        for op, buf, start in zip(ops, bufs, starts, strict=True):
            outs = []
            for t in sorted(op.targets, key=lambda t: t.rank != op.reader):
                if rank is None or t.rank == rank:
                    view, where = get(t.rank, t.piece)
                    outs.append(view[t.region.relative_to(where).slices()])
            nbytes = op.region.size * itemsize
            left -= 1

            def land(
                buf: np.ndarray = buf, outs: list[np.ndarray] = outs, op: ReadOp = op, last: bool = left == 0
            ) -> None:
                convert(buf, stored, outs[0], cast)
                for o in outs[1:]:
                    o[...] = outs[0]
                if after is not None:
                    after(i, op, outs[0])  # (sent on in the target's dtype: every rank's target has it)
                if progress is not None:
                    progress(op.region.size * itemsize)
                if last and array_done is not None:
                    array_done(i)

            read += nbytes
            window.add(start(), nbytes, f"leaf {meta.key!r}: reading {op.region} of {meta.path!r}", land)
    return read


def _then(
    after: Callable[[int, ReadOp, np.ndarray], None] | None,
    progress: Callable[[int], None] | None,
    array_done: Callable[[int], None] | None,
    i: int,
    landed: list[tuple[ReadOp, np.ndarray]],
    nbytes: int,
) -> Callable[[], None] | None:
    """What runs once a whole array's reads have landed: ``after`` (each read and its data in ``landed``),
    ``progress``, ``array_done``."""
    if after is None and progress is None and array_done is None:
        return None

    def then() -> None:
        if after is not None:
            for op, data in landed:
                after(i, op, data)
        if progress is not None:
            progress(nbytes)
        if array_done is not None:
            array_done(i)

    return then


def _after_all(n: int, done: Callable[[], None] | None) -> Callable[[], None] | None:
    """A callback that calls ``done`` on its ``n``-th call."""
    if done is None:
        return None
    left = [n]
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done()

    return one


def _finished(
    done: Callable[[], None] | None, progress: Callable[[int], None] | None, nbytes: int
) -> Callable[[Any], None]:
    def callback(_future: Any) -> None:
        if done is not None:
            done()
        if progress is not None:
            progress(nbytes)

    return callback


@dataclass(slots=True)
class ChunkReuse:
    """Hashes the chunks of a save, and links those equal to the base checkpoint's instead of writing them.

    ``base_chunks[i]`` is the base's array path and chunk hashes for array ``i`` when the
    base stores that leaf the same way (shape, dtype, chunk grid, codecs), else None.
    Hashes (and the crc32c of linked chunks) go to the save's :class:`ChunkSums`.
    """

    chunk_shapes: list[tuple[int, ...]]
    shapes: list[tuple[int, ...]]
    paths: list[str]
    base: Path | None = None
    base_chunks: list[tuple[str, tuple[str, ...]] | None] = field(default_factory=list)
    linked_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def keep(
        self, i: int, region: Region, buf: np.ndarray, storage: Storage, sums: ChunkSums | None
    ) -> list[tuple[Region, np.ndarray]]:
        """Hash every chunk of this write; link the unchanged ones; return the boxes still to write."""
        chunk_shape, shape = self.chunk_shapes[i], self.shapes[i]
        grid = [-(-s // c) for s, c in zip(shape, chunk_shape, strict=True)]
        base = self.base_chunks[i] if self.base_chunks else None
        rest: list[tuple[Region, np.ndarray]] = []
        linked_any = False
        chunks = ChunkGrid(shape, chunk_shape)
        for index in chunks.touching(region):
            box = chunks.region(index)
            data = buf[box.relative_to(region).slices()]
            digest = chunk_hash(data)
            flat = int(np.ravel_multi_index(index, grid)) if grid else 0
            if sums is not None:
                sums.add_hash(i, flat, digest)
            if (
                base is not None
                and self.base is not None
                and base[1][flat] == digest
                and storage.link_chunk(self.base, base[0], self.paths[i], index)
            ):
                with self._lock:
                    self.linked_bytes += data.nbytes
                if sums is not None:  # the same elements as the base's chunk file: the same checksum
                    sums.add_crc(i, index, chunk_crc(data, chunk_shape))
                linked_any = True
                continue
            rest.append((box, data))
        if not linked_any:
            return [(region, buf)]
        return rest


def assemble(op: WriteOp, get: PieceData, dtype: np.dtype) -> np.ndarray:
    """The data of a write: a view of the writer's memory, or a buffer merged from fragments."""
    if op.is_direct:
        src, where = get(op.writer, op.sources[0].piece)
        view: np.ndarray = src[op.region.relative_to(where).slices()]
        return view
    buf = np.empty(op.region.shape, dtype=dtype)
    for frag in op.sources:
        src, where = get(frag.rank, frag.piece)
        buf[frag.region.relative_to(op.region).slices()] = src[frag.region.relative_to(where).slices()]
    return buf


def write_items(
    plans: Sequence[ArraySavePlan],
    data: Sequence[PieceData],
    dtypes: Sequence[np.dtype],
    rank: int | None,
    only: Iterable[int] | None = None,
) -> Iterator[tuple[int, WriteOp, np.ndarray]]:
    """The writes of ``rank`` (every rank when None), each assembled when reached; of arrays ``only`` if given."""
    for i in range(len(plans)) if only is None else only:
        plan, get, dtype = plans[i], data[i], dtypes[i]
        for op in plan.writes:
            if rank is None or op.writer == rank:
                yield i, op, assemble(op, get, dtype)
