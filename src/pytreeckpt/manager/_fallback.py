"""A restore that falls back: the newest step that loads, damaged steps skipped with a warning."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from pytreeckpt.core._errors import (
    CheckpointError,
    CheckpointTimeoutError,
    LayoutError,
    NotCommittedError,
    PermissionDeniedError,
    TargetMismatchError,
)
from pytreeckpt.distributed._comm import Comm
from pytreeckpt.distributed._vote import vote_max

__all__ = ["CheckpointDamageWarning", "first_that_loads"]


class CheckpointDamageWarning(UserWarning):
    """A step did not load (damaged, or files missing) and a restore fell back to an older one."""


_LOADED, _VANISHED, _DAMAGED, _FATAL = 0, 1, 2, 3
_RESTORE_ATTEMPTS = 4
_CALLERS = (TargetMismatchError, LayoutError, PermissionDeniedError)
"""Errors of the caller (or of the machine), not of the step: a restore raises them, never falls back."""


def _verdict(error: BaseException | None) -> int:
    if error is None:
        return _LOADED
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and len(chain) < 8:  # on a failed rank, the agreed error is chained to its own
        chain.append(e)
        e = e.__cause__
    if not isinstance(error, CheckpointError) or any(isinstance(c, _CALLERS) for c in chain):
        return _FATAL
    if isinstance(error, NotCommittedError):
        return _VANISHED
    return _DAMAGED


def first_that_loads(
    candidates: Callable[[], Sequence[tuple[int, str, Callable[[], Any]]]],
    comm: Comm | None,
    nothing: str,
) -> tuple[Any, int, str]:
    """The result of the first candidate (newest first) whose load succeeds on every rank: (result, step, source).

    ``candidates()`` lists (step, where, load) newest first, again after a step vanished
    while it was being loaded (another manager's retention). A step that fails with a
    CheckpointError on any rank is skipped on every rank with a
    :class:`CheckpointDamageWarning` naming it and the damage; a target mismatch, a bad
    layout, a permission error or any other exception is raised on every rank.

    Raises:
      NotCommittedError: no candidate loads (``nothing``, and the damage of each step tried).
    """
    skipped: dict[tuple[int, str], str] = {}
    attempts = 0
    while True:
        todo = [c for c in candidates() if (c[0], c[1]) not in skipped]
        if not todo:
            damage = "; ".join(f"step {s} ({w}): {why}" for (s, w), why in skipped.items())
            raise NotCommittedError(f"{nothing}" + (f"; steps that did not load: {damage}" if damage else ""))
        step, where, load = todo[0]
        error: BaseException | None = None
        result: Any = None
        try:
            result = load()
        except CheckpointTimeoutError:
            raise  # (every rank still alive raised it at the same wait: nothing to vote on, no step to fall to)
        except Exception as e:  # every rank must hear of it before any raises
            error = e
        verdict = vote_max(comm, [_verdict(error)], f"the restore vote on step {step}")[0]
        if verdict == _LOADED:
            return result, step, where
        if verdict == _FATAL:
            if error is None:
                raise CheckpointError(f"restoring step {step} from {where} failed on another rank (see its error)")
            raise error
        if verdict == _VANISHED:
            attempts += 1
            still_there = any(s == step and w == where for s, w, _ in candidates())
            if not still_there:  # removed meanwhile: the newest step then
                if attempts < _RESTORE_ATTEMPTS:
                    continue
                raise error if error is not None else NotCommittedError(f"step {step} of {where} vanished")
        why = f"{type(error).__name__}: {error}" if error is not None else "it failed to load on another rank"
        warnings.warn(
            f"step {step} of {where} does not load; falling back to an older step. {why}",
            CheckpointDamageWarning,
            stacklevel=3,
        )
        skipped[(step, where)] = why
