"""The pipelined asynchronous save, its staging pool, and monitoring."""

from __future__ import annotations

import collections
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import HANG

import pytreeckpt
from pytreeckpt import ChunkingOptions, ExecutorOptions, Mesh, Monitor, Shard, ShardedLeaf, ShardingSpec
from pytreeckpt.core._region import Region, split_aligned
from pytreeckpt.execute._staging import PoolAborted, StagingPool, staging_pool

MiB = 1 << 20


def _state(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(n)}  # 1 MiB each


class _CountingDeque(collections.deque):  # type: ignore[type-arg]
    """A deque that counts the passes made over it."""

    passes = 0

    def __iter__(self) -> Any:
        type(self).passes += 1
        return super().__iter__()


def test_acquiring_a_stage_does_not_walk_the_live_stages() -> None:
    """The pool summed every live stage's bytes at each acquire: async_save of 20,000 tiny leaves (every one
    live until written) blocked its caller 10 s against 0.7 s for save. Its use is kept as stages come and go."""
    pool = StagingPool()
    pool.reserve(1 << 20)
    pool._live = _CountingDeque()
    _CountingDeque.passes = 0
    stages = [pool.acquire(16) for _ in range(2_000)]
    assert _CountingDeque.passes == 0
    assert pool.peak_bytes == 2_000 * stages[1].start  # (each stage takes its aligned size)
    for stage in stages[:1_000]:
        pool.release(stage)
    more = pool.acquire(16)
    assert pool.peak_bytes == 2_000 * stages[1].start  # the live bytes went down: no new peak
    pool.release(more)
    for stage in stages[1_000:]:
        pool.release(stage)
    assert pool.acquire(16).start in (0, more.stop)  # (all released: the ring starts again)
    pool.free()


class _TellingCondition(threading.Condition):
    """A condition that says when a thread waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_the_ring_reuses_the_oldest_space_and_waits_when_full() -> None:
    pool = StagingPool()
    pool._cond = cond = _TellingCondition()
    pool.reserve(4096)
    a, b, c = pool.acquire(1024), pool.acquire(1024), pool.acquire(2048)
    assert (a.start, b.start, c.start) == (0, 1024, 2048)
    pool.release(b)  # out of order: the oldest is still live, so no room yet
    got: list[int] = []

    def acquire() -> None:
        got.append(pool.acquire(1024).start)
        cond.waiting.set()  # (also if it returned at once)

    t = threading.Thread(target=acquire)
    t.start()
    assert cond.waiting.wait(HANG)
    assert got == []  # the acquire waits for room
    pool.release(a)  # a and b free: the ring wraps to the start
    t.join(HANG)
    assert not t.is_alive()
    assert got == [0]
    pool.abort()
    with pytest.raises(PoolAborted):
        pool.acquire(64)
    pool.free()
    assert pool.capacity == 0


def test_split_aligned_cuts_on_chunk_boundaries_within_the_bound() -> None:
    region = Region((4, 0), (40, 30))
    parts = split_aligned(region, (4, 10), 4, 4 * 10 * 4 * 2)  # two chunks per piece
    assert sum(p.size for p in parts) == region.size
    for p in parts:
        assert p.size * 4 <= 320
        assert p.offset[0] % 4 == 0
        assert p.offset[1] % 10 == 0
    # pieces tile the region without overlap
    seen = torch.zeros(44, 30, dtype=torch.int32)
    for p in parts:
        seen[p.slices()] += 1
    assert (seen[4:44] == 1).all()
    assert (seen[:4] == 0).all()


def test_a_state_larger_than_the_pool_saves_with_the_pool_bounded(tmp_path: Path) -> None:
    state = _state(6)  # 6 MiB
    opts = ExecutorOptions(staging_bytes=2 * MiB, staging_piece_bytes=MiB // 2, keep_staging=False)
    chunking = ChunkingOptions(single_chunk_bytes=MiB // 4, max_chunk_bytes=MiB // 4)
    reserved: list[int] = []
    pool = staging_pool()
    original = pool.reserve

    def spy(capacity: int, *, pin: bool = False, huge: bool = True) -> None:
        reserved.append(capacity)
        original(capacity, pin=pin, huge=huge)

    pool.reserve = spy  # type: ignore[method-assign]
    try:
        h = pytreeckpt.async_save(tmp_path / "c", state, executor=opts, chunking=chunking)
        for v in state.values():
            v.zero_()  # training goes on
        h.wait()
        peak = pool.peak_bytes
    finally:
        del pool.reserve
    assert reserved == [2 * MiB]
    assert 0 < peak <= 2 * MiB
    assert pool.capacity == 0  # keep_staging=False frees it
    loaded = pytreeckpt.load(tmp_path / "c")
    expected = _state(6)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_the_pool_is_kept_and_reused_between_saves(tmp_path: Path) -> None:
    state = _state(2)
    pytreeckpt.async_save(tmp_path / "a", state).wait()
    arena = staging_pool()._arena
    assert arena is not None
    assert staging_pool().capacity == 2 * MiB + 2 * 4096  # (each piece of a MiB may start a page further)
    assert arena.data_ptr() % 4096 == 0
    pytreeckpt.async_save(tmp_path / "b", state).wait()
    assert staging_pool()._arena is arena  # the same memory, its pages already mapped
    assert torch.equal(pytreeckpt.load(tmp_path / "b")["w1"], state["w1"])


def test_sharded_leaves_with_merged_chunks_snapshot_through_the_pool(tmp_path: Path) -> None:
    w = torch.arange(30 * 7, dtype=torch.float64).reshape(30, 7)
    leaf = ShardedLeaf.from_global(w, ShardingSpec(Mesh(4), [Shard(0)]))  # 8,8,8,6 rows
    chunking = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=10**9, max_chunk_bytes=5 * 7 * 8)
    h = pytreeckpt.async_save(tmp_path / "c", {"w": leaf}, chunking=chunking, executor=ExecutorOptions(staging_bytes=1))
    for s in leaf.shards.values():
        s.fill_(-1)
    h.wait()
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["w"], w)


def test_a_copy_that_fails_raises_from_async_save_and_commits_nothing(tmp_path: Path) -> None:
    class Boom(RuntimeError):
        pass

    from pytreeckpt.execute import _pipeline

    original = _pipeline.copy_into
    calls = [0]

    def failing(dst, src):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            raise Boom("the copy failed")
        original(dst, src)

    _pipeline.copy_into = failing  # type: ignore[assignment]
    try:
        with pytest.raises(Boom):
            pytreeckpt.async_save(tmp_path / "c", _state(4), executor=ExecutorOptions(staging_piece_bytes=MiB))
    finally:
        _pipeline.copy_into = original
    with pytest.raises(pytreeckpt.NotCommittedError):
        pytreeckpt.load(tmp_path / "c")
    assert staging_pool().capacity == 0  # released after the failure
    pytreeckpt.save(tmp_path / "c", _state(1))  # the next save is not blocked by it


def test_monitor_records_every_phase_with_bytes(tmp_path: Path) -> None:
    state = _state(3)
    m = Monitor()
    h = pytreeckpt.async_save(tmp_path / "c", state, monitor=m)
    h.wait()
    assert set(h.timings) == {"plan", "snapshot", "write", "commit"}
    pytreeckpt.load(tmp_path / "c", monitor=m)
    summary = m.summary()[0]
    assert summary["snapshot"]["bytes"] == 3 * MiB
    assert summary["write"]["bytes"] == 3 * MiB
    assert summary["read"]["bytes"] == 3 * MiB
    assert {"plan", "commit"} <= set(summary)
    assert all(s.end >= s.start for s in m.spans)
    assert {s.op for s in m.spans} == {"save", "load"}
    report = m.report()
    assert "snapshot" in report
    assert "read" in report
    trace_file = tmp_path / "trace.json"
    m.write_chrome_trace(trace_file)
    trace = json.loads(trace_file.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in complete} >= {"plan", "snapshot", "write", "commit", "read"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "pytreeckpt-save" in threads  # the write runs behind the caller


def test_progress_bar_and_debug_logging(tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    with caplog.at_level(logging.DEBUG, logger="pytreeckpt"):
        pytreeckpt.save(tmp_path / "c", _state(2), executor=ExecutorOptions(progress=True))
        pytreeckpt.load(tmp_path / "c", executor=ExecutorOptions(progress=True))
    err = capsys.readouterr().err
    assert "save [" in err
    assert "load [" in err
    assert "100%" in err
    assert any("write" in r.getMessage() for r in caplog.records)


def test_many_small_leaves_are_staged_in_a_few_pieces_and_saved_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """async_save staged each of 20,000 tiny leaves as a piece of its own (~30 us each, planned and copied):
    the caller waited 0.8-0.9 s where save took 0.2 s. Small whole arrays are copied in batches of
    ``staging_piece_bytes``, written as save writes them; the snapshot holds the tree of the call."""
    acquired: list[int] = []
    acquire = StagingPool.acquire

    def counting(self: StagingPool, nbytes: int) -> Any:
        acquired.append(nbytes)
        return acquire(self, nbytes)

    monkeypatch.setattr(StagingPool, "acquire", counting)
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {f"p{i}": torch.randn(4, generator=g) for i in range(2_000)}
    state["bf16"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    state["ints"] = torch.arange(7, dtype=torch.int64)
    state["flag"] = torch.tensor(True)
    state["strided"] = torch.randn(6, 4, generator=g).t()
    state["big"] = torch.randn(256, 1024, generator=g)  # 1 MiB: through the pipeline's pieces
    expected = {k: v.clone() for k, v in state.items()}
    h = pytreeckpt.async_save(tmp_path / "c", state, executor=ExecutorOptions(staging_piece_bytes=8 << 10))
    for v in state.values():
        v.zero_()  # training goes on: the checkpoint holds the state of the call
    h.wait()
    # 2,004 small arrays of at most 16 bytes aligned: 4 batches of 8 KiB; the big array in its pieces (128)
    assert len(acquired) <= 4 + 128 + 1, len(acquired)
    out = pytreeckpt.load(tmp_path / "c")
    assert out.keys() == expected.keys()
    for k, v in expected.items():
        assert out[k].dtype == v.dtype, k
        assert torch.equal(out[k], v), k
    pytreeckpt.verify(tmp_path / "c")
