"""The commit protocol: one writer per checkpoint, a new checkpoint beside the committed one,
the metadata document written atomically last, and what a failed save wrote removed.

Written once for both kinds of place (:mod:`pytreeckpt.storage._place`): each step the
two do differently (the lock, the document's atomic write, listing and deleting what is
stored, what a failed save leaves) is a method of the place."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.format import METADATA_FILE, generation_of, seal_document
from pytreeckpt.storage._base import StorageBase
from pytreeckpt.storage._place import Lock, Unreadable

logger = logging.getLogger("pytreeckpt")


MAX_GENERATION = 999_999_999
"""The largest generation a stored name may have: the reader takes at most 9 digits after ``~g``."""


class CommitProtocol(StorageBase):
    """Locks, prepares, commits, abandons and removes checkpoints; reads the committed document."""

    @property
    def metadata_path(self) -> Path:
        return self.root / METADATA_FILE

    def is_committed(self) -> bool:
        return self.place.is_committed()

    def lock(self) -> Lock:
        """Take the writer lock, or raise: one save at a time per checkpoint path.

        Locally the lock is an ``flock`` on a file inside the directory, so the kernel
        releases it when its holder dies: a crashed save never blocks the next one. A lock
        held for a moment only (a CheckpointManager removing the directory) is waited for,
        up to ``LOCK_WAIT`` seconds; a lock file whose directory its holder removed is no
        lock, and the directory is made again. A key-value store has no such lock: there the
        lock holds nothing and one writer per prefix is the caller's responsibility.
        """
        return self.place.lock()

    def try_lock(self) -> Lock | None:
        """The writer lock if it is free now; None if a writer holds it or the directory is gone.

        It never makes the directory: it is how a directory is locked to be removed. A lock
        file that is a symbolic link (dangling or not) or not a regular file is refused, never
        followed: the lock is never made or opened outside the checkpoint.
        """
        return self.place.try_lock()

    def check_writable(self, overwrite: bool) -> None:
        """Raise now, before any work, if a save here would be refused."""
        self.place.check_writable(overwrite)

    def prepare(self, overwrite: bool) -> int:
        """Make the location ready for a new checkpoint; returns the generation its arrays are named with.

        A committed checkpoint is left whole and loadable: the new one is written beside
        it, under names its metadata does not use (:func:`generation_name`), and replaces
        it at the commit. What the committed metadata does not reference, the leftovers of
        a save that failed or was killed, is removed first. Locally the caller holds the lock.
        """
        self.check_writable(overwrite)
        self._kept = self._committed_names()
        self._prepared = True
        try:
            stored = self.place.stored_names(refuse_links=True)
            if self._kept is not None:
                self.place.delete(stored - self._kept)
                stored &= self._kept
            self.place.make_ready()
        except OSError as e:
            raise CheckpointError(f"cannot prepare {self.url} for a new checkpoint: {e}") from e
        # (the committed document's names too: a listing that lags behind the store, an object store's under
        # load, must not let the new arrays be named as the committed ones and written over them)
        return next_generation(stored | (self._kept or frozenset()))

    def commit(
        self,
        document: bytes | bytearray,
        checksums: tuple[str, bytes] | None = None,
        names: frozenset[str] | None = None,
    ) -> None:
        """Write the metadata document atomically, then delete the arrays it does not reference.

        The document is stored ending in the checksum of its bytes (:func:`seal_document`), which
        a reader checks before it parses them.

        ``checksums``: the checksums file the document names (its name and bytes), written
        and made durable first. ``names``: the arrays, databases and checksums file the
        document references, where the caller knows them (else they are read from the document).

        Locally: a temporary file, fsync, rename over the old document, fsync of the
        directory. On a key-value store: one PUT of the whole document, after every array
        write has finished. A checkpoint this one replaces stays whole and loadable until
        that instant; then its arrays are deleted (a failure to delete them is logged, and
        the next save reclaims them).
        """
        if checksums is not None:
            self.place.write_checksums(*checksums)  # (a name of this save's generation: nothing committed uses it)
        body, tail = seal_document(document)  # (ending in its checksum: a damaged document is refused)
        self.place.write_document(body, tail)
        try:
            self.place.delete(self._unreferenced(_referenced(document) if names is None else names))
        except Exception as e:  # committed all the same: the next save reclaims them
            logger.warning("%s: committed, but the arrays it replaced could not all be deleted: %s", self.url, e)

    def read_checksums(self, name: str, start: int, stop: int) -> bytes:
        """Bytes ``start`` to ``stop`` of the checksums file ``name`` (fewer where it ends): what a
        :class:`~pytreeckpt.format.ChecksumFile` reads through."""
        return self.place.read_checksums(name, start, stop)

    def abandon(self) -> None:
        """After a failed save: remove what it wrote, keeping all that a committed document references.

        The checkpoint the save was to replace stays whole (and so does the new one, if
        the failure came after its document was renamed into place). A directory the save
        made is removed. Errors here are logged: the save's own failure is what is reported.
        After a wait on the store timed out nothing is removed: the store is not answering, and
        a commit whose outcome is unknown may still land (its arrays must stay).
        """
        if self._packed is not None:
            self._packed.abort()
        if not (self._prepared or self.place.made_root):
            return
        if self.waits.stuck:  # the store did not answer: asking again would wait as long, and a commit may land
            logger.warning(
                "%s: the save failed (the store did not answer in time); what it wrote is left for the next save "
                "to remove",
                self.url,
            )
            return
        try:
            now = self._committed_names()
            keep = None if self._kept is None or now is None else self._kept | now
            self.place.delete(self._unreferenced(keep))
            self.place.after_failure(self.is_committed())
        except Exception as e:
            logger.warning("%s: the save failed and what it wrote could not all be removed: %s", self.url, e)

    def remove(self) -> None:
        """Delete the checkpoint: its commit first, so a crash midway leaves no half checkpoint.

        Parts already gone (another process removing it too) are no error.
        """
        self.place.remove()

    def _committed_names(self) -> frozenset[str] | None:
        """The arrays and databases the committed document uses; empty if none is committed, None if unreadable
        (so all is kept)."""
        try:
            raw = self.place.committed_document()
        except Unreadable:
            return None
        return frozenset() if raw is None else _referenced(raw)

    def _unreferenced(self, keep: frozenset[str] | None) -> set[str]:
        """What is stored and not in ``keep``; nothing when ``keep`` is unknown."""
        return set() if keep is None else self.place.stored_names(refuse_links=False) - keep

    def read_metadata(self) -> bytes:
        """The metadata document, read only if it is at most ``max_metadata_bytes`` (checked before reading)."""
        return self.place.read_metadata(self.location.options.max_metadata_bytes)


def next_generation(stored: Iterable[str]) -> int:
    """The generation a save names its arrays with, given the names ``stored`` here that it must not reuse.

    0 (plain names) where nothing is stored; else the one after the newest, and after
    :data:`MAX_GENERATION` the smallest that no stored name has: a generation the reader
    accepts and names no stored array, database or checksums file has (a stored name of
    another generation, or of none, never equals one of this generation's).

    >>> next_generation([]), next_generation(["arrays/w"]), next_generation(["arrays/w~g7", "packed/0~g7"])
    (0, 1, 8)
    >>> next_generation(["arrays/w~g999999999"]), next_generation(["arrays/w~g999999999", "packed/0~g1"])
    (1, 2)
    """
    used = {generation_of(name) for name in stored}
    if not used:
        return 0
    if max(used) < MAX_GENERATION:
        return max(used) + 1
    return min(set(range(1, len(used) + 2)) - used)


def _referenced(document: bytes | bytearray) -> frozenset[str] | None:
    """The arrays, databases and checksums file a document uses (``arrays/``, ``ocdbt/``, ``packed/<name>``,
    ``checksums/crc32c``); None if unreadable.

    Read leniently (a document of a newer format still protects what it names), and
    never trusted beyond naming what not to delete.
    """
    try:
        doc = json.loads(document)
        leaves = doc["leaves"]
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None
    if not isinstance(leaves, list):
        return None
    names: set[str] = set()
    for leaf in leaves:
        if isinstance(leaf, dict):
            names.update(v for v in (leaf.get("path"), leaf.get("database")) if isinstance(v, str))
    checksums = doc.get("checksums")
    if isinstance(checksums, dict) and isinstance(checksums.get("path"), str):
        names.add(checksums["path"])
    return frozenset(names)
