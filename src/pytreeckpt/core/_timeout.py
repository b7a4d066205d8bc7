"""How long a checkpoint call waits for other ranks, or for its store, before it gives up.

Every wait of a save, a load or a manager on another rank (a meeting before a collective,
a transfer of data) and on an object store's request has a deadline: the call's
``timeout=`` argument, else the process-wide default (:func:`set_default_timeout`, else
the environment variable ``PYTREECKPT_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`). It bounds
each wait, not the whole call: a save whose writes take an hour fails only when one rank
waits ``timeout`` seconds for another that has not come, or a store does not answer
within it.

The entry points set the call's value for what they run (:func:`call_timeout`); the
layers below read it (:func:`current_timeout`), in the writer thread of an asynchronous
save too (its thread runs in a copy of the caller's context).

>>> resolve(None) == default_timeout()
True
>>> with call_timeout(5):
...     current_timeout()
5.0
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = [
    "DEFAULT_TIMEOUT",
    "call_timeout",
    "current_timeout",
    "default_timeout",
    "resolve",
    "set_default_timeout",
]

DEFAULT_TIMEOUT = 600.0  # seconds: torch's own default for NCCL collectives, and NCCL's watchdog's
ENV = "PYTREECKPT_TIMEOUT"

_default: list[float] = []  # set_default_timeout's value, if called
_current: ContextVar[float | None] = ContextVar("pytreeckpt_timeout", default=None)


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{what} must be a number of seconds > 0 and finite, found {value!r}")
    return float(value)


def set_default_timeout(seconds: float | None) -> None:
    """Set how long every later checkpoint call of this process waits, unless given its own ``timeout``.

    ``None`` goes back to ``PYTREECKPT_TIMEOUT``, else :data:`DEFAULT_TIMEOUT` (600 s).

    Raises:
      ValueError: ``seconds`` is not a finite number > 0.
    """
    value = None if seconds is None else _seconds(seconds, "the default timeout")
    _default.clear()
    if value is not None:
        _default.append(value)


def default_timeout() -> float:
    """The process-wide default: :func:`set_default_timeout`'s, else ``PYTREECKPT_TIMEOUT``'s, else 600 s.

    Raises:
      ValueError: ``PYTREECKPT_TIMEOUT`` is set but is not a finite number of seconds > 0.
    """
    if _default:
        return _default[0]
    text = os.environ.get(ENV)
    if text is None or not text.strip():
        return DEFAULT_TIMEOUT
    try:
        value: object = float(text)
    except ValueError:
        value = text
    return _seconds(value, ENV)


def resolve(timeout: float | None) -> float:
    """A call's deadline: ``timeout`` checked, or the default when it is None.

    Raises:
      ValueError: ``timeout`` is not a finite number of seconds > 0.
    """
    return default_timeout() if timeout is None else _seconds(timeout, "timeout")


@contextlib.contextmanager
def call_timeout(timeout: float | None) -> Iterator[float]:
    """Within the block, :func:`current_timeout` is ``timeout`` (resolved): an entry point's own value."""
    value = resolve(timeout)
    token = _current.set(value)
    try:
        yield value
    finally:
        _current.reset(token)


def current_timeout() -> float:
    """The deadline of the call running in this context (or thread copied from it), else the default."""
    value = _current.get()
    return default_timeout() if value is None else value
