"""What differs between a local directory and a key-value store prefix, in one place per concern.

:class:`Place` is the one interface; :class:`~pytreeckpt.storage._local.LocalDir` (a
directory: ``flock``, rename, fsync, files checked before they are opened) and
:class:`~pytreeckpt.storage._objects.ObjectPrefix` (``memory://``, S3, GCS: objects put
whole, no rename, no lock) are its two implementations. The rest of the package (the
commit protocol, the checks before a read, the array I/O) is written once against it,
with no branch on which of the two it runs on.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

from pytreeckpt.core._errors import MetadataError, NotCommittedError
from pytreeckpt.core._region import Region
from pytreeckpt.format import METADATA_FILE, ArrayMeta, chunk_count
from pytreeckpt.plan import ChunkingOptions

MAX_COMPRESSION_RATIO = 1 << 16
"""The most a compressed array's metadata may claim over its stored bytes (all-zero
chunks compress about 13,000 times with zstd)."""


MISSING_CHUNKS = 4096
"""How many more chunks than are present an array's grid may have before it is refused
whole (fewer are reported chunk by chunk as they are read): loops over a grid stay
bounded by the chunks actually stored."""


class Lock:
    """A held writer lock; ``release()`` (or process exit) frees it. A place without locks gives one holding nothing."""

    def release(self) -> None:
        pass


class Place(abc.ABC):
    """A checkpoint's location as the storage code sees it: one method per operation whose way differs."""

    url: str
    has_files: bool
    """Whether arrays are files this package may read and write itself (and pack in zip archives)."""
    default_chunking: ChunkingOptions
    """How arrays are chunked here when neither the caller nor the location's options say."""
    made_root = False
    """Whether a save through this object made the place itself (a directory: removed again if it fails)."""

    # ------------------------------------------------------------------ commit protocol
    @abc.abstractmethod
    def is_committed(self) -> bool:
        """Whether a metadata document is stored here."""

    @abc.abstractmethod
    def lock(self) -> Lock:
        """The writer lock, waited for a moment, or a CheckpointError (see ``Storage.lock``)."""

    @abc.abstractmethod
    def try_lock(self) -> Lock | None:
        """The writer lock if it is free now, else None (see ``Storage.try_lock``)."""

    @abc.abstractmethod
    def check_writable(self, overwrite: bool) -> None:
        """Raise if a save here would be refused: a committed checkpoint (unless ``overwrite``), or
        something that is not a checkpoint."""

    @abc.abstractmethod
    def make_ready(self) -> None:
        """Before a save writes: what a killed commit left half written is removed and the arrays'
        folder made, where the place has folders."""

    @abc.abstractmethod
    def write_document(self, body: bytes | bytearray | memoryview, tail: bytes) -> None:
        """Store the metadata document (``body`` then ``tail``) whole and durable, in one step a reader sees
        either before or after."""

    @abc.abstractmethod
    def write_checksums(self, name: str, data: bytes) -> None:
        """Store the checksums file ``name``, durable before the document naming it is written."""

    @abc.abstractmethod
    def read_checksums(self, name: str, start: int, stop: int) -> bytes:
        """Bytes ``start`` to ``stop`` of the checksums file ``name`` (fewer where it ends)."""

    @abc.abstractmethod
    def committed_document(self) -> bytes | None:
        """The committed document's bytes; None if none is committed; :class:`Unreadable` raised if it is there
        but cannot be read (then nothing may be deleted)."""

    @abc.abstractmethod
    def stored_names(self, refuse_links: bool) -> set[str]:
        """The arrays, databases and checksums files present (``arrays/<name>``, ``ocdbt/<name>``, ...)."""

    @abc.abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Delete the stored arrays, databases and checksums files ``names``."""

    @abc.abstractmethod
    def after_failure(self, committed: bool) -> None:
        """After a failed save, once what it wrote is deleted: leave the place as the save found it."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Delete the whole checkpoint, its document first."""

    @abc.abstractmethod
    def read_metadata(self, limit: int) -> bytes:
        """The metadata document, refused with a MetadataError past ``limit`` bytes (checked before reading),
        a NotCommittedError where there is none."""

    # ------------------------------------------------------------------ checks before a read
    @abc.abstractmethod
    def check_inside(self, where: str, key: str) -> None:
        """Before an array or database ``where`` is opened: refuse one that leads outside the checkpoint."""

    @abc.abstractmethod
    def check_files(self, where: str, key: str) -> None:
        """Check the files of array or database ``where`` before anything reads them (leaf ``key``)."""

    @abc.abstractmethod
    def check_chunks_stored(self, meta: ArrayMeta) -> None:
        """Refuse an array of its own whose metadata claims more than is stored (a MetadataError)."""

    @abc.abstractmethod
    def stored_bytes(self, meta: ArrayMeta) -> int | None:
        """Bytes of the chunk files of an array of its own; None where the place cannot tell."""

    # ------------------------------------------------------------------ durability
    @abc.abstractmethod
    def note_chunks(self, meta: ArrayMeta, region: Region) -> None:
        """Remember the chunks a write of ``region`` (whole chunks) of ``meta`` made, to make them durable."""

    @abc.abstractmethod
    def note_array(self, meta: ArrayMeta) -> None:
        """Remember that array ``meta`` (its ``zarr.json``, or its database) was made, to make it durable."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every write noted since the last call durable."""

    @abc.abstractmethod
    def link_chunk(self, base: Any, base_path: str, path: str, index: tuple[int, ...]) -> bool:
        """Hard-link chunk ``index`` of the base checkpoint's array into this one; False where it cannot."""


class Unreadable(Exception):
    """What :meth:`Place.committed_document` raises for a document that is there but cannot be read."""


def check_chunk_count(meta: ArrayMeta, present: int, where: str) -> None:
    """Refuse an array whose chunk grid is more than :data:`MISSING_CHUNKS` larger than the ``present`` chunks."""
    expected = chunk_count(meta.shape, meta.chunk_shape)
    if expected > present + MISSING_CHUNKS:
        raise MetadataError(
            f"leaf {meta.key!r}: the metadata claims a {meta.dtype.name} array of shape {meta.shape} in "
            f"{expected} chunks of {list(meta.chunk_shape)} but {where}"
        )


def not_committed(url: str, steps: dict[int, bool], nothing: str) -> NotCommittedError:
    """Why there is no metadata document at ``url``, saying so when it holds a CheckpointManager's ``steps``."""
    committed = sorted(s for s, c in steps.items() if c)
    if committed:
        shown = committed if len(committed) <= 10 else [*committed[:3], "...", *committed[-3:]]
        listed = ", ".join(map(str, shown))
        return NotCommittedError(
            f"{url} is a CheckpointManager directory, not a checkpoint: it holds the committed steps "
            f"[{listed}]; load one with pytreeckpt.load('{url}/step_{committed[-1]}'), or the newest with "
            f"pytreeckpt.CheckpointManager('{url}').restore()"
        )
    if steps:
        return NotCommittedError(
            f"{url} is a CheckpointManager directory with no committed step yet (steps left uncommitted "
            f"by saves that failed or were interrupted: {sorted(steps)[:10]}), not a checkpoint"
        )
    return NotCommittedError(
        f"{url} is not a committed checkpoint (no {METADATA_FILE}); it may be a save that was interrupted{nothing}"
    )
