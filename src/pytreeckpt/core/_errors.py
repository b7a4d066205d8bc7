"""Errors raised by pytreeckpt."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "LayoutError",
    "MetadataError",
    "NotCommittedError",
    "PermissionDeniedError",
    "TargetMismatchError",
]


class CheckpointError(Exception):
    """Base class of every error pytreeckpt raises about a checkpoint or its inputs."""


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
