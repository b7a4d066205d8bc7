"""Monitoring: where the time of a save or load goes, per rank and per phase.

A :class:`Monitor` collects timed spans (phase, rank, start, end, bytes). The calls
record into the monitor passed to them (``save(..., monitor=m)``); a distributed call
gathers every rank's spans on rank 0 at its end, over the checkpoint's own process
group. The spans read as a per-phase table (:meth:`Monitor.summary`,
:meth:`Monitor.report`) and as a Chrome trace (:meth:`Monitor.chrome_trace`), which
Perfetto (ui.perfetto.dev) and chrome://tracing open. Every span is also logged at debug
level on the ``pytreeckpt`` logger.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["PHASES", "Monitor", "Progress", "Span"]

logger = logging.getLogger("pytreeckpt")

PHASES = ("plan", "snapshot", "write", "merge", "commit", "read", "transfer", "h2d")
"""The phases recorded. ``write`` includes the fsync of every chunk file (TensorStore
syncs each file it writes); ``commit`` is the atomic metadata write with its fsyncs;
``merge`` is the wait for merge fragments from other ranks; ``transfer`` the wait for
regions other ranks read for this one; ``h2d`` host-to-device copies."""


@dataclass(frozen=True, slots=True)
class Span:
    """One timed phase on one rank; times are wall-clock seconds (``time.time()``)."""

    op: str  # "save" or "load"
    phase: str
    rank: int
    start: float
    end: float
    nbytes: int = 0
    thread: str = ""
    last: int = -1  # a wait for the other ranks ("wait: <phase>"): the rank that came last (-1: not a wait)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_json(self) -> list[Any]:
        return [self.op, self.phase, self.rank, self.start, self.end, self.nbytes, self.thread, self.last]

    @classmethod
    def from_json(cls, data: Any) -> Span:
        op, phase, rank, start, end, nbytes, thread, *last = data
        return cls(
            str(op),
            str(phase),
            int(rank),
            float(start),
            float(end),
            int(nbytes),
            str(thread),
            int(last[0]) if last else -1,
        )


class Monitor:
    """Collects the spans of saves and loads; pass it as ``monitor=`` to record them.

    >>> import tempfile, torch, pytreeckpt
    >>> m = pytreeckpt.Monitor()
    >>> pytreeckpt.save(tempfile.mkdtemp() + "/c", {"w": torch.ones(256)}, monitor=m)
    >>> m.summary()[0]["write"]["bytes"]
    1024
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def add(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)
        logger.debug("%s rank %d %s: %.4f s, %d bytes", span.op, span.rank, span.phase, span.seconds, span.nbytes)

    def extend(self, spans: list[Span]) -> None:
        with self._lock:
            self._spans.extend(spans)

    @contextlib.contextmanager
    def phase(self, op: str, phase: str, rank: int, nbytes: int = 0) -> Iterator[list[int]]:
        """Time the block; the yielded list's first item may be set to the bytes handled."""
        box = [nbytes]
        start = time.time()
        try:
            yield box
        finally:
            self.add(Span(op, phase, rank, start, time.time(), box[0], threading.current_thread().name))

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def summary(self) -> dict[int, dict[str, dict[str, float]]]:
        """``{rank: {phase: {"seconds", "bytes", "count"}}}``, summed over the spans recorded."""
        out: dict[int, dict[str, dict[str, float]]] = {}
        for s in self.spans:
            d = out.setdefault(s.rank, {}).setdefault(s.phase, {"seconds": 0.0, "bytes": 0, "count": 0})
            d["seconds"] += s.seconds
            d["bytes"] += s.nbytes
            d["count"] += 1
        return out

    def report(self) -> str:
        """A table: one row per rank and phase, with seconds, bytes and throughput."""
        lines = [f"{'rank':>4}  {'phase':<9} {'seconds':>9} {'MiB':>10} {'MiB/s':>9}"]
        for rank, phases in sorted(self.summary().items()):
            for phase in sorted(phases, key=lambda p: PHASES.index(p) if p in PHASES else len(PHASES)):
                d = phases[phase]
                mib = d["bytes"] / 2**20
                rate = f"{mib / d['seconds']:9.1f}" if d["bytes"] and d["seconds"] > 0 else f"{'':>9}"
                lines.append(f"{rank:>4}  {phase:<9} {d['seconds']:9.4f} {mib:10.1f} {rate}")
        return "\n".join(lines)

    def chrome_trace(self) -> dict[str, Any]:
        """The spans as a Chrome trace (Trace Event Format): one process per rank, one track per thread."""
        spans = self.spans
        t0 = min((s.start for s in spans), default=0.0)
        threads: dict[tuple[int, str], int] = {}
        events: list[dict[str, Any]] = []
        for s in spans:
            tid = threads.setdefault((s.rank, s.thread), len(threads) + 1)
            events.append(
                {
                    "name": s.phase,
                    "cat": s.op,
                    "ph": "X",
                    "pid": s.rank,
                    "tid": tid,
                    "ts": (s.start - t0) * 1e6,
                    "dur": max(s.seconds, 0.0) * 1e6,
                    "args": {"bytes": s.nbytes},
                }
            )
        for rank in sorted({s.rank for s in spans}):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for (rank, thread), tid in threads.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": thread}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`chrome_trace` as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


class Progress:
    """A progress bar on a terminal stream, advanced by bytes; silent when ``stream`` is None."""

    def __init__(self, what: str, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.what = what
        self.total = max(total, 0)
        self.done = 0
        self.stream = stream
        self.width = width
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._shown = -1

    @classmethod
    def maybe(cls, enabled: bool, what: str, total: int) -> Progress:
        return cls(what, total, sys.stderr if enabled else None)

    def advance(self, nbytes: int) -> None:
        if self.stream is None:
            return
        with self._lock:
            self.done += nbytes
            percent = 100 if not self.total else min(100, self.done * 100 // self.total)
            if percent != self._shown:
                self._shown = percent
                self._draw(percent)

    def _draw(self, percent: int) -> None:
        assert self.stream is not None
        filled = self.width * percent // 100
        elapsed = time.perf_counter() - self._start
        rate = self.done / 2**20 / elapsed if elapsed > 0 else 0.0
        self.stream.write(
            f"\r{self.what} [{'#' * filled}{'.' * (self.width - filled)}] {percent:3d}% "
            f"{self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB {rate:.0f} MiB/s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            if self._shown < 100:
                self._draw(100 if self.done >= self.total else self._shown)
            self.stream.write("\n")
            self.stream.flush()
