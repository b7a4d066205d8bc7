"""The pipelined snapshot of an asynchronous save.

The caller's thread copies the state into the staging pool piece by piece (a piece is a
box of whole chunks of at most ``ExecutorOptions.staging_piece_bytes``) and hands each
piece to the writer thread, which writes it while the next is copied; a piece's memory
goes back to the pool when its write has finished. The caller is blocked only for the
copies, and, when the state is larger than the pool, for the writes that make room.

CUDA leaves are copied device-to-host with ``non_blocking=True`` on a side stream that
first waits for the caller's stream; the writer waits on each piece's event before
writing it, and the caller's stream waits on the side stream before the call returns, so
kernels the caller queues afterwards cannot change the state before it is copied, and the
host does not wait for the copies at all.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._region import Region, split_aligned
from pytreeckpt.plan import ArraySavePlan, Fragment

from ._executor import PieceData
from ._staging import Stage, StagingPool, copy_into

__all__ = ["DeviceData", "SmallBatch", "Snapshot", "StagedWrite", "small_batches", "staged_writes"]

DeviceData = Callable[[int, int], tuple[torch.Tensor, Region]]
"""``(rank, piece) -> (tensor view, region)`` for leaves on a CUDA device."""


@dataclass(frozen=True, slots=True)
class StagedWrite:
    """A box of whole chunks of array ``array``, assembled from ``sources``, copied and written as one piece."""

    array: int
    region: Region
    sources: tuple[Fragment, ...]
    nbytes: int


def staged_writes(
    plans: Sequence[ArraySavePlan], rank: int | None, max_bytes: int, only: Sequence[int] | None = None
) -> list[StagedWrite]:
    """The pieces the caller copies: every write in one process (``rank=None``), else this rank's direct writes;
    of arrays ``only`` when given.

    Writes merged from other ranks' fragments take another path in a distributed save
    (the fragments travel to the writer), so only direct writes are staged there.
    """
    out: list[StagedWrite] = []
    for i in range(len(plans)) if only is None else only:
        plan = plans[i]
        for op in plan.writes:
            if rank is not None and (op.writer != rank or not op.is_direct):
                continue
            for part in split_aligned(op.region, plan.chunk_shape, plan.itemsize, max_bytes):
                sources = []
                for frag in op.sources:
                    inter = frag.region.intersect(part)
                    if inter is not None:
                        sources.append(Fragment(frag.rank, frag.piece, inter))
                out.append(StagedWrite(i, part, tuple(sources), part.size * plan.itemsize))
    return out


@dataclass(frozen=True, slots=True)
class SmallBatch:
    """Whole small arrays copied together into one piece of staging memory: ``arrays[k]``'s elements from
    ``sources[k]`` (a view of the caller's memory) to bytes ``offsets[k]`` of the piece."""

    arrays: tuple[int, ...]
    sources: tuple[np.ndarray, ...]
    offsets: tuple[int, ...]
    nbytes: int


def small_batches(arrays: Sequence[int], sources: Sequence[np.ndarray], max_bytes: int) -> list[SmallBatch]:
    """Batches of the whole small arrays ``arrays`` (their memory ``sources``), each at most ``max_bytes`` (or one
    array): one staging piece and one copy loop for thousands of leaves, where a piece each cost the caller
    ~30 us of planning and copying per leaf (issue 44: 20,000 leaves of 4 floats stalled 0.8-0.9 s, the
    blocking save took 0.2 s)."""
    out: list[SmallBatch] = []
    start, end = 0, 0
    offsets: list[int] = []
    for k, src in enumerate(sources):
        size = -(-src.nbytes // 16) * 16  # (aligned for any element type)
        if offsets and end + size > max_bytes:
            out.append(SmallBatch(tuple(arrays[start:k]), tuple(sources[start:k]), tuple(offsets), end))
            start, end, offsets = k, 0, []
        offsets.append(end)
        end += size
    if offsets:
        out.append(SmallBatch(tuple(arrays[start:]), tuple(sources[start:]), tuple(offsets), end))
    return out


_DONE = object()
# Below this, numpy copies an array in 0.7 us, torch's copy (copy_into) in 5.4 us; above, torch's is as fast
# and takes a large array on all its threads.
_TINY_BYTES = 4096


class Snapshot:
    """Copies staged writes into the pool (caller's thread) and yields them to the writer (writer's thread)."""

    def __init__(
        self,
        writes: Sequence[StagedWrite],
        data: Sequence[PieceData],
        device_data: Sequence[DeviceData | None],
        dtypes: Sequence[np.dtype],
        torch_dtypes: Sequence[torch.dtype | None],
        pool: StagingPool,
        hold: bool = False,
        watch: Sequence[Sequence[tuple[torch.Tensor, int]]] = (),
        keys: Sequence[str] = (),
        small: Sequence[SmallBatch] = (),
    ) -> None:
        self.writes = writes
        # copied first, each batch one piece: the writer takes them (small_items) before the writes (items)
        self.small = small
        self.data = data
        self.device_data = device_data
        self.dtypes = dtypes
        self.torch_dtypes = torch_dtypes
        self.pool = pool
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.copied_bytes = 0
        self.uses_cuda = any(d is not None for d in device_data)
        # With room for every piece there is nothing to overlap: the writer
        # (``_SaveJob.persist``) waits on ``copied`` before any of its work rather than
        # compete with the copy for memory bandwidth and cores.
        self.hold = hold
        self.copied = threading.Event()
        # the version counters of each array's tensors at the call: a copy made after
        # an in-place change (a lazy snapshot overtaken by training) is refused
        self.watch = watch
        self.keys = keys

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.writes) + sum(b.nbytes for b in self.small)

    def run(self, progress: Callable[[int], None] | None = None) -> None:
        """Copy every piece, in order, waiting for room in the pool; the writer is fed as pieces are ready.

        Raises what the writer failed with (the pool is aborted) or what a copy failed
        with (the writer is told, and commits nothing).
        """
        side = main = None
        if self.uses_cuda:
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(main)
        try:
            for b in self.small:
                stage = self.pool.acquire(b.nbytes)
                try:
                    views = self._copy_small(b, stage)
                    for i in b.arrays:
                        self._check_unchanged(i)
                except BaseException:
                    self.pool.release(stage)
                    raise
                self.queue.put((b, views, stage, None))
                self.copied_bytes += b.nbytes
                if progress is not None:
                    progress(b.nbytes)
            for w in self.writes:
                stage = self.pool.acquire(w.nbytes)
                try:
                    buf, event = self._copy(w, stage, side)
                    self._check_unchanged(w.array)
                except BaseException:
                    self.pool.release(stage)
                    raise
                self.queue.put((w, buf, stage, event))
                self.copied_bytes += w.nbytes
                if progress is not None:
                    progress(w.nbytes)
        except BaseException as e:
            self.queue.put(e)
            raise
        finally:
            if side is not None and main is not None:
                main.wait_stream(side)
            self.copied.set()
        self.queue.put(_DONE)

    def _copy(self, w: StagedWrite, stage: Stage, side: Any) -> tuple[np.ndarray, Any]:
        dtype = self.dtypes[w.array]
        buf = stage.buf.numpy().view(dtype).reshape(w.region.shape)
        device = self.device_data[w.array]
        if device is None:
            get = self.data[w.array]
            for frag in w.sources:
                src, where = get(frag.rank, frag.piece)
                copy_into(buf[frag.region.relative_to(w.region).slices()], src[frag.region.relative_to(where).slices()])
            return buf, None
        tdtype = self.torch_dtypes[w.array]
        assert tdtype is not None
        dst = stage.buf.view(tdtype).view(w.region.shape)
        with torch.cuda.stream(side):
            for frag in w.sources:
                src_t, where = device(frag.rank, frag.piece)
                part = src_t[frag.region.relative_to(where).slices()]
                dst[frag.region.relative_to(w.region).slices()].copy_(part, non_blocking=True)
                part.record_stream(side)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
        return buf, event

    @staticmethod
    def _copy_small(b: SmallBatch, stage: Stage) -> list[np.ndarray]:
        arena = stage.buf.numpy()
        views = []
        for src, at in zip(b.sources, b.offsets, strict=True):
            view = arena[at : at + src.nbytes].view(src.dtype).reshape(src.shape)
            if src.nbytes < _TINY_BYTES:
                np.copyto(view, src, casting="no")
            else:
                copy_into(view, src)
            views.append(view)
        return views

    def _check_unchanged(self, i: int) -> None:
        if not self.watch:
            return
        for t, version in self.watch[i]:
            if t._version != version:
                raise CheckpointError(
                    f"leaf {self.keys[i]!r} was changed in place (its version went from {version} to {t._version}) "
                    f"before the snapshot had copied it, so this save would not hold the state of one moment; "
                    f"nothing is committed. With snapshot='lazy', call handle.wait_snapshot() (or handle.guard("
                    f"optimizer)) before the optimizer step"
                )

    def small_items(self) -> Iterator[tuple[tuple[int, ...], list[np.ndarray], Callable[[], None]]]:
        """The writer's side, first: each batch of small arrays once copied (the arrays, their staged elements),
        with the callback that frees its memory."""
        for _ in self.small:
            item = self._next()
            if item is None:
                return
            b, views, stage, _ = item
            yield b.arrays, views, _releaser(self.pool, stage)

    def _next(self) -> Any:
        item = self.queue.get()
        if item is _DONE:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def items(self) -> Iterator[tuple[int, Region, np.ndarray, Callable[[], None]]]:
        """The writer's side, after :meth:`small_items`: each piece once its copy is complete, with the callback
        that frees its memory."""
        while True:
            item = self._next()
            if item is None:
                return
            w, buf, stage, event = item
            if event is not None:
                event.synchronize()
            yield w.array, w.region, buf, _releaser(self.pool, stage)


def _releaser(pool: StagingPool, stage: Stage) -> Callable[[], None]:
    def release() -> None:
        pool.release(stage)

    return release
