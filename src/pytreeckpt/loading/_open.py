"""A load's first stage: the checkpoint opened, its document read and parsed; reads started again when replaced.

Each save names its arrays anew and deletes the replaced ones only after its commit, so
a read of a checkpoint replaced under it (another process saving there) may find its
arrays gone: :func:`again_if_replaced` then reads the new document and starts again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from pytreeckpt.core._errors import CheckpointError, CheckpointTimeoutError, NotCommittedError, TargetMismatchError
from pytreeckpt.format import CheckpointDoc, parse_document
from pytreeckpt.storage import ExecutorOptions, Storage, available_memory
from pytreeckpt.storage._location import Where, describe

__all__ = [
    "LOAD_ATTEMPTS",
    "again_if_replaced",
    "check_memory",
    "open_checkpoint",
    "parse",
    "raise_unless_replaced",
    "replaced",
]

_T = TypeVar("_T")
PathLike = Where


def open_checkpoint(
    path: PathLike, namespace: str, executor: ExecutorOptions | None, seen: list[bytes] | None = None
) -> tuple[Storage, CheckpointDoc]:
    """The location and its parsed metadata document; the document's bytes appended to ``seen`` when given (to
    tell, after a failure, whether the checkpoint was replaced meanwhile: :func:`again_if_replaced`)."""
    storage = Storage(path, executor)
    raw = storage.read_metadata()
    if seen is not None:
        seen.append(raw)
    return storage, parse(storage, raw, namespace)


def parse(storage: Storage, raw: bytes, namespace: str) -> CheckpointDoc:
    """The metadata document, within the location's size limit and this machine's memory."""
    limit = storage.location.options.max_metadata_bytes
    doc = parse_document(raw, namespace=namespace, max_bytes=limit, available=available_memory())
    if doc.checksums is not None:  # (read as the arrays read need them)
        doc.checksums.reader = storage.read_checksums
    return doc


def check_memory(where: PathLike, claims: Sequence[tuple[str, int]]) -> None:
    """Refuse, before allocating, what the metadata claims beyond this machine's memory.

    ``claims`` are ``(key, bytes)`` of the buffers a load makes from the metadata's own
    shapes (a target's shapes are the caller's).
    """
    total = sum(n for _, n in claims)
    available = available_memory()
    if available is None or total <= available:
        return
    key, largest = max(claims, key=lambda c: c[1])
    raise CheckpointError(
        f"loading {describe(where)} would allocate {total} bytes for {len(claims)} arrays as the metadata claims "
        f"them (the largest, leaf {key!r}, {largest} bytes), more than the {available} bytes this machine has "
        f"available (MemAvailable and free swap, within the process's address-space limit); load part of it "
        f"(include=, a target tree, load_slice)"
    )


LOAD_ATTEMPTS = 4
"""How many times a read starts again when the checkpoint is replaced under it (another process saving there)."""


def again_if_replaced(
    path: PathLike, executor: ExecutorOptions | None, what: str, read: Callable[[list[bytes]], _T]
) -> _T:
    """``read(seen)``, started again when it failed because the checkpoint was replaced under it.

    ``read`` appends the metadata document it read to ``seen``; after its failure the
    document is read again (:func:`raise_unless_replaced`), and ``read`` starts again if
    it changed, up to ``LOAD_ATTEMPTS`` times in all: then a NotCommittedError says the
    checkpoint kept being replaced while it was being ``what``.
    """
    seen: list[bytes] = []
    attempts = 0
    while True:
        seen.clear()
        try:
            return read(seen)
        except (CheckpointError, OSError) as e:
            if not seen or isinstance(e, (NotCommittedError, TargetMismatchError, CheckpointTimeoutError)):
                raise  # (a store that did not answer in time is not asked again)
            raise_unless_replaced(path, executor, seen[0], e, what)
            attempts += 1
            if attempts == LOAD_ATTEMPTS:
                raise NotCommittedError(
                    f"{describe(path)} was replaced {attempts} times while it was being {what} (another "
                    f"process saving there); the last failure: {e}"
                ) from e


def replaced(storage: Storage, document: bytes) -> bool:
    """Whether the metadata document at ``storage`` is no longer ``document`` (or is gone)."""
    try:
        return storage.read_metadata() != document
    except NotCommittedError:
        return True


def raise_unless_replaced(
    path: PathLike, executor: ExecutorOptions | None, document: bytes, error: Exception, what: str = "loaded"
) -> None:
    """Return if the read that read ``document`` and failed with ``error`` lost a race with a new save there.

    Each save names its arrays anew and deletes the replaced ones only after its commit,
    so a read of the old document may find its arrays gone: the new document is then
    read instead. When the document is unchanged the failure is the checkpoint's own,
    and ``error`` is raised (as a CheckpointError); NotCommittedError when it is gone.
    """
    try:
        now = Storage(path, executor).read_metadata()
    except NotCommittedError:
        raise NotCommittedError(f"{describe(path)} was removed while it was being {what}") from error
    if now != document:
        return
    if isinstance(error, CheckpointError):
        raise error
    raise CheckpointError(f"{describe(path)} could not be {what}: {error}") from error
