"""A checkpoint location, its parts put together."""

from __future__ import annotations

from pytreeckpt.storage._arrays import ArrayIO
from pytreeckpt.storage._commit import CommitProtocol

__all__ = ["Storage"]


class Storage(CommitProtocol, ArrayIO):
    """A checkpoint location: a directory on a local file system, or a prefix of a key-value store.

    On a local file system the commit is an atomic rename and writers hold an ``flock``.
    On a key-value store (``memory://``, ``s3://``, ``gs://``) there is no rename: the
    commit is the metadata document, the last object written, put whole in one request.
    There is no lock there either: one writer per prefix is the caller's responsibility.
    """
