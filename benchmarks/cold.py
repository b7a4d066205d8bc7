"""Durable saves and cold loads against the disk's write and read limits (issues 19 and 44), in one run.

    python -m benchmarks.cold [--gib 1 4] [--leaves 16] [--repeat 3] [--jobs 4] [--ranks 4]

For each size: the state saved once, then, in turns (a new order each round), medians of ``--repeat`` of
every way to write the same bytes and of ``pytreeckpt.save`` (the last output removed, ``sync`` run and the
page cache dropped before each), then of every way to read them and of the loads (the page cache dropped
before each).

Writes, each durable when it ends (the checkpoint's durability: nothing the commit names is lost on power
failure):

- ``fio`` in ``--jobs`` jobs (psync, 4 MiB blocks, ``--end_fsync=1``) writing new files as large as the
  checkpoint's chunk files (each job a share of them, one after another), and ``--jobs`` large files of a
  share of the bytes each; buffered and ``--direct=1``. Each is timed by fio's own runtime (its JSON's
  ``write.runtime``, the final fsync included), not from outside with the process's start-up.
- 16 threads writing files as large as the chunk files with ``O_DIRECT`` (each a share of them, one after
  another), 256 KiB at a time from one buffer each, each file fsynced, then the directory
  (``16 threads direct 256 KiB write``; on this machine often faster than fio's 4 MiB blocks).
- a single-threaded raw write of the state's tensors (a file each, ``write`` then ``fsync``): the baseline.
- ``pytreeckpt.save``, timed until it returns (its commit durable).

Reads:

- ``fio`` in ``--jobs`` jobs (psync, 4 MiB blocks) over the checkpoint's own chunk files (each
  job a share of them, one after another), buffered and ``--direct=1``; and over ``--jobs``
  large files of a share of the bytes each (laid out once by fio itself, fsynced), buffered
  and direct, each timed by fio's own runtime; fio must have read every byte.
- a single-threaded raw read of the chunk files (``read()`` of 16 MiB, timed in this process):
  the baseline.
- 16 threads reading the chunk files with ``O_DIRECT``, one read per file as a load does, into memory each
  thread faulted in once (``16 threads direct``, like fio's jobs; on this machine often faster than they
  are), and the same into new memory for each file (``16 threads direct into new memory``: not a limit, the
  cost of new memory a load into new tensors pays; on this virtual machine about 1 CPU-second per GiB).
- the same 16 threads reading each file 256 KiB at a time into one buffer of their own (``16 threads direct
  256 KiB``): on this virtual machine the device fills a few small buffers used again and again much faster
  than large ones (1 GiB in 0.50 s against 0.78 s), and it is the fastest way here.
- the same 16 threads reading the chunk files into the memory of the tensors the in-place load fills
  (faulted in, 64 bytes into a page as torch's are), through the page cache and with ``O_DIRECT`` 256 KiB at a
  time into a buffer of their own then copied (``16 threads ... into the load's tensors``, :func:`tensor_ways`;
  at several ranks each rank its share into its own tensors). Not limits: the fastest of them
  (``tensors_by``) is what reading into that memory costs, and ``inplace_of_tensors`` the in-place load's rate
  as a fraction of its. On this virtual machine the same direct reads ran up to twice as fast into some
  buffers as into others, so a limit, the fastest of several ways with buffers of their own, may read into
  faster memory than a load is given.
- ``pytreeckpt.load`` (functional; also with ``ExecutorOptions(huge_pages=False)``, its new
  memory in 4 KiB pages) and ``pytreeckpt.load(..., inplace=True)``.

Each limit is the fastest of those ways (``limit_by``, ``write_limit_by``), and each load's or save's rate is
given as a fraction of it (``of_limit``, ``save_of_limit``; ``of_fio`` is ``of_limit``'s old name). Issue 44
found the old read limit, fio's 4 jobs walking 16 MiB files timed from outside, slower than one thread's
``read()`` of the same files: :func:`sound_limit` refuses a limit slower than the single-threaded baseline (a
RuntimeError: no rate is set against a limit that is none).

With ``--ranks N`` (N > 1) the same is done by N gloo ranks, each holding a ``Shard(0)`` row block of
every matrix (a DTensor): the state is saved by the N ranks, and each load is every rank loading its own
share, each timed between barriers (the slowest rank's time). The ways to write and read the bytes run on
rank 0 alone, between the same barriers, over every rank's bytes (the write baseline: rank 0's tensors
written N times), and on every rank over its own share of the files, 16 / N threads each, 256 KiB at a
time and (reads) one read per file (``each of N ranks ... threads direct ...``, :func:`share_names`): on
some sittings of the development machine the ranks drive the disk faster that way than rank 0 does alone,
and a limit is the fastest way. Needs root (to drop the page cache) and fio (Debian's package ``fio``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pytreeckpt

from ._common import GiB, can_drop_caches, drop_caches, free_port, fsync_dir, gloo_rank, make_state

T = TypeVar("T")


def _fio_seconds(cmd: list[str], nbytes: int, rw: str = "read") -> float:
    """Run fio (``--group_reporting``, JSON) and return its own runtime in seconds: the group's ``read.runtime``
    (``write.runtime`` with ``rw="write"``; from the first I/O to the last, a final fsync included), not the
    process's, for ``nbytes`` bytes. With ``--direct=1`` fio reads whole blocks only (a chunk file's last 4 bytes,
    its crc32c, are left): its time is scaled to ``nbytes`` (its rate). RuntimeError if it moved less than half of
    them, or more."""
    # (global options before the first job's --name: after it they would be that job's alone, and fio would report
    # a group of some jobs only)
    done = subprocess.run(
        [cmd[0], "--output-format=json", "--group_reporting", *cmd[1:]], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"fio failed: {done.stderr[-2000:]}")
    text = done.stdout[done.stdout.index("{") :]  # (fio may print notes before its JSON)
    read = json.loads(text)["jobs"][0][rw]
    got = int(read["io_bytes"])
    if not nbytes / 2 <= got <= nbytes:
        raise RuntimeError(f"fio moved {got} bytes, expected {nbytes}: {' '.join(cmd)}")
    # (milliseconds: at least one, so the rate of a tiny read is finite)
    return max(float(read["runtime"]), 1.0) / 1000 * nbytes / got


def _fio(root: Path, files: list[Path], jobs: int, direct: bool = False) -> float:
    """fio reading ``files`` (under ``root``) in ``jobs`` jobs, each a share of the files, one after another;
    its own runtime in seconds."""
    groups = [files[k::jobs] for k in range(jobs)]
    sizes = [f.stat().st_size for f in files]
    bs = 4 << 20
    if min(sizes) < bs:  # (fio reads whole blocks of each file: smaller ones for small files, as in a test)
        bs = max(4096, 1 << (min(sizes).bit_length() - 1))
    # Paths relative to the directory given: fio caps the length of an option's value.
    cmd = ["fio", f"--directory={root}", "--rw=read", f"--bs={bs}", "--ioengine=psync", f"--direct={int(direct)}"]
    for k, group in enumerate(g for g in groups if g):
        names = ":".join(str(f.relative_to(root)).replace(":", "\\:") for f in group)
        cmd += [f"--name=j{k}", f"--filename={names}", "--file_service_type=sequential"]
    return _fio_seconds(cmd, sum(sizes))


def _large_files_cmd(where: Path, nbytes: int, jobs: int) -> list[str]:
    """fio's options for ``jobs`` jobs, each on a file of its own of ``nbytes / jobs`` (rounded to 4 MiB blocks)."""
    per = max(4 << 20, nbytes // jobs // (4 << 20) * (4 << 20))
    return ["fio", "--name=large", f"--directory={where}", f"--numjobs={jobs}", f"--size={per}", "--bs=4M"]


def lay_out_large(where: Path, nbytes: int, jobs: int) -> int:
    """Write the large files of :func:`_fio_large` (fio's own data, fsynced at the end); returns their bytes."""
    where.mkdir(parents=True, exist_ok=True)
    cmd = [*_large_files_cmd(where, nbytes, jobs), "--rw=write", "--ioengine=psync", "--end_fsync=1"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed laying out its files: {done.stderr[-2000:]}")
    return sum(p.stat().st_size for p in where.iterdir())


def _fio_large(where: Path, nbytes: int, jobs: int, direct: bool = False) -> float:
    """fio reading the large files laid out by :func:`lay_out_large`, a job each; its own runtime in seconds."""
    cmd = [*_large_files_cmd(where, nbytes, jobs), "--rw=read", "--ioengine=psync", f"--direct={int(direct)}"]
    return _fio_seconds(cmd, sum(p.stat().st_size for p in where.iterdir()))


def _raw(files: list[Path]) -> None:
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


BASELINE = "raw read (1 thread)"
DIRECT = "16 threads direct"
NEW_MEMORY = "16 threads direct into new memory"
DIRECT_SMALL = "16 threads direct 256 KiB"
WRITE_SMALL = "16 threads direct 256 KiB write"
_PIECE = 256 << 10
_THREADS = 16


def _groups(items: list[T], threads: int = _THREADS) -> list[list[T]]:
    """``items`` dealt to ``threads`` threads (none empty)."""
    return [g for g in (items[k::threads] for k in range(threads)) if g]


def _private(nbytes: int) -> mmap.mmap:
    """``nbytes`` of new private anonymous memory, page-aligned, as a process's new tensors are (no page faulted)."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _read_direct(files: list[Path], buffer: mmap.mmap | None, piece: int = 0) -> None:
    """Each file's whole 4 KiB blocks in one ``O_DIRECT`` read, one after another, into ``buffer`` (memory faulted in
    before, reused as fio's jobs reuse theirs) or into new memory for each (None); with ``piece``, ``piece`` bytes at
    a time into the start of ``buffer``."""
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            whole = os.fstat(fd).st_size // 4096 * 4096
            memory = _private(whole) if buffer is None else buffer
            view = memoryview(memory)[:whole]
            done = 0
            while done < whole:
                n = os.preadv(fd, [view[: min(piece, whole - done)] if piece else view[done:]], done)
                if n <= 0:
                    raise RuntimeError(f"{path}: short direct read at {done} of {whole} bytes")
                done += n
            view.release()
            if buffer is None:
                memory.close()
        finally:
            os.close(fd)


def direct_ways(files: list[Path], threads: int = _THREADS) -> dict[str, Callable[[], Any]]:
    """The chunk files read with ``O_DIRECT`` by 16 threads (a share of the files each): one read per file into
    memory each thread faulted in once (:data:`DIRECT`, a way to drive the disk like fio's, and a candidate for the
    limit), and into new memory for each file (:data:`NEW_MEMORY`, what new memory costs besides the disk: not a
    limit); and 256 KiB at a time into the start of that memory (:data:`DIRECT_SMALL`, a candidate). With
    ``threads``, that many threads instead of 16 (each rank's share at several ranks: :func:`share_ways`)."""
    groups = _groups(files, threads)
    largest = max(f.stat().st_size for f in files)
    buffers = [_private(largest) for _ in groups]
    for b in buffers:  # (faulted in now, outside the timing: each thread's own, as fio's jobs have)
        b.write(b"\1" * largest)

    def run(new: bool, piece: int = 0) -> None:
        with ThreadPoolExecutor(len(groups)) as pool:
            list(pool.map(_read_direct, groups, [None] * len(groups) if new else buffers, [piece] * len(groups)))

    return {DIRECT: lambda: run(False), NEW_MEMORY: lambda: run(True), DIRECT_SMALL: lambda: run(False, _PIECE)}


def _share_threads(world: int) -> int:
    """Each rank's threads in the :func:`share_names` ways: 16 in all at ``world`` ranks (one at least)."""
    return max(1, _THREADS // world)


def _each(world: int) -> str:
    """How the names of the ways every rank runs over its own share begin, at ``world`` ranks."""
    return f"each of {world} ranks {_share_threads(world)} threads"


def share_names(world: int) -> tuple[str, str, str]:
    """At ``world`` ranks, the names of the ways every rank drives the disk over its own share of the files (each
    with 16 / ``world`` threads, 16 in all): :data:`DIRECT`'s and :data:`DIRECT_SMALL`'s reads, and
    :data:`WRITE_SMALL`'s writes."""
    each = _each(world)
    return f"{each} direct", f"{each} direct 256 KiB", f"{each} direct 256 KiB write"


def share_ways(files: list[Path], rank: int, world: int) -> dict[str, Callable[[], Any]]:
    """This rank's part of the :func:`share_names` reads: its share of ``files`` (every ``world``-th), read as
    :func:`direct_ways` reads them with 16 / ``world`` threads. Every rank runs it between the same barriers (the
    slowest rank's time): on some sittings of the development machine the ranks drive the disk faster so than rank
    0's 16 threads alone (own shares' writes of 4 GiB in 2.2 s against 3.8 s)."""
    direct, small, _ = share_names(world)
    mine = files[rank::world]
    if not mine:  # (fewer files than ranks)
        return {direct: lambda: None, small: lambda: None}
    ways = direct_ways(mine, _share_threads(world))
    return {direct: ways[DIRECT], small: ways[DIRECT_SMALL]}


TENSORS = "into the load's tensors"
INTO_TENSORS = f"16 threads {TENSORS}"
INTO_TENSORS_DIRECT = f"16 threads direct 256 KiB {TENSORS}"


def _placed(files: list[Path], tensors: list[torch.Tensor]) -> list[tuple[Path, list[np.ndarray]]]:
    """Each file's whole 4 KiB blocks given the next bytes of the tensors' own memory (flat, one tensor after
    another; back to the first when they run out, where the files hold padding the tensors do not): the views
    that file's bytes land in, in order."""
    memory = [t.view(torch.uint8).reshape(-1).numpy() for t in tensors if t.numel()]
    total = sum(m.nbytes for m in memory)
    if total == 0:
        raise ValueError("no tensor memory to read into")
    out: list[tuple[Path, list[np.ndarray]]] = []
    at = 0  # (the offset in the tensors' bytes, flat)
    for path in files:
        left = path.stat().st_size // 4096 * 4096
        views: list[np.ndarray] = []
        while left:
            start = at % total
            k = 0
            while start >= memory[k].nbytes:
                start -= memory[k].nbytes
                k += 1
            n = min(left, memory[k].nbytes - start)
            views.append(memory[k][start : start + n])
            at, left = at + n, left - n
        out.append((path, views))
    return out


def _read_into(placed: list[tuple[Path, list[np.ndarray]]], buffer: mmap.mmap | None) -> None:
    """Each file's whole blocks read into its views: through the page cache (``buffer`` None), or with ``O_DIRECT``
    :data:`_PIECE` bytes at a time into ``buffer`` (page-aligned, faulted in) and copied from there (by numpy,
    which lets the GIL go, as the loads' copies do)."""
    piece = None if buffer is None else np.frombuffer(buffer, dtype=np.uint8)
    for path, views in placed:
        fd = os.open(path, os.O_RDONLY | (0 if buffer is None else os.O_DIRECT))
        try:
            done = 0
            for view in views:
                got = 0
                while got < view.nbytes:
                    if piece is None:
                        n = os.preadv(fd, [view[got:]], done + got)
                    else:
                        n = os.preadv(fd, [piece[: min(_PIECE, view.nbytes - got)]], done + got)
                        np.copyto(view[got : got + n], piece[:n])
                    if n <= 0:
                        raise RuntimeError(f"{path}: short read at {done + got}")
                    got += n
                done += got
        finally:
            os.close(fd)


def tensor_ways(
    files: list[Path], tensors: list[torch.Tensor], threads: int = _THREADS, names: tuple[str, str] | None = None
) -> dict[str, Callable[[], Any]]:
    """The chunk files' bytes read by ``threads`` threads (a share of the files each) into the memory of the
    tensors an in-place load fills (``tensors``, faulted in, starting 64 bytes into a page as torch's do): through
    the page cache (:data:`INTO_TENSORS`), and with ``O_DIRECT`` 256 KiB at a time into a buffer of each thread's
    own, then copied (:data:`INTO_TENSORS_DIRECT`). Neither is a limit: they show what reading into that memory
    costs, what an in-place load's rate is to be read beside (on the development machine the faster of them ran
    at 0.88-1.05 of the read limit in one run; there the same direct reads ran up to twice as fast into some
    buffers as into others, kept or new). ``names`` (the two ways' names) for each rank's share
    (:func:`share_tensor_ways`)."""
    cached, direct = names or (INTO_TENSORS, INTO_TENSORS_DIRECT)
    groups = _groups(_placed(files, tensors), threads)
    buffers = [_private(_PIECE) for _ in groups]
    for b in buffers:
        b.write(b"\1" * _PIECE)

    def run(around_cache: bool) -> None:
        with ThreadPoolExecutor(len(groups)) as pool:
            list(pool.map(_read_into, groups, buffers if around_cache else [None] * len(groups)))

    return {cached: lambda: run(False), direct: lambda: run(True)}


def share_tensor_ways(files: list[Path], tensors: list[torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """:func:`tensor_ways` on every rank: its share of ``files`` (every ``world``-th) into its own tensors, 16 /
    ``world`` threads each (not limits: see :func:`limit_ways`)."""
    names = f"{_each(world)} {TENSORS}", f"{_each(world)} direct 256 KiB {TENSORS}"
    mine = files[rank::world]
    if not mine:
        return {name: lambda: None for name in names}
    return tensor_ways(mine, tensors, _share_threads(world), names)


def read_ways(path: Path, files: list[Path], nbytes: int, jobs: int, workdir: Path) -> dict[str, Callable[[], Any]]:
    """Every way of reading the checkpoint's bytes: fio's (returning their own runtime), the single-threaded baseline
    and :func:`direct_ways` (timed from outside, in this process, as the loads are). The limit is the fastest of them
    but :data:`NEW_MEMORY` (see :func:`limit_ways`)."""
    large = workdir / "fio-large"
    lay_out_large(large, nbytes, jobs)
    return {
        f"fio {jobs} jobs": lambda: _fio(path / "arrays", files, jobs),
        f"fio {jobs} jobs direct": lambda: _fio(path / "arrays", files, jobs, direct=True),
        f"fio {jobs} jobs large files": lambda: _fio_large(large, nbytes, jobs),
        f"fio {jobs} jobs large files direct": lambda: _fio_large(large, nbytes, jobs, direct=True),
        BASELINE: lambda: _raw(files),
        **direct_ways(files),
    }


WRITE_BASELINE = "raw write (1 thread)"


def _fio_write(where: Path, sizes: list[int], jobs: int, direct: bool) -> float:
    """fio writing new files of ``sizes`` bytes (each rounded down to 4 KiB) in ``where`` (emptied first), in ``jobs``
    jobs, each a share of the files one after another, 4 MiB blocks (less for small files), an fsync of each job's
    files at its end (``--end_fsync``: durable as a save is); fio's own runtime in seconds."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    groups = [sizes[k::jobs] for k in range(jobs)]
    cmd = ["fio", f"--directory={where}", "--rw=write", "--ioengine=psync", f"--direct={int(direct)}", "--end_fsync=1"]
    total = 0
    for k, group in enumerate(g for g in groups if g):
        size = max(4096, min(group) // 4096 * 4096)  # (fio writes files of one size per job: the share's smallest)
        bs = min(4 << 20, 1 << (size.bit_length() - 1))
        cmd += [f"--name=w{k}", f"--nrfiles={len(group)}", f"--filesize={size}", f"--size={size * len(group)}"]
        cmd += [f"--bs={bs}", "--file_service_type=sequential"]
        total += size * len(group)
    seconds = _fio_seconds(cmd, total, "write")
    shutil.rmtree(where, ignore_errors=True)
    return seconds * sum(sizes) / total  # (its rate, over the bytes asked for)


def _write_small(where: Path, sizes: list[int]) -> float:
    """:data:`WRITE_SMALL`: :func:`_small_writes` by 16 threads, timed (``where`` emptied first and after); its
    seconds over the bytes asked for."""
    shutil.rmtree(where, ignore_errors=True)
    write = _small_writes(where, sizes)
    t0 = time.perf_counter()
    write()
    seconds = time.perf_counter() - t0
    shutil.rmtree(where, ignore_errors=True)
    return seconds * sum(sizes) / max(sum(n // 4096 * 4096 for n in sizes), 1)


def _small_writes(where: Path, sizes: list[int], threads: int = _THREADS) -> Callable[[], None]:
    """``threads`` threads writing new files of ``sizes`` bytes (each rounded down to 4 KiB) in ``where`` (made if
    missing) with ``O_DIRECT``, a share of them each, one after another, 256 KiB at a time from one buffer of their
    own (faulted in now), each file fsynced, then the directory."""
    whole = [n // 4096 * 4096 for n in sizes]
    groups = _groups(list(range(len(whole))), threads)
    buffers = [_private(_PIECE) for _ in groups]
    for b in buffers:
        b.write(b"\7" * _PIECE)

    def one(group: list[int], buffer: mmap.mmap) -> None:
        view = memoryview(buffer)
        for i in group:
            fd = os.open(where / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                done = 0
                while done < whole[i]:
                    done += os.pwrite(fd, view[: min(_PIECE, whole[i] - done)], done)
                os.fsync(fd)
            finally:
                os.close(fd)

    def run() -> None:
        where.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(len(groups)) as pool:
            list(pool.map(one, groups, buffers))
        fsync_dir(where)

    return run


def _raw_write(state: dict[str, Any], where: Path) -> None:
    """The state's tensors (a DTensor's local part) written by one thread, a file each, each fsynced, then the
    directory: a plain program's durable write of the same bytes."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    for k, v in state.items():
        local = v.to_local() if hasattr(v, "to_local") else v
        with open(where / k, "wb", buffering=0) as f:
            f.write(memoryview(local.contiguous().view(torch.uint8).numpy()))
            os.fsync(f.fileno())
    fsync_dir(where)


def write_ways(sizes: list[int], jobs: int, workdir: Path) -> dict[str, Callable[[], Any]]:
    """Every way of writing the checkpoint's bytes durably the write limit is the fastest of: fio's (their own
    runtime, a final fsync included) over files as large as the checkpoint's chunk files (``sizes``) and over
    ``jobs`` large files, buffered and direct, and :func:`_write_small`; the single-threaded baseline is
    :func:`_raw_write` (in the caller)."""
    where = workdir / "fio-write"
    nbytes = sum(sizes)
    large = [nbytes // jobs] * jobs
    return {
        f"fio {jobs} jobs write": lambda: _fio_write(where, sizes, jobs, direct=False),
        f"fio {jobs} jobs write direct": lambda: _fio_write(where, sizes, jobs, direct=True),
        f"fio {jobs} jobs write large files": lambda: _fio_write(where, large, jobs, direct=False),
        f"fio {jobs} jobs write large files direct": lambda: _fio_write(where, large, jobs, direct=True),
        WRITE_SMALL: lambda: _write_small(where, sizes),
    }


def limit_ways(ways: list[str]) -> list[str]:
    """The read ways a limit is the fastest of: all but the reads into new memory and into the load's tensors
    (which show what that memory costs)."""
    return [w for w in ways if w != NEW_MEMORY and not w.endswith(TENSORS)]


def sound_limit(
    seconds: dict[str, float], ways: list[str], baseline: str = BASELINE, what: str = "read"
) -> tuple[str, float]:
    """The ``what`` (read or write) limit: the fastest of ``ways`` (fio's, names in ``seconds``), with its seconds.

    Raises:
      RuntimeError: that limit is slower than the single-threaded ``baseline``'s time (issue 44: a
        "limit" slower than one thread's read loop is none, and no rate is set against it).
    """
    parallel = [w for w in ways if w != baseline]
    if not parallel or baseline not in seconds:
        raise RuntimeError(f"a {what} limit needs fio's ways and the single-threaded baseline {baseline!r}: {ways}")
    name = min(parallel, key=seconds.__getitem__)
    if seconds[name] > seconds[baseline]:
        raise RuntimeError(
            f"no sound {what} limit: the fastest way, {name!r}, took {seconds[name]:.3f} s, slower than the "
            f"single-threaded {baseline!r}'s {seconds[baseline]:.3f} s"
        )
    return name, seconds[name]


_SMALL_PAGES = pytreeckpt.ExecutorOptions(huge_pages=False)  # new memory as before huge pages were asked for


def _chunk_files(path: Path) -> list[Path]:
    return sorted(p for p in (path / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")


def _summary(
    times: dict[str, list[float]], ways: list[str], nbytes: int, writes: list[str] | None = None
) -> dict[str, Any]:
    """Medians, the read limit and each load's rate as a fraction of it (``of_limit``); with ``writes`` (the write
    ways, the baseline among them), the write limit and each save's fraction of it (``save_of_limit``)."""
    seconds = {k: statistics.median(v) for k, v in times.items()}
    name, limit = sound_limit(seconds, limit_ways(ways))
    of_limit = {k: limit / s for k, s in seconds.items() if k not in (writes or []) and k != "pytreeckpt.save"}
    out = {
        "bytes": nbytes,
        "seconds": seconds,
        "all_seconds": times,
        "limit_by": name,
        "limit_seconds": limit,
        "of_limit": of_limit,
        "of_fio": of_limit,  # (the old name)
    }
    into = [w for w in ways if w.endswith(TENSORS)]
    if into:  # (the fastest raw read into the in-place load's own memory, and the load's rate beside it)
        out["tensors_by"] = min(into, key=seconds.__getitem__)
        out["tensors_seconds"] = seconds[out["tensors_by"]]
        out["inplace_of_tensors"] = out["tensors_seconds"] / seconds["pytreeckpt.load inplace"]
    if writes is not None:
        wname, wlimit = sound_limit(seconds, writes, WRITE_BASELINE, "write")
        out["write_limit_by"], out["write_limit_seconds"] = wname, wlimit
        out["save_of_limit"] = {k: wlimit / seconds[k] for k in [*writes, "pytreeckpt.save"]}
    return out


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn``: its own figure when it returns one (fio's runtime), else the wall clock's."""
    t0 = time.perf_counter()
    own = fn()
    wall = time.perf_counter() - t0
    return float(own) if isinstance(own, float) else wall


def _clean(*paths: Path) -> Callable[[], None]:
    """A save's setup: the last output removed, its writeback done (``sync``), the page cache dropped."""

    def setup() -> None:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
        drop_caches()

    return setup


def _turns(variants: dict[str, Callable[[], Any]], repeat: int, setup: Callable[[], None]) -> dict[str, list[float]]:
    """Each variant's seconds in each of ``repeat`` rounds, in a new order each round (seeded), ``setup`` first."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = random.Random(0)
    for _ in range(repeat):
        names = list(variants)
        order.shuffle(names)  # none always follows the same one (what it freed, what the disk still does)
        for name in names:
            setup()
            times[name].append(_timed(variants[name]))
    return times


def _save_turns(
    state: dict[str, torch.Tensor], sizes: list[int], repeat: int, jobs: int, workdir: Path, gib: float
) -> tuple[list[str], dict[str, list[float]]]:
    """The write ways (chunk files of ``sizes``), the baseline and ``pytreeckpt.save`` of ``state``, in turns."""
    saved, raw = workdir / f"save_{gib:g}", workdir / "raw-write"
    writes: dict[str, Callable[[], Any]] = {
        **write_ways(sizes, jobs, workdir),
        WRITE_BASELINE: lambda: _raw_write(state, raw),
    }
    times = _turns({**writes, "pytreeckpt.save": lambda: pytreeckpt.save(saved, state)}, repeat, _clean(saved, raw))
    _clean(saved, raw)()
    return list(writes), times


def run(gib: float, leaves: int, repeat: int, jobs: int, workdir: Path) -> dict[str, Any]:
    """One process: durable saves against the write limit, then cold loads against the read limit."""
    state = make_state(int(gib * GiB), leaves)
    path = workdir / f"cold_{gib:g}"
    pytreeckpt.save(path, state, overwrite=True)
    files = _chunk_files(path)
    writes, times = _save_turns(state, [f.stat().st_size for f in files], repeat, jobs, workdir, gib)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    del state
    ways = {**read_ways(path, files, nbytes, jobs, workdir), **tensor_ways(files, list(target.values()))}
    variants: dict[str, Callable[[], Any]] = {
        **ways,
        "pytreeckpt.load": lambda: pytreeckpt.load(path, target),
        "pytreeckpt.load 4 KiB pages": lambda: pytreeckpt.load(path, target, executor=_SMALL_PAGES),
        "pytreeckpt.load inplace": lambda: pytreeckpt.load(path, target, inplace=True),
    }
    times.update(_turns(variants, repeat, _clean()))
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(workdir / "fio-large", ignore_errors=True)
    return _summary(times, list(ways), nbytes, writes)


def _rank_state(rank: int, world: int, gib: float, leaves: int, mesh: Any, fresh: bool) -> dict[str, Any]:
    """This rank's ``Shard(0)`` rows of ``leaves`` matrices of ``gib`` GiB in all (a fresh
    ``torch.empty`` target when ``fresh``; random values otherwise)."""
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}
    per = int(gib * GiB) // leaves
    for i in range(leaves):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        cols = 1024
        rows = per // (cols * dtype.itemsize) // world * world
        local = (rows // world, cols)
        data = torch.empty(local, dtype=dtype) if fresh else torch.randn(local, generator=g).to(dtype)
        out[f"layer{i}.weight"] = DTensor.from_local(
            data, mesh, [Shard(0)], run_check=False, shape=(rows, cols), stride=(cols, 1)
        )
    return out


def _rank_worker(rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    with gloo_rank(rank, world, port) as mesh:
        path, jobs = Path(args["path"]), args["jobs"]
        state = _rank_state(rank, world, args["gib"], args["leaves"], mesh, fresh=False)
        pytreeckpt.save(path, state, overwrite=True)
        dist.barrier()
        files = _chunk_files(path)
        own: dict[str, float] = {}  # rank 0's figure for a way (fio's own runtime)
        wnames, times = _rank_saves(rank, world, state, [f.stat().st_size for f in files], args, own, path.parent)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())  # (a DTensor's numel is global)
        inplace_target = dict(state)  # memory already faulted in, as a training job's
        del state

        ways = read_ways(path, files, sum(f.stat().st_size for f in files), jobs, path.parent) if rank == 0 else {}
        names = [f"fio {jobs} jobs", f"fio {jobs} jobs direct", f"fio {jobs} jobs large files"]
        names += [f"fio {jobs} jobs large files direct", BASELINE, DIRECT, NEW_MEMORY, DIRECT_SMALL]
        local = [v.to_local() for v in inplace_target.values()]
        shares = {**share_ways(files, rank, world), **share_tensor_ways(files, local, rank, world)}

        def load(executor: pytreeckpt.ExecutorOptions | None = None) -> None:
            target = _rank_state(rank, world, args["gib"], args["leaves"], mesh, fresh=True)
            pytreeckpt.load(path, target, executor=executor)

        variants: dict[str, Callable[[], Any]] = {
            **{name: _on_rank0(rank, ways.get(name, lambda: None), name, own) for name in names},
            **shares,
            "pytreeckpt.load": load,
            "pytreeckpt.load 4 KiB pages": lambda: load(_SMALL_PAGES),
            "pytreeckpt.load inplace": lambda: pytreeckpt.load(path, inplace_target, inplace=True),
        }
        times.update(_rank_turns(variants, args["repeat"], rank, own, ()))
        if rank == 0:
            shutil.rmtree(path.parent / "fio-large", ignore_errors=True)
            result = {"times": times, "bytes": nbytes, "ways": [*names, *shares], "writes": wnames}
            (path.parent / "result-cold-ranks.json").write_text(json.dumps(result))


def _on_rank0(rank: int, fn: Callable[[], Any], name: str, own: dict[str, float]) -> Callable[[], None]:
    """``fn`` run by rank 0 alone (the others wait at the barriers); its own figure (fio's runtime) kept in ``own``."""

    def run() -> None:
        if rank == 0:
            got = fn()
            if isinstance(got, float):
                own[name] = got

    return run


def _rank_saves(
    rank: int,
    world: int,
    state: dict[str, Any],
    sizes: list[int],
    args: dict[str, Any],
    own: dict[str, float],
    where: Path,
) -> tuple[list[str], dict[str, list[float]]]:
    """The write ways (on rank 0, over chunk files of ``sizes``: every rank's), the baseline (rank 0 writing as
    many bytes as all ranks hold) and every rank's ``pytreeckpt.save`` of ``state``, in turns."""
    jobs = args["jobs"]
    saved, raw, shared = where / "save-ranks", where / "raw-write", where / "share-write"
    writes = write_ways(sizes, jobs, where) if rank == 0 else {}
    wnames = [f"fio {jobs} jobs write", f"fio {jobs} jobs write direct", f"fio {jobs} jobs write large files"]
    wnames += [f"fio {jobs} jobs write large files direct", WRITE_SMALL]
    share = share_names(world)[2]
    mine = sizes[rank::world]  # (this rank's share of the files, into a directory of its own)
    write_share = _small_writes(shared / str(rank), mine, _share_threads(world)) if mine else lambda: None
    copies = {f"{k}.{r}": v for r in range(world) for k, v in state.items()}  # (every rank's bytes, as many)
    saves: dict[str, Callable[[], Any]] = {
        **{name: _on_rank0(rank, writes.get(name, lambda: None), name, own) for name in wnames},
        share: write_share,
        WRITE_BASELINE: _on_rank0(rank, lambda: _raw_write(copies, raw), WRITE_BASELINE, own),
        "pytreeckpt.save": lambda: pytreeckpt.save(saved, state),
    }
    return [*wnames, share, WRITE_BASELINE], _rank_turns(saves, args["repeat"], rank, own, (saved, raw, shared))


def _rank_turns(
    variants: dict[str, Callable[[], Any]], repeat: int, rank: int, own: dict[str, float], clean: tuple[Path, ...]
) -> dict[str, list[float]]:
    """:func:`_turns` at every rank (the same order on each): rank 0 removes ``clean`` and drops the page cache
    between barriers, each run is timed between barriers (the slowest rank's time), or is rank 0's own figure."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = random.Random(0)  # the same order on every rank
    for _ in range(repeat):
        names = list(variants)
        order.shuffle(names)
        for name in names:
            dist.barrier()
            if rank == 0:
                _clean(*clean)()
            dist.barrier()
            t0 = time.perf_counter()
            variants[name]()
            dist.barrier()
            times[name].append(own.pop(name, time.perf_counter() - t0))
    if rank == 0:
        _clean(*clean)()
    return times


def run_ranks(ranks: int, gib: float, leaves: int, repeat: int, jobs: int, workdir: Path) -> dict[str, Any]:
    """:func:`run` at ``ranks`` gloo ranks, each loading its ``Shard(0)`` share (no raw read)."""
    path = workdir / f"cold_{gib:g}_{ranks}ranks"
    args = {"path": str(path), "gib": gib, "leaves": leaves, "repeat": repeat, "jobs": jobs}
    mp.spawn(_rank_worker, args=(ranks, free_port(), args), nprocs=ranks, join=True)
    got = json.loads((workdir / "result-cold-ranks.json").read_text())
    shutil.rmtree(path, ignore_errors=True)
    return {"ranks": ranks, **_summary(got["times"], got["ways"], got["bytes"], got["writes"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--leaves", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--ranks", type=int, default=1, help="gloo ranks loading a share each (1: one process)")
    args = p.parse_args()
    if shutil.which("fio") is None or not can_drop_caches():
        raise SystemExit("benchmarks.cold needs fio (apt-get install fio) and root, to drop the page cache")
    with tempfile.TemporaryDirectory(prefix="pytreeckpt-cold-") as d:
        for gib in args.gib:
            if args.ranks > 1:
                r = run_ranks(args.ranks, gib, args.leaves, args.repeat, args.jobs, Path(d))
            else:
                r = run(gib, args.leaves, args.repeat, args.jobs, Path(d))
            print(json.dumps({"gib": gib, **r}), flush=True)


if __name__ == "__main__":
    main()
