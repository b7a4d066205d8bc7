"""How storage I/O runs: concurrency, bytes in flight, staging memory."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

__all__ = ["ExecutorOptions", "per_rank"]

logger = logging.getLogger("pytreeckpt")


MiB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorOptions:
    """Concurrency of the executor.

    Attributes:
      max_inflight_bytes: bytes of writes or reads issued and not yet finished.
      file_io_concurrency: the limit on concurrent file operations (TensorStore's and the
        executor's own). In a distributed save the ranks of one machine share it
        (:func:`per_rank`).
      data_copy_concurrency: TensorStore's limit on threads encoding and decoding chunks.
      staging_bytes: the bound on the staging memory of an asynchronous save. None: as
        much as the state this rank writes, so the caller waits only for the copy; a
        smaller pool is reused ping-pong, the caller then also waiting for the writes
        that make room. Never less than one piece.
      staging_piece_bytes: the largest piece copied and written as one (whole chunks).
      keep_staging: keep the staging memory for the next asynchronous save (a copy
        into memory already mapped is several times faster); False frees it after each
        save. It is always freed after a failed save.
      progress: draw a progress bar on stderr for saves and loads.
      exit_timeout: seconds an asynchronous save still running when the program's
        main thread ends is waited for; past them it is cancelled and commits nothing
        (a warning on the ``pytreeckpt`` logger says so). None waits however long it
        takes.
      background_nice: how many steps below normal scheduling priority the threads
        writing an asynchronous save run (Linux niceness, per thread; 0: as the
        caller's). On busy cores the caller's own threads, a training loop's compute
        and its OpenMP workers, then come first, and the save takes what they leave.
      direct_io: write chunk files of 1 MiB and more around the page cache (``O_DIRECT``)
        where the file system takes it: the kernel neither copies the bytes into its
        cache nor writes them back later, which leaves more CPU to the program meanwhile
        (on the development machine, a CPU training loop beside a 1 GiB asynchronous
        save lost 1.13 s instead of 1.56 s) and writes faster (that save 0.69 s instead
        of 0.81 s). The files are the same. A load right after such a save reads from
        the device rather than from the page cache. A load also reads chunk files of
        1 MiB and more that the page cache holds none of (Linux 6.5 and later tell)
        around it, 256 KiB at a time, straight into the new memory it returns (which
        starts on a page): through the cache, a cold 4 GiB load filled twice its size of
        fresh pages, and took 7.4 s against 2.7 s. A caller's tensors (``inplace``),
        which start 64 bytes into a page, are read through the cache: ``O_DIRECT``
        cannot fill them, and through a buffer and a copy they were slower.
      huge_pages: ask Linux for transparent huge pages (2 MiB, ``madvise``) for the new
        host memory a load reads into through the page cache and for the staging memory
        of an asynchronous save: their pages then fault in several times faster (4 GiB
        loaded into new tensors: 3.1 s with 4 KiB pages, 1.5 s with huge pages, on the
        development machine). A cold load reading around the page cache (``direct_io``)
        leaves the faults to its reads, in 4 KiB pages, which cost less there (4 GiB:
        2.7 s against 3.6 s). No effect where the kernel's transparent huge pages are
        ``never`` or ``always``, or off Linux.
    """

    max_inflight_bytes: int = 512 * MiB
    file_io_concurrency: int = 16
    data_copy_concurrency: int = 4
    staging_bytes: int | None = None
    staging_piece_bytes: int = 64 * MiB
    keep_staging: bool = True
    progress: bool = False
    exit_timeout: float | None = 600.0
    background_nice: int = 10
    direct_io: bool = True
    huge_pages: bool = True

    def __post_init__(self) -> None:
        for name in ("max_inflight_bytes", "file_io_concurrency", "data_copy_concurrency", "staging_piece_bytes"):
            _count(name, getattr(self, name))
        if self.staging_bytes is not None:
            _count("staging_bytes", self.staging_bytes)
        for name in ("keep_staging", "progress", "direct_io", "huge_pages"):
            if type(getattr(self, name)) is not bool:
                raise TypeError(f"ExecutorOptions.{name} must be True or False, found {getattr(self, name)!r}")
        timeout = self.exit_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
        ):
            raise ValueError(f"ExecutorOptions.exit_timeout must be seconds (a number >= 0) or None, found {timeout!r}")
        if type(self.background_nice) is not int or not 0 <= self.background_nice <= 19:
            raise ValueError(f"background_nice is a niceness from 0 to 19, found {self.background_nice!r}")


def _count(name: str, value: object) -> None:
    """Refuse an option that is not a whole number of at least 1 (bytes, or threads)."""
    if type(value) is not int:
        raise TypeError(f"ExecutorOptions.{name} must be an int, found {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"ExecutorOptions.{name} must be at least 1, found {value}")


def per_rank(options: ExecutorOptions | None) -> ExecutorOptions:
    """One rank's options in a distributed save: the ranks of one machine (``LOCAL_WORLD_SIZE``, which
    torchrun sets) share its disks, so each runs its share of ``file_io_concurrency`` (at least 2).

    Four ranks of 16 each kept about 100 requests in the disk's queue, each taking 40-50 ms, where one process
    keeps about 20 of 9 ms: on the development machine a 4 GiB save at 4 ranks took 2.70-2.90 s that way, and
    2.56-2.70 s with 4 each. (Loads keep theirs: a 1 GiB cold load at 4 ranks took 0.90 s with 4 each, 0.77 s
    with 16.) Without ``LOCAL_WORLD_SIZE`` the options are as given.
    """
    options = options or ExecutorOptions()
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    if local <= 1:
        return options
    return dataclasses.replace(options, file_io_concurrency=max(2, options.file_io_concurrency // local))
