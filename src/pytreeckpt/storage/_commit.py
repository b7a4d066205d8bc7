"""The commit protocol: one writer per checkpoint, a new checkpoint beside the committed one,
the metadata document written atomically last, and what a failed save wrote removed."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import stat
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pytreeckpt.core._errors import CheckpointError, MetadataError, NotCommittedError
from pytreeckpt.format import (
    ARRAYS_DIR,
    CHECKSUMS_DIR,
    LOCK_FILE,
    METADATA_FILE,
    STEP_DIR,
    STORED_DIRS,
    generation_of,
    seal_document,
)
from pytreeckpt.storage._base import StorageBase, _os_failure
from pytreeckpt.storage._chunkfiles import NEW_FILE, make_dirs, no_link, open_regular
from pytreeckpt.storage._durability import _fsync

logger = logging.getLogger("pytreeckpt")


LOCK_WAIT = 1.0
"""Seconds a save waits for a checkpoint's lock held by another process before refusing."""

MAX_GENERATION = 999_999_999
"""The largest generation a stored name may have: the reader takes at most 9 digits after ``~g``."""


class CommitProtocol(StorageBase):
    """Locks, prepares, commits, abandons and removes checkpoints; reads the committed document."""

    # ------------------------------------------------------------------ commit protocol
    @property
    def metadata_path(self) -> Path:
        return self.root / METADATA_FILE

    def is_committed(self) -> bool:
        if self.kv is not None:
            return self.kv.read(METADATA_FILE) is not None
        return self.metadata_path.is_file()

    def lock(self) -> _Lock:
        """Take the directory's writer lock, or raise: one save at a time per checkpoint path.

        The lock is an ``flock`` on a file inside the directory, so the kernel releases it
        when its holder dies: a crashed save never blocks the next one. A lock held for a
        moment only (a CheckpointManager removing the directory) is waited for, up to
        ``LOCK_WAIT`` seconds; a lock file whose directory its holder removed is no lock,
        and the directory is made again. A key-value store has no such lock: there the lock
        is a no-op and one writer per prefix is the caller's responsibility.
        """
        if self.kv is not None:
            return _Lock(None)
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            self._make_root()
            held = self.try_lock()
            if held is not None:
                return held
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"another process is saving to {self.root} right now; two saves to one path cannot run at once"
                )
            time.sleep(0.01)

    def try_lock(self) -> _Lock | None:
        """The writer lock if it is free now; None if a writer holds it or the directory is gone.

        It never makes the directory: it is how a directory is locked to be removed. A lock
        file that is a symbolic link (dangling or not) or not a regular file is refused, never
        followed: the lock is never made or opened outside the checkpoint.
        """
        if self.kv is not None:
            return _Lock(None)
        path = self.root / LOCK_FILE
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            linked = no_link(path, "the writer's lock") if e.errno == errno.ELOOP else None
            raise linked or CheckpointError(f"cannot write a checkpoint at {self.root}: {e}") from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"the writer's lock: {path} is not a regular file; refused")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        # The holder before us may have removed the lock file with its directory; this lock
        # then guards nothing (a new directory with a new lock file may exist by now).
        try:
            here, mine = os.stat(path), os.fstat(fd)
            same = (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)
        except OSError:
            same = False
        if not same:
            os.close(fd)
            return None
        return _Lock(fd)

    def _make_root(self) -> None:
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(self.root)  # 0o777 less the umask, as any directory the user makes
        except FileExistsError:
            if not self.root.is_dir():
                raise CheckpointError(f"{self.root} exists and is not a directory") from None
            return
        except OSError as e:
            raise CheckpointError(f"cannot write a checkpoint at {self.root}: {e}") from e
        self._made_root = True

    def check_writable(self, overwrite: bool) -> None:
        """Raise now, before any work, if a save here would be refused."""
        if self.kv is not None:
            self.kv.check_reachable()
            keys = self.kv.list()
            if METADATA_FILE in keys and not overwrite:
                raise CheckpointError(
                    f"{self.url} already holds a committed checkpoint; pass overwrite=True to replace it"
                )
            unknown = [k for k in keys if k != METADATA_FILE and k.split("/")[0] not in STORED_DIRS]
            if unknown:
                raise CheckpointError(
                    f"{self.url} is not empty and is not a pytreeckpt checkpoint (it holds {unknown[:5]}); "
                    f"refusing to write into it"
                )
            return
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(f"{self.root} exists and is not a directory")
        if self.is_committed() and not overwrite:
            raise CheckpointError(
                f"{self.root} already holds a committed checkpoint; pass overwrite=True to replace it"
            )
        if self.root.is_dir():
            known = {*STORED_DIRS, METADATA_FILE, LOCK_FILE}
            unknown = [p.name for p in self.root.iterdir() if p.name not in known and not p.name.startswith(".tmp-")]
            if unknown:
                raise CheckpointError(
                    f"{self.root} is not empty and is not a pytreeckpt checkpoint (it holds {sorted(unknown)[:5]}); "
                    f"refusing to write into it"
                )

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
            stored = self._stored_names()
            if self._kept is not None:
                self._delete(stored - self._kept)
                stored &= self._kept
            if self.kv is None:
                self._remove_temporaries()
                make_dirs(self.root, self.root / ARRAYS_DIR, f"the checkpoint {self.root}")
        except OSError as e:
            raise CheckpointError(f"cannot prepare {self.url} for a new checkpoint: {e}") from e
        return next_generation(stored)

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

        Locally: a temporary file (made with the mode the umask gives, as any file the user
        makes), fsync, rename over the old document, fsync of the directory. On a
        key-value store: one PUT of the whole document, after every array write has
        finished. A checkpoint this one replaces stays whole and loadable until that
        instant; then its arrays are deleted (a failure to delete them is logged, and the
        next save reclaims them).
        """
        if checksums is not None:
            self._write_checksums(*checksums)
        body, tail = seal_document(document)  # (ending in its checksum: a damaged document is refused)
        if self.kv is not None:
            self.kv.write(METADATA_FILE, b"".join((body, tail)))
        else:
            try:
                tmp = self.root / f".tmp-{os.getpid()}-{secrets.token_hex(8)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                try:
                    _write_synced(fd, body, tail)
                    os.replace(tmp, self.metadata_path)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                _fsync(self.root)
            except OSError as e:
                raise CheckpointError(f"cannot commit the checkpoint at {self.root}: {e}") from e
        try:
            self._delete(self._unreferenced(_referenced(document) if names is None else names))
        except Exception as e:  # committed all the same: the next save reclaims them
            logger.warning("%s: committed, but the arrays it replaced could not all be deleted: %s", self.url, e)

    def _write_checksums(self, name: str, data: bytes) -> None:
        """The checksums file the document will name, durable before the document is (a name of this
        save's generation: nothing committed uses it)."""
        if self.kv is not None:
            self.kv.write(name, data)
            return
        path = self.root / name
        try:
            make_dirs(self.root, path.parent, "the chunk checksums")
            _write_synced(os.open(path, NEW_FILE, 0o666), data)  # (a link in its place: an error, not followed)
            _fsync(path.parent)
            _fsync(self.root)
        except OSError as e:
            raise CheckpointError(f"cannot write the chunk checksums {path}: {e}") from e

    def read_checksums(self, name: str, start: int, stop: int) -> bytes:
        """Bytes ``start`` to ``stop`` of the checksums file ``name`` (fewer where it ends): what a
        :class:`~pytreeckpt.format.ChecksumFile` reads through."""
        if self.kv is not None:
            got = self.kv.read_range(name, start, stop)
            if got is None:
                raise CheckpointError(f"{self.url}: the chunk checksums {name!r} the metadata names are missing")
            return got
        what = f"the chunk checksums {name!r}"
        try:
            path = self._check_inside(self.root / name, name, what)
            fd, _ = open_regular(path, self._real_root(), what)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(f"{self.root}: {what} the metadata names are missing") from None
        try:
            out = []
            while start < stop:
                got = os.pread(fd, stop - start, start)
                if not got:
                    break
                out.append(got)
                start += len(got)
            return b"".join(out)
        except OSError as e:
            raise CheckpointError(f"{self.root}: cannot read {what}: {e}") from e
        finally:
            os.close(fd)

    def abandon(self) -> None:
        """After a failed save: remove what it wrote, keeping all that a committed document references.

        The checkpoint the save was to replace stays whole (and so does the new one, if
        the failure came after its document was renamed into place). A directory the save
        made is removed. Errors here are logged: the save's own failure is what is reported.
        """
        if self._packed is not None:
            self._packed.abort()
        if not (self._prepared or self._made_root):
            return
        try:
            now = self._committed_names()
            keep = None if self._kept is None or now is None else self._kept | now
            self._delete(self._unreferenced(keep))
            if self.kv is None:
                self._remove_temporaries()
                if not self.is_committed():  # the directory is left as the save found it, or removed if it made it
                    for top in STORED_DIRS:
                        with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # (a link: left alone)
                            (self.root / top).rmdir()
                    (self.root / LOCK_FILE).unlink(missing_ok=True)  # a writer waiting on it sees it gone
                    if self._made_root:
                        self.root.rmdir()
        except Exception as e:
            logger.warning("%s: the save failed and what it wrote could not all be removed: %s", self.url, e)

    def remove(self) -> None:
        """Delete the checkpoint: its commit first, so a crash midway leaves no half checkpoint.

        Parts already gone (another process removing it too) are no error.
        """
        if self.kv is not None:
            self.kv.delete(METADATA_FILE)
            self.kv.delete_prefix("")
            return
        self.metadata_path.unlink(missing_ok=True)
        remove_tree(self.root)

    def _committed_names(self) -> frozenset[str] | None:
        """The arrays and databases the committed document uses; empty if none is committed, None if unreadable.

        Locally the document is read only as a regular file inside the checkpoint: a FIFO,
        device or link out of it is not read (nor waited on) but unreadable, so all is kept.
        """
        if self.kv is not None:
            raw = self.kv.read(METADATA_FILE)
        else:
            try:
                fd, _ = open_regular(self.metadata_path, self._real_root(), "the metadata document")
            except (FileNotFoundError, NotADirectoryError):
                return frozenset()
            except CheckpointError:
                return None
            try:
                with os.fdopen(fd, "rb") as f:
                    raw = f.read()
            except OSError:
                return None
        return frozenset() if raw is None else _referenced(raw)

    def _stored_names(self, refuse_links: bool = True) -> set[str]:
        """The arrays and databases present: ``arrays/<name>``, ``ocdbt/<name>`` and ``packed/<name>``.

        A top-level directory that is a symbolic link is never listed through (its contents
        would be deleted and written outside the checkpoint): a CheckpointError, or with
        ``refuse_links`` False (cleaning up after a save) left out.
        """
        out: set[str] = set()
        if self.kv is not None:
            for key in self.kv.list():
                parts = key.split("/")
                if len(parts) > 1 and parts[0] in STORED_DIRS:
                    out.add(f"{parts[0]}/{parts[1]}")
            return out
        for top in STORED_DIRS:
            linked = no_link(self.root / top, f"the checkpoint {self.root}")
            if linked is not None:
                if refuse_links:
                    raise linked
                continue
            try:
                out.update(f"{top}/{name}" for name in os.listdir(self.root / top))
            except (FileNotFoundError, NotADirectoryError):
                continue
        return out

    def _unreferenced(self, keep: frozenset[str] | None) -> set[str]:
        """What is stored and not in ``keep``; nothing when ``keep`` is unknown."""
        return set() if keep is None else self._stored_names(refuse_links=False) - keep

    def _delete(self, names: Iterable[str]) -> None:
        for name in sorted(names):
            if self.kv is not None:
                self.kv.delete_prefix(name + "/")
                if name.startswith(CHECKSUMS_DIR + "/"):  # (a file, not a prefix)
                    self.kv.delete(name)
            else:
                remove_tree(self.root / name)

    def _remove_temporaries(self) -> None:
        """Metadata documents a killed commit left half written, and anything else under a ``.tmp-`` name
        (only under the lock): a directory as a tree, a link as the link itself."""
        for p in self.root.iterdir():
            if p.name.startswith(".tmp-"):
                remove_tree(p)

    def read_metadata(self) -> bytes:
        """The metadata document, read only if it is at most ``max_metadata_bytes`` (checked before reading)."""
        limit = self.location.options.max_metadata_bytes
        if self.kv is not None:
            if self.kv.longer_than(METADATA_FILE, limit):
                raise MetadataError(
                    f"{self.url}/{METADATA_FILE} holds more than {limit} bytes, the limit on a metadata document "
                    f"(StorageOptions(max_metadata_bytes=...) raises it); refusing to read it"
                )
            raw = self.kv.read(METADATA_FILE)
            if raw is None:
                self.kv.check_reachable()  # a missing bucket reads as a missing object: say which it is
                raise self._not_committed()
            return raw
        try:
            fd, st = open_regular(self.metadata_path, self._real_root(), "the metadata document")
        except (FileNotFoundError, NotADirectoryError) as e:  # also a checkpoint replaced or removed meanwhile
            raise self._not_committed() from e
        try:
            if st.st_size > limit:
                raise MetadataError(
                    f"{self.metadata_path} holds {st.st_size} bytes, more than the limit of {limit} on a metadata "
                    f"document (StorageOptions(max_metadata_bytes=...) raises it); refusing to read it"
                )
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(limit + 1)
        except OSError as e:
            raise _os_failure(e, self.metadata_path, "the metadata document", "read") from e
        finally:
            os.close(fd)
        if len(raw) > limit:
            raise MetadataError(f"{self.metadata_path} grew past the limit of {limit} bytes while it was read")
        return raw

    def _not_committed(self) -> NotCommittedError:
        """Why there is no metadata document here, saying so when this is a CheckpointManager's directory."""
        if self.kv is None and not self.root.is_dir():
            return NotCommittedError(f"{self.root} does not exist or is not a directory")
        steps: dict[int, bool] = {}  # step -> committed
        if self.kv is not None:
            for key in self.kv.list("step_"):
                name, _, rest = key.partition("/")
                m = STEP_DIR.match(name)
                if m:
                    steps[int(m.group(1))] = steps.get(int(m.group(1)), False) or rest == METADATA_FILE
        else:
            with contextlib.suppress(OSError):
                for entry in os.scandir(self.root):
                    m = STEP_DIR.match(entry.name)
                    if m and entry.is_dir():
                        steps[int(m.group(1))] = os.path.isfile(os.path.join(entry.path, METADATA_FILE))
        committed = sorted(s for s, c in steps.items() if c)
        if committed:
            shown = committed if len(committed) <= 10 else [*committed[:3], "...", *committed[-3:]]
            listed = ", ".join(map(str, shown))
            return NotCommittedError(
                f"{self.url} is a CheckpointManager directory, not a checkpoint: it holds the committed steps "
                f"[{listed}]; load one with pytreeckpt.load('{self.url}/step_{committed[-1]}'), or the newest with "
                f"pytreeckpt.CheckpointManager('{self.url}').restore()"
            )
        if steps:
            return NotCommittedError(
                f"{self.url} is a CheckpointManager directory with no committed step yet (steps left uncommitted "
                f"by saves that failed or were interrupted: {sorted(steps)[:10]}), not a checkpoint"
            )
        return NotCommittedError(
            f"{self.url} is not a committed checkpoint (no {METADATA_FILE}); it may be a save that was interrupted"
            + ("" if self.kv is None else ", or nothing at all")
        )


class _Lock:
    """A held writer lock; ``release()`` (or process exit) frees it."""

    def __init__(self, fd: int | None) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


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


def _write_synced(fd: int, *data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` (its parts one after the other) to the new file open at ``fd`` (closed after), and make
    it durable."""
    with os.fdopen(fd, "wb") as f:
        for part in data:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())


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


def remove_tree(path: Path) -> None:
    """Delete a file or a directory tree; parts vanishing meanwhile (another process removing them) are no error."""

    def vanished(_func: Any, _path: Any, exc: Any) -> None:
        error = exc if isinstance(exc, BaseException) else exc[1]
        if not isinstance(error, FileNotFoundError):
            raise error

    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        elif sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=vanished)
        else:
            shutil.rmtree(path, onerror=vanished)
    except FileNotFoundError:
        pass
