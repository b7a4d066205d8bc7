"""What a save or load call holds while it runs: the collector paused, and the asynchronous save in flight.

Both are process-wide by nature (Python has one collector; a process has one checkpoint
writer thread at a time), so their state is module-level here, and only here.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from pytreeckpt.execute._monitor import logger

__all__ = ["InFlight", "gc_paused", "in_flight", "settle_at_exit_once", "wait_in_flight"]

_gc_lock = threading.Lock()
_gc_paused_by = 0  # calls inside gc_paused() that found the collector enabled


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a save or load runs in the caller's thread.

    A state of 10,000 leaves makes hundreds of thousands of short-lived objects (plans,
    regions, futures); the collector's passes over them (and over everything else the
    process holds) cost a third of such a save or load. Nothing made here forms cycles
    that need the collector before the call returns; it is re-enabled on the way out,
    when the last of concurrent such calls ends, and only if it was enabled.
    """
    global _gc_paused_by
    with _gc_lock:
        mine = gc.isenabled() or _gc_paused_by > 0
        if mine:
            _gc_paused_by += 1
            gc.disable()
    try:
        yield
    finally:
        if mine:
            with _gc_lock:
                _gc_paused_by -= 1
                if _gc_paused_by == 0:
                    gc.enable()


class InFlight(Protocol):
    """A save running in the background, as this module waits for it (a SaveHandle)."""

    path: str

    def _settle(self) -> None: ...

    def _cancel_after(self) -> tuple[Callable[[float | None], bool], float | None]: ...

    def _cancel_now(self) -> None: ...


_IN_FLIGHT_LOCK = threading.Lock()
_in_flight: list[InFlight] = []  # the asynchronous save in flight, if any
_EXIT_HOOKED: list[bool] = []  # _settle_at_exit is registered


def in_flight(handle: InFlight) -> None:
    """``handle`` is the save in flight: the next save or load waits for it, and so does the program's end."""
    settle_at_exit_once()
    with _IN_FLIGHT_LOCK:
        _in_flight.append(handle)


def wait_in_flight() -> None:
    """Wait for the save in flight, if any; its failure surfaces here at the latest."""
    with _IN_FLIGHT_LOCK:
        pending = list(_in_flight)
        _in_flight.clear()
    for h in pending:
        h._settle()


def settle_at_exit_once() -> None:
    """Register :func:`_settle_at_exit` to run when the main thread ends, before Python joins the other threads.

    ``threading._register_atexit`` (what ``concurrent.futures`` uses) runs there; a hook
    registered with :mod:`atexit` would run only after the writer has been joined, too
    late to bound the wait. Where it is missing the writer is still joined, without a bound.
    """
    with _IN_FLIGHT_LOCK:
        if _EXIT_HOOKED:
            return
        _EXIT_HOOKED.append(True)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # the interpreter is exiting already
            register(_settle_at_exit)


def _settle_at_exit() -> None:
    """Wait for the save in flight, at most its ``exit_timeout``; then cancel it (it commits nothing)."""
    with _IN_FLIGHT_LOCK:
        pending = list(_in_flight)
    for h in pending:
        wait, timeout = h._cancel_after()
        if not wait(timeout):
            h._cancel_now()
            logger.warning(
                "the asynchronous save to %s was still running %s s after the program ended: cancelled, "
                "nothing is committed there (ExecutorOptions.exit_timeout)",
                h.path,
                timeout,
            )
