"""A preemption notice (SIGTERM, ...) noted by a signal handler that only sets a flag, then chains."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

__all__ = ["SignalFlag"]

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
