"""Every wait on an object store's request has a deadline: the call's ``timeout`` (:mod:`pytreeckpt.core._timeout`).

TensorStore's S3 and GCS drivers give a request no deadline of their own: a store that
stops answering (a server stopped, a network that drops packets) leaves their futures
pending for ever. Each wait on one is therefore bounded by the call's timeout; past it the
futures in flight are cancelled and a :class:`~pytreeckpt.core._errors.CheckpointTimeoutError`
names the store (its URL and endpoint) and what was in flight.

Cancelling abandons what TensorStore has not sent yet, not a request already sent: a
server stopped with a request in its socket's buffer still runs it when it resumes. So
what a call wrote may land after it raised, but nothing it had not yet asked for: a
save whose writes timed out never asks for its commit, and one whose commit (the
metadata document's PUT) timed out says that the commit's outcome is unknown.

A local directory's waits are not bounded here (a thread writing a file cannot be
cancelled): ``where`` is None there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any

from pytreeckpt.core._errors import CheckpointTimeoutError
from pytreeckpt.core._timeout import current_timeout

__all__ = ["StoreWaits", "cancel", "landed_within"]


class StoreWaits:
    """The waits on one location's requests: each bounded by the call's timeout (none for a local directory).

    ``where`` names the store in errors (``s3://bucket/prefix at http://host:port``), None for
    a local directory; ``stuck`` is set once a wait timed out, after which nothing more is
    asked of the store by this call (a failed save's clean-up is left to the next save).
    """

    __slots__ = ("stuck", "where")

    def __init__(self, where: str | None) -> None:
        self.where = where
        self.stuck = False

    def wait(self, future: Any, what: str) -> Any:
        """``future.result()``, within the call's timeout on an object store; past it ``future`` is cancelled
        and a CheckpointTimeoutError says that ``what`` was in flight."""
        if self.where is None:
            return future.result()
        timeout = current_timeout()
        try:
            return future.result(timeout=timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            done = getattr(future, "done", None)
            if done is not None and done():  # (it ended as the wait did, or failed with a timeout of its own)
                return future.result()
            cancel(future)
            raise self.timed_out(what, timeout) from None

    def timed_out(self, what: str, timeout: float, after: str = "") -> CheckpointTimeoutError:
        """The error of a wait for ``what`` that passed ``timeout`` seconds; ``after``: what to say of its effects
        (by default, that the requests were cancelled)."""
        self.stuck = True
        effects = after or "the requests in flight were cancelled (a save commits nothing then)"
        return CheckpointTimeoutError(
            f"{self.where}: the store did not answer within {timeout:g} s (the call's timeout); in flight: {what}; "
            f"{effects}",
            phase=what,
            timeout=timeout,
        )


def cancel(future: Any) -> None:
    """Ask ``future`` (a TensorStore future, a :class:`concurrent.futures.Future` or one of this package's
    reads) to give up, if it can."""
    stop = getattr(future, "cancel", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


def landed_within(future: Any, timeout: float | None) -> None:
    """Wait up to ``timeout`` seconds (None: no limit) for ``future`` to end, well or not; raise TimeoutError if it
    has not. (Its outcome is left to whoever asks for its result.)"""
    if timeout is None:
        return
    try:
        future.result(timeout=timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):
        if not future.done():
            raise
    except Exception:
        pass
