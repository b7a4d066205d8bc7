"""Errors raised by pytreeckpt."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointTimeoutError",
    "LayoutError",
    "MetadataError",
    "NotCommittedError",
    "PermissionDeniedError",
    "TargetMismatchError",
]


class CheckpointError(Exception):
    """Base class of every error pytreeckpt raises about a checkpoint or its inputs."""


class CheckpointTimeoutError(CheckpointError):
    """A wait of a checkpoint call passed its deadline: a rank did not come, or a store did not answer.

    ``phase`` names what was waited for (``"writing the checkpoint"``, ``"the restore vote"``,
    a store request ...), ``ranks`` the ranks of the checkpoint group that did not arrive
    (empty when it was a store), ``timeout`` the deadline in seconds. Every rank still alive
    raises it at the same phase; nothing of the call is committed.
    """

    def __init__(self, message: str, *, phase: str = "", ranks: tuple[int, ...] = (), timeout: float = 0.0) -> None:
        super().__init__(message)
        self.phase = phase
        self.ranks = tuple(ranks)
        self.timeout = timeout

    def __reduce__(self) -> tuple[object, ...]:
        return (_timeout_error, (str(self), self.phase, self.ranks, self.timeout))


def _timeout_error(message: str, phase: str, ranks: tuple[int, ...], timeout: float) -> CheckpointTimeoutError:
    return CheckpointTimeoutError(message, phase=phase, ranks=ranks, timeout=timeout)


class NotCommittedError(CheckpointError):
    """The location holds no committed checkpoint."""


class MetadataError(CheckpointError):
    """The checkpoint's metadata is malformed, unsupported or unsafe."""


class TargetMismatchError(CheckpointError):
    """The load target does not agree with what the checkpoint holds."""


class LayoutError(CheckpointError, ValueError):
    """A sharding spec or a sharded leaf is inconsistent with its tensor."""


class PermissionDeniedError(CheckpointError):
    """A file or directory of the checkpoint exists but this process may not read it (not damage)."""


def where(key: str) -> str:
    """A leaf's dotted key path as error messages name it (the root's is empty)."""
    return repr(key) if key else "(root)"
