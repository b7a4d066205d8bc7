"""A preemption notice (SIGTERM, ...) noted by a signal handler that only sets a flag, then chains."""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from pytreeckpt.distributed._vote import vote_max

__all__ = ["SignalFlag", "Triggers"]

logger = logging.getLogger("pytreeckpt")


class SignalFlag:
    """Installs a handler for ``signals`` that notes the signal and calls the handler that was there before.

    The handler sets :attr:`signum` and nothing else, then chains to the previous
    handler when it is a Python callable other than ``signal.default_int_handler``
    (whose ``KeyboardInterrupt`` would stop the loop before the save). ``SIG_DFL`` and
    ``SIG_IGN`` are not chained: the default action of SIGTERM would end the process
    before its save, which is what the flag is there to prevent. :meth:`restore` puts the
    previous handlers back where this handler is still the installed one.
    """

    def __init__(self, signals: Iterable[int]) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        try:
            for s in signals:
                sig = signal.Signals(s)
                if sig not in self._previous:
                    self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError as e:
            self.restore()
            raise ValueError(f"save_on_signals: cannot install a handler for {list(signals)}: {e}") from e

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        previous = self._previous.get(signum)
        if callable(previous) and previous is not signal.default_int_handler:
            chained: Callable[[int, FrameType | None], Any] = previous
            chained(signum, frame)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            try:
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            except ValueError as e:  # not the main thread: the handler stays (it only sets a flag)
                logger.warning("the handler of %s could not be restored: %s", signal.Signals(sig).name, e)
        self._previous = {}


class Triggers:
    """When a save is due off the step interval: a preemption signal on any rank, or rank 0's clock.

    ``comm`` is the checkpoint group's (None in a single process); :meth:`due` and
    :meth:`reached` give every rank the same answer, with one all-reduce of two
    integers (of one in :meth:`reached`) while a signal or a timed save could be due.
    """

    def __init__(
        self,
        signals: Iterable[int],
        interval_seconds: float | None,
        clock: Callable[[], float],
        comm: Any,
        leader: bool,
    ) -> None:
        self._vote = functools.partial(vote_max, comm)
        self.flag = SignalFlag(signals) if signals else None
        self.interval_seconds = interval_seconds
        self.clock = clock
        self._leader = leader
        self.last_save_time = clock()
        self.preempted = False  # the ranks agreed that a signal arrived
        self.preemption_step: int | None = None
        self._voted_at: int | None = None  # the step of the last save's vote

    def due(self, step: int) -> tuple[bool, bool]:
        """(a preemption save is due now, a timed save is due now) at ``step``, the same on every rank."""
        if self.preemption_step is not None:  # saved already: the signal is spent
            return False, False
        signalled = self.flag is not None and self.flag.signum is not None
        timed = (
            self.interval_seconds is not None
            and self._leader
            and self.clock() - self.last_save_time >= self.interval_seconds
        )
        if (self.flag is not None and not self.preempted) or self.interval_seconds is not None:
            voted = self._vote([int(signalled), int(timed)], f"the vote on saving step {step}")
            self._voted_at = step
            self.preempted = self.preempted or bool(voted[0])
            timed = bool(voted[1])
        return self.preempted, timed

    def saved(self, step: int, preempt: bool) -> float:
        """Note a save of ``step`` (the preemption's when ``preempt``); its time."""
        self.last_save_time = self.clock()
        if preempt:
            self.preemption_step = step
        return self.last_save_time

    def reached(self, step: int) -> bool:
        """Whether a preemption's step is saved and ``step`` is it or newer; a vote unless this step's save voted."""
        if self.flag is None:
            return False
        if not self.preempted and self._voted_at != step:
            self.preempted = bool(self._vote([int(self.flag.signum is not None)], "the preemption vote")[0])
        return self.preemption_step is not None and step >= self.preemption_step

    def close(self) -> None:
        if self.flag is not None:
            self.flag.restore()
