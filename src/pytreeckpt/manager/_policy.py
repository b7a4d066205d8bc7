"""Which steps retention keeps (a pure function of the steps, their metrics and times), what it knows of each
step, and the deleter thread."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytreeckpt.core._errors import CheckpointError

__all__ = ["Deleter", "Retention", "StepFacts"]

logger = logging.getLogger("pytreeckpt")


@dataclass(frozen=True, slots=True, kw_only=True)
class Retention:
    """The keeping rules of a CheckpointManager; a step kept by any rule is kept, and so is the newest.

    Attributes:
      max_to_keep: the newest this many steps. None: every step, unless ``keep_best`` or
        ``keep_period_seconds`` is given, then the newest only (those rules choose the others).
      keep_every_n_steps: every step divisible by this.
      keep_best: the best this many steps by their metric. Only finite metrics are ranked: a
        step whose metric is None, NaN or infinite (or whose ``best_fn`` raised) is never kept
        by this rule, so it never displaces a step with a finite metric.
      best_mode: ``"min"`` (the smallest metric is best) or ``"max"``.
      keep_period_seconds: one step per period: walking from the oldest, a step is kept
        when it was saved at least this long after the previous step kept so (the oldest
        is kept); steps whose time is unknown are kept.
    """

    max_to_keep: int | None = None
    keep_every_n_steps: int | None = None
    keep_best: int | None = None
    best_mode: str = "min"
    keep_period_seconds: float | None = None

    def keep(
        self,
        committed: Sequence[int],
        metrics: Mapping[int, float | None] | None = None,
        times: Mapping[int, float | None] | None = None,
    ) -> set[int]:
        """The steps of ``committed`` (oldest first) to keep.

        >>> r = Retention(max_to_keep=1, keep_best=2, best_mode="min")
        >>> sorted(r.keep([1, 2, 3, 4], metrics={1: 0.5, 2: 0.1, 3: 0.9, 4: 0.7}))
        [1, 2, 4]
        >>> sorted(r.keep([1, 2, 3, 4], metrics={1: float("nan"), 2: 0.1, 3: None, 4: 0.7}))
        [2, 4]
        >>> r = Retention(max_to_keep=1, keep_period_seconds=10)
        >>> sorted(r.keep([1, 2, 3, 4], times={1: 0, 2: 6, 3: 11, 4: 13}))
        [1, 3, 4]
        """
        steps = sorted(committed)
        if not steps:
            return set()
        if self.max_to_keep is not None:
            keep = set(steps[-self.max_to_keep :])
        elif self.keep_best or self.keep_period_seconds:
            keep = {steps[-1]}
        else:
            keep = set(steps)
        keep.add(steps[-1])  # the newest committed step is never deleted
        if self.keep_every_n_steps:
            keep |= {s for s in steps if s % self.keep_every_n_steps == 0}
        if self.keep_best:
            ranked = [(m, s) for s in steps if (m := (metrics or {}).get(s)) is not None and math.isfinite(m)]
            ranked.sort(key=lambda e: (e[0] if self.best_mode == "min" else -e[0], -e[1]))  # a tie: the newer
            keep |= {s for _, s in ranked[: self.keep_best]}
        if self.keep_period_seconds:
            last: float | None = None
            for s in steps:
                t = (times or {}).get(s)
                if t is None:
                    keep.add(s)
                elif last is None or t - last >= self.keep_period_seconds:
                    keep.add(s)
                    last = t
        return keep


class Deleter:
    """Deletes steps on a thread of its own, one at a time; :meth:`wait` waits for what was asked.

    A deletion that fails is logged and forgotten: the step is still committed and not
    kept, so the next retention asks for it again.
    """

    def __init__(self, remove: Callable[[int], bool], where: str) -> None:
        self._remove = remove
        self._where = where
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[int, Future[None]] = {}
        self._lock = threading.Lock()

    def pending(self) -> set[int]:
        with self._lock:
            return set(self._pending)

    def submit(self, step: int) -> None:
        with self._lock:
            if step in self._pending:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pytreeckpt-deleter")
            self._pending[step] = self._pool.submit(self._run, step)

    def _run(self, step: int) -> None:
        try:
            if not self._remove(step):
                logger.info(
                    "%s: step %d was not deleted (a save holds it, or it is gone); retried later", self._where, step
                )
        except Exception as e:  # logged, and the next retention asks again
            logger.warning(
                "%s: deleting step %d failed, the next retention retries: %s: %s",
                self._where,
                step,
                type(e).__name__,
                e,
            )
        finally:
            with self._lock:
                self._pending.pop(step, None)

    def wait(self) -> None:
        """Block until every deletion asked for so far has run (succeeded or been logged)."""
        with self._lock:
            futures = list(self._pending.values())
        for f in futures:
            f.result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class StepFacts:
    """What retention knows of each step: its metric (``best_fn`` of its user metadata) and when it was saved.

    Steps this manager saved are noted as they are saved; those of earlier processes are
    read once: the metric from ``user_metadata(step)``, the time from the modification
    time of the file ``metadata_file(step)`` (None: unknown, as on an object store).
    """

    def __init__(
        self,
        best_fn: Callable[[Mapping[str, Any]], float] | None,
        where: str,
        user_metadata: Callable[[int], Mapping[str, Any]],
        metadata_file: Callable[[int], Path | None],
    ) -> None:
        self.best_fn = best_fn
        self._where = where
        self._user_metadata = user_metadata
        self._metadata_file = metadata_file
        self._metrics: dict[int, float | None] = {}
        self._times: dict[int, float] = {}

    def note(self, step: int, when: float, user_metadata: Mapping[str, Any]) -> None:
        self._times[step] = when
        if self.best_fn is not None:
            self._metrics[step] = self._metric(step, user_metadata)

    def metric(self, step: int) -> float | None:
        if step not in self._metrics:
            try:
                user_metadata = self._user_metadata(step)
            except CheckpointError as e:
                logger.warning("%s: step %d: its metadata is unreadable, so it has no metric: %s", self._where, step, e)
                user_metadata = {}
            self._metrics[step] = self._metric(step, user_metadata)
        return self._metrics[step]

    def time(self, step: int) -> float | None:
        if step not in self._times:
            path = self._metadata_file(step)
            if path is None:
                return None
            try:
                self._times[step] = os.stat(path).st_mtime
            except OSError:
                return None
        return self._times[step]

    def _metric(self, step: int, user_metadata: Mapping[str, Any]) -> float | None:
        if self.best_fn is None:
            return None
        try:
            value = self.best_fn(user_metadata)
            metric = None if value is None else float(value)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            logger.warning("%s: step %d has no metric for keep_best (best_fn raised %s)", self._where, step, why)
            return None
        if metric is not None and not math.isfinite(metric):
            logger.warning("%s: step %d has no metric for keep_best (best_fn gave %s)", self._where, step, metric)
            return None
        return metric
