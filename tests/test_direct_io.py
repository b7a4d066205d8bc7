"""Chunk files written around the page cache (``ExecutorOptions.direct_io``, ``O_DIRECT``).

The files are the ones the buffered path writes; a file system that refuses ``O_DIRECT``
(at open, or at the first write) gets them through the page cache; saves and loads of
real states are unchanged, synchronous and asynchronous.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pytreeckpt
from pytreeckpt.storage import _chunkfiles as chunkfiles
from pytreeckpt.storage._chunkfiles import DIRECT_MIN_BYTES, read_chunk, write_chunk

needs_direct = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this platform")

MiB = 1 << 20


def _cases() -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(array shape, chunk shape) of float32 chunks: a whole number of blocks, a tail, several bounce
    buffers, an edge chunk padded with zeros, and one under the threshold."""
    return [
        ((MiB // 4,), (MiB // 4,)),
        ((MiB // 4 + 100,), (MiB // 4 + 100,)),
        ((3 * MiB // 4 * 2 + 7,), (3 * MiB // 4 * 2 + 7,)),
        ((1000, 700), (600, 700)),
        ((100,), (100,)),
    ]


@needs_direct
@pytest.mark.parametrize(("shape", "chunk"), _cases())
def test_a_direct_chunk_file_is_the_buffered_one(tmp_path: Path, shape: Any, chunk: Any) -> None:
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    box = tuple(slice(0, min(n, c)) for n, c in zip(shape, chunk, strict=True))
    plain, direct = tmp_path / "plain", tmp_path / "direct"
    crc = write_chunk(plain, data[box], chunk, fsync=True)
    calls = []
    real = chunkfiles._pwrite_direct

    def spy(*a: Any) -> bool:
        calls.append(a[2])
        return real(*a)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(chunkfiles, "_pwrite_direct", spy)
        assert write_chunk(direct, data[box], chunk, fsync=True, direct=True) == crc
    assert direct.read_bytes() == plain.read_bytes()
    nbytes = int(np.prod(chunk)) * 4
    assert bool(calls) == (nbytes >= DIRECT_MIN_BYTES)  # (small chunk files stay buffered)
    out = np.zeros([b.stop for b in box], dtype=np.float32)
    read_chunk(direct, chunk, out.shape, [(tuple(slice(None) for _ in out.shape), out)], "chunk", expected=crc)
    assert np.array_equal(out, data[box])


@needs_direct
@pytest.mark.parametrize("extra", [0, 100, 4 * MiB + 5])
def test_page_aligned_memory_is_written_straight_from_itself(tmp_path: Path, extra: int) -> None:
    """An asynchronous save's staging memory starts on a page: its whole blocks go to the device from there, in
    one write, not through the bounce buffer (a copy of every byte); the file is the buffered one."""
    n = 3 * MiB // 4 + extra // 4  # float32 elements
    memory = mmap.mmap(-1, n * 4)
    data = np.frombuffer(memory, dtype=np.float32)
    data[:] = np.random.default_rng(1).standard_normal(n)
    assert data.ctypes.data % 4096 == 0
    plain, direct = tmp_path / "plain", tmp_path / "direct"
    crc = write_chunk(plain, data, (n + 3,), fsync=True)  # (3 elements of padding)
    calls = []
    real = chunkfiles._pwrite_direct

    def spy(fd: int, block: np.ndarray, offset: int) -> bool:
        calls.append((block.ctypes.data, block.nbytes, offset))
        return real(fd, block, offset)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(chunkfiles, "_pwrite_direct", spy)
        assert write_chunk(direct, data, (n + 3,), fsync=True, direct=True) == crc
    assert direct.read_bytes() == plain.read_bytes()
    whole = n * 4 // 4096 * 4096
    assert calls[0] == (data.ctypes.data, whole, 0)  # (then at most the last block, through the bounce buffer)
    assert len(calls) <= 2
    assert all(offset >= whole for _, _, offset in calls[1:])


@needs_direct
@pytest.mark.parametrize("where", ["open", "first write"])
def test_a_file_system_refusing_direct_io_gets_the_file_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    data = np.arange(MiB, dtype=np.float32)
    real_open, real_pwrite = os.open, os.pwrite
    refused = []

    def open_(path: Any, flags: int, *a: Any) -> int:
        if where == "open" and flags & os.O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if where == "first write" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(chunkfiles.os, "open", open_)
    monkeypatch.setattr(chunkfiles.os, "pwrite", pwrite)
    crc = write_chunk(tmp_path / "c", data, data.shape, fsync=True, direct=True)
    assert refused  # (the direct way was tried, and refused)
    monkeypatch.undo()
    write_chunk(tmp_path / "plain", data, data.shape, fsync=True)
    assert (tmp_path / "c").read_bytes() == (tmp_path / "plain").read_bytes()
    assert crc == int.from_bytes((tmp_path / "plain").read_bytes()[-4:], "little")


@needs_direct
def test_an_error_after_the_first_direct_write_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Only a refusal of the first write falls back: a later failure, such as a full disk, is the save's.)"""
    data = np.arange(3 * MiB, dtype=np.float32)
    real_pwrite = os.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if offset > 0 and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(chunkfiles.os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space"):
        write_chunk(tmp_path / "c", data, data.shape, fsync=True, direct=True)


@needs_direct
def test_a_short_direct_write_is_finished_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.random.default_rng(1).standard_normal(3 * MiB // 4 + 5).astype(np.float32)
    real_pwrite = os.pwrite
    shortened = []

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if not shortened and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            shortened.append(offset)
            return int(real_pwrite(fd, memoryview(data)[: 3 * 4096], offset))
        return int(real_pwrite(fd, data, offset))

    monkeypatch.setattr(chunkfiles.os, "pwrite", pwrite)
    write_chunk(tmp_path / "c", data, data.shape, fsync=True, direct=True)
    monkeypatch.undo()
    write_chunk(tmp_path / "plain", data, data.shape, fsync=True)
    assert shortened
    assert (tmp_path / "c").read_bytes() == (tmp_path / "plain").read_bytes()


@needs_direct
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_on_tmpfs() -> None:
    """Another real file system (tmpfs: without O_DIRECT before Linux 6.6): the save and load are as anywhere."""
    state = {"w": torch.randn(512, 1024), "b": torch.randn(10)}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        pytreeckpt.save(Path(d) / "ckpt", state, executor=pytreeckpt.ExecutorOptions(direct_io=True))
        got = pytreeckpt.load(Path(d) / "ckpt")
        assert torch.equal(got["w"], state["w"])
        assert torch.equal(got["b"], state["b"])
        assert pytreeckpt.verify(Path(d) / "ckpt").problems == ()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_saves_with_and_without_direct_io_load_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool, how: str
) -> None:
    calls = []
    real = chunkfiles._write_direct
    monkeypatch.setattr(chunkfiles, "_write_direct", lambda *a: calls.append(a[0]) or real(*a))
    g = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(1024, 1024 + 3, generator=g),  # chunk files of MiBs, with tails
        "half": torch.randn(700, 900, generator=g).to(torch.bfloat16),
        "small": torch.randn(10, generator=g),
        "step": 7,
    }
    options = pytreeckpt.ExecutorOptions(direct_io=direct)
    chunking = pytreeckpt.ChunkingOptions(max_chunk_bytes=2 * MiB)  # (several chunk files per big array)
    if how == "save":
        pytreeckpt.save(tmp_path / "c", state, executor=options, chunking=chunking)
    else:
        pytreeckpt.async_save(tmp_path / "c", state, executor=options, chunking=chunking).wait()
    assert bool(calls) == (direct and bool(getattr(os, "O_DIRECT", 0)))
    got = pytreeckpt.load(tmp_path / "c")
    for k in ("big", "half", "small"):
        assert torch.equal(got[k], state[k]), k
    assert got["step"] == 7
    assert pytreeckpt.verify(tmp_path / "c").problems == ()


def _evict(path: Path) -> None:
    """Drop every chunk file below ``path`` from the page cache (its pages are clean: no root needed)."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@needs_direct
def test_a_cold_load_into_new_memory_reads_around_the_page_cache_and_a_warm_one_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 item 3: a cold load into new memory filled the page cache and the memory (twice the fresh pages;
    4 GiB took 7.4 s against fio's 2.7 s). Chunk files the cache holds none of are read around it with O_DIRECT,
    straight into new memory (which starts on a page); cached files, and a caller's tensors (which start off a
    page), through the cache. The bytes are checked the same way: a damaged chunk is caught, read around the
    cache into new memory and through it in place."""
    if chunkfiles._syscall() is None:
        pytest.skip("this kernel has no cachestat (Linux 6.5 and later)")
    g = torch.Generator().manual_seed(2)
    state = {
        "w": torch.randn(1024, 1024, generator=g),  # chunks of 2 MiB: each starts on a page of new memory
        "t": torch.randn(1024, 1027, generator=g),  # chunks of 510 rows: the second starts off a page
        "b": torch.randn(1024, 1024, generator=g).to(torch.bfloat16),
    }
    path = tmp_path / "c"
    pytreeckpt.save(path, state, chunking=pytreeckpt.ChunkingOptions(max_chunk_bytes=2 * MiB))
    reads: list[tuple[bool, int, int]] = []  # (on a page, bytes, bytes read around the cache)
    real = chunkfiles._read_direct

    def spy(fd: int, head: np.ndarray) -> tuple[int, int]:
        got = real(fd, head)
        reads.append((head.ctypes.data % 4096 == 0, head.nbytes, got[0]))
        return got

    monkeypatch.setattr(chunkfiles, "_read_direct", spy)
    from pytreeckpt.execute import _memory

    advised: list[int] = []
    advise = _memory.advise_huge_pages
    monkeypatch.setattr(_memory, "advise_huge_pages", lambda a, n: advised.append(n) or advise(a, n))
    _evict(path)
    got = pytreeckpt.load(path)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert advised == []  # (cold: the reads fault the new pages in, 4 KiB at a time, cheaper than huge pages)
    assert all(t.data_ptr() % 4096 == 0 for t in got.values())  # (new memory of a MiB or more starts on a page)
    assert sum(aligned for aligned, _, _ in reads) == 4  # (w: 2 chunks, t: its first, b: 1)
    # chunk files of a MiB or more into memory on a page around the cache; "t"'s second (off a page) and its
    # small edge through it
    assert all(done == (nbytes // 4096 * 4096 if aligned else 0) for aligned, nbytes, done in reads), reads
    reads.clear()
    for f in path.rglob("*"):  # (the cache holds them: read by another program)
        if f.is_file():
            f.read_bytes()
    got = pytreeckpt.load(path)
    assert reads
    assert all(done == 0 for _, _, done in reads)  # warm: every chunk from the cache
    assert len(advised) == 3  # (into huge pages, faulted in beside the reads)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    reads.clear()
    _evict(path)
    target = {k: _off_page(v) for k, v in state.items()}  # (a caller's tensors start 64 bytes into a page, as
    # torch's own do when the allocator maps them anew; made so here, whatever memory the allocator reuses)
    assert all(t.data_ptr() % 4096 == 64 for t in target.values())
    pytreeckpt.load(path, target, inplace=True)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert reads
    assert all(not aligned and done == 0 for aligned, _, done in reads), reads  # (off a page: the cache)
    # A byte of a chunk changed on disk, read around the cache: its checksum says so.
    chunk = next(f for f in sorted((path / "arrays" / "w").rglob("*")) if f.is_file() and f.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[12345] ^= 0x40
    chunk.write_bytes(bytes(data))
    os.sync()
    _evict(path)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*damaged.*fails its checksum"):
        pytreeckpt.load(path)
    _evict(path)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*damaged.*fails its checksum"):
        pytreeckpt.load(path, target, inplace=True)


def _off_page(like: torch.Tensor) -> torch.Tensor:
    """Zeros of ``like``'s shape and dtype in memory that starts 64 bytes into a page."""
    nbytes = like.numel() * like.element_size()
    buf = torch.zeros(nbytes + 8192, dtype=torch.uint8)
    start = (64 - buf.data_ptr()) % 4096
    return buf[start : start + nbytes].view(like.dtype).view(like.shape)


@needs_direct
@pytest.mark.parametrize("offset", [0, 64, 4096 + 512], ids=["on a page", "64 bytes into a page", "512-aligned"])
def test_a_cold_chunk_is_read_around_the_cache_in_pieces_into_memory_on_a_page_and_through_it_elsewhere(
    tmp_path: Path, offset: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk file of many direct-read pieces and a tail shorter than a block, read cold into memory that starts
    on a page (a load's own) or off one (a caller's tensor): the bytes are the file's and its crc32c is checked.
    On a page, the page cache holds none of its whole blocks afterwards (they went around it); off a page, all
    of them (through it: O_DIRECT cannot fill such memory, and a buffer and a copy were slower)."""
    fn = chunkfiles._syscall()
    if fn is None:
        pytest.skip("this kernel has no cachestat (Linux 6.5 and later)")
    monkeypatch.setattr(chunkfiles, "_DIRECT_READ", 64 << 10)  # (many pieces in a small file)
    data = np.random.default_rng(4).standard_normal(MiB // 4 * 3 + 333).astype(np.float32)
    path = tmp_path / "chunk"
    crc = write_chunk(path, data, data.shape, fsync=True)
    _evict(tmp_path)
    memory = mmap.mmap(-1, data.nbytes + offset, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    out = np.frombuffer(memory, dtype=np.uint8)[offset:].view(np.float32)
    read_chunk(path, data.shape, data.shape, [((slice(0, data.size),), out)], "chunk", expected=crc, direct=True)
    assert np.array_equal(out, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        cached = chunkfiles._pages_cached(fn, fd, data.nbytes // 4096 * 4096)
        assert cached == (0 if offset == 0 else data.nbytes // 4096), cached
    finally:
        os.close(fd)
    wrong = crc ^ 1
    _evict(tmp_path)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"chunk is not the chunk the metadata records"):
        read_chunk(path, data.shape, data.shape, [((slice(0, data.size),), out)], "chunk", expected=wrong, direct=True)


@needs_direct
def test_a_direct_read_of_a_file_cut_short_is_an_error_not_a_short_tensor(tmp_path: Path) -> None:
    if chunkfiles._syscall() is None:
        pytest.skip("this kernel has no cachestat (Linux 6.5 and later)")
    data = np.random.default_rng(3).standard_normal(MiB // 2).astype(np.float32)  # 2 MiB
    path = tmp_path / "chunk"
    crc = write_chunk(path, data, data.shape, fsync=True, direct=True)
    with open(path, "r+b") as f:
        f.truncate(MiB + 100)
    _evict(tmp_path)
    out = np.frombuffer(mmap.mmap(-1, data.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.float32)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"holds 1048676 bytes, expected 2097156"):
        read_chunk(path, data.shape, data.shape, [((slice(None),), out)], "chunk", expected=crc, direct=True)


@needs_direct
def test_an_asynchronous_save_writes_each_chunk_straight_from_its_staging_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 item 4: the staging memory started 64 bytes into a page, so every byte an asynchronous save wrote
    around the page cache was copied once more, into the bounce buffer. Its pieces of a MiB or more now start
    on a page: each chunk file goes out in one write from there. A blocking save of a tensor (64 bytes into a
    page) still writes through the bounce buffer, 2 MiB at a time."""
    sizes: list[int] = []
    real = chunkfiles._pwrite_direct

    def spy(fd: int, block: np.ndarray, offset: int) -> bool:
        sizes.append(block.nbytes)
        return real(fd, block, offset)

    monkeypatch.setattr(chunkfiles, "_pwrite_direct", spy)
    g = torch.Generator().manual_seed(4)
    state = {"small": torch.randn(100, generator=g), "w": torch.randn(2048, 1024, generator=g)}  # 8 MiB
    chunking = pytreeckpt.ChunkingOptions(max_chunk_bytes=4 * MiB)
    pytreeckpt.async_save(tmp_path / "a", state, chunking=chunking).wait()
    assert sizes == [4 * MiB, 4 * MiB]
    sizes.clear()
    pytreeckpt.save(tmp_path / "s", state, chunking=chunking)
    assert sizes == [2 * MiB] * 4
    for name in ("a", "s"):
        got = pytreeckpt.load(tmp_path / name)
        assert all(torch.equal(got[k], v) for k, v in state.items())
