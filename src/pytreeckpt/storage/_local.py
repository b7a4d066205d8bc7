"""A checkpoint in a local directory: the file system's own guarantees (``flock``, rename, fsync), and
files checked before anything opens them (no link out of the checkpoint, nothing but regular files)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pytreeckpt.core._errors import CheckpointError, MetadataError, NotCommittedError
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.format import ARRAYS_DIR, LOCK_FILE, METADATA_FILE, STEP_DIR, STORED_DIRS, ArrayMeta
from pytreeckpt.plan import ChunkingOptions
from pytreeckpt.storage._chunkfiles import NEW_FILE, lower_priority, make_dirs, no_link, open_regular
from pytreeckpt.storage._io import _chunk_key, _os_failure, background_nice
from pytreeckpt.storage._place import (
    MAX_COMPRESSION_RATIO,
    Lock,
    Place,
    Unreadable,
    check_chunk_count,
    not_committed,
)

logger = logging.getLogger("pytreeckpt")

LOCK_WAIT = 1.0
"""Seconds a save waits for a checkpoint's lock held by another process before refusing."""


class LocalDir(Place):
    """A checkpoint directory: what the commit protocol, the checks and durability do on a file system."""

    has_files = True
    default_chunking = ChunkingOptions()

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.url = url
        self.made_root = False
        self._root_real: str | None = None
        self._scanned: dict[str, tuple[int, int]] = {}  # place -> (bytes, chunk files): see scan()
        # Files TensorStore or this package wrote without fsync, and directories whose every
        # file is (OCDBT databases, zip archives): made durable by :meth:`sync`.
        self.unsynced: set[Path] = set()
        self.unsynced_trees: set[str] = set()  # relative to the root
        self.made_dirs: set[Path] = set()

    @property
    def metadata_path(self) -> Path:
        return self.root / METADATA_FILE

    # ------------------------------------------------------------------ paths
    def real_root(self) -> str:
        """The real path of the checkpoint directory (links resolved), computed once."""
        if self._root_real is None:
            try:
                self._root_real = os.path.realpath(self.root, strict=True)
            except FileNotFoundError:
                self._root_real = os.path.realpath(self.root)
            except OSError as e:
                raise _os_failure(e, self.root, "the checkpoint directory", "resolve") from e
        return self._root_real

    def inside(self, path: Path, key: str, what: str | None = None) -> Path:
        """The real path of ``path`` (missing components kept), which must lie inside the checkpoint; errors
        name leaf ``key``, or ``what`` where given."""
        what = f"leaf {key!r}" if what is None else what
        try:
            real = os.path.realpath(path, strict=True)
        except FileNotFoundError:
            real = os.path.realpath(path)
        except OSError as e:
            raise _os_failure(e, path, what, "resolve") from e
        root = self.real_root()
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise CheckpointError(
                f"{what}: {path} leads outside the checkpoint {self.root} (symbolic link to {real}); refused"
            )
        return Path(real)

    def chunk_dir(self, path: Path) -> None:
        """Make the folder ``path`` of chunk files a write puts there, once per save."""
        if path not in self.made_dirs:
            path.mkdir(parents=True, exist_ok=True)
            self.made_dirs.add(path)
            self.unsynced.add(path)  # its new entries; the parents follow in :meth:`sync`

    # ------------------------------------------------------------------ commit protocol
    def is_committed(self) -> bool:
        return self.metadata_path.is_file()

    def lock(self) -> _Lock:
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
        self.made_root = True

    def check_writable(self, overwrite: bool) -> None:
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

    def make_ready(self) -> None:
        self._remove_temporaries()
        make_dirs(self.root, self.root / ARRAYS_DIR, f"the checkpoint {self.root}")

    def write_document(self, body: bytes | bytearray | memoryview, tail: bytes) -> None:
        """A temporary file (made with the mode the umask gives, as any file the user makes), fsync, rename over
        the old document, fsync of the directory."""
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

    def write_checksums(self, name: str, data: bytes) -> None:
        path = self.root / name
        try:
            make_dirs(self.root, path.parent, "the chunk checksums")
            _write_synced(os.open(path, NEW_FILE, 0o666), data)  # (a link in its place: an error, not followed)
            _fsync(path.parent)
            _fsync(self.root)
        except OSError as e:
            raise CheckpointError(f"cannot write the chunk checksums {path}: {e}") from e

    def read_checksums(self, name: str, start: int, stop: int) -> bytes:
        what = f"the chunk checksums {name!r}"
        try:
            path = self.inside(self.root / name, name, what)
            fd, _ = open_regular(path, self.real_root(), what)
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

    def committed_document(self) -> bytes | None:
        """Read only as a regular file inside the checkpoint: a FIFO, device or link out of it is not read (nor
        waited on) but unreadable."""
        try:
            fd, _ = open_regular(self.metadata_path, self.real_root(), "the metadata document")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except CheckpointError as e:
            raise Unreadable from e
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read()
        except OSError as e:
            raise Unreadable from e

    def stored_names(self, refuse_links: bool) -> set[str]:
        """A top-level directory that is a symbolic link is never listed through (its contents would be deleted
        and written outside the checkpoint): a CheckpointError, or with ``refuse_links`` False left out."""
        out: set[str] = set()
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

    def delete(self, names: Iterable[str]) -> None:
        for name in sorted(names):
            remove_tree(self.root / name)

    def _remove_temporaries(self) -> None:
        """Metadata documents a killed commit left half written, and anything else under a ``.tmp-`` name
        (only under the lock): a directory as a tree, a link as the link itself."""
        for p in self.root.iterdir():
            if p.name.startswith(".tmp-"):
                remove_tree(p)

    def after_failure(self, committed: bool) -> None:
        self._remove_temporaries()
        if not committed:  # the directory is left as the save found it, or removed if it made it
            for top in STORED_DIRS:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # (a link: left alone)
                    (self.root / top).rmdir()
            (self.root / LOCK_FILE).unlink(missing_ok=True)  # a writer waiting on it sees it gone
            if self.made_root:
                self.root.rmdir()

    def remove(self) -> None:
        self.metadata_path.unlink(missing_ok=True)
        remove_tree(self.root)

    def read_metadata(self, limit: int) -> bytes:
        try:
            fd, st = open_regular(self.metadata_path, self.real_root(), "the metadata document")
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

    def _not_committed(self) -> CheckpointError:
        if not self.root.is_dir():
            return NotCommittedError(f"{self.root} does not exist or is not a directory")
        steps: dict[int, bool] = {}  # step -> committed
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                m = STEP_DIR.match(entry.name)
                if m and entry.is_dir():
                    steps[int(m.group(1))] = os.path.isfile(os.path.join(entry.path, METADATA_FILE))
        return not_committed(self.url, steps, "")

    # ------------------------------------------------------------------ checks before a read
    def check_inside(self, where: str, key: str) -> None:
        self.inside(self.root / where, key)

    def check_files(self, where: str, key: str) -> None:
        self.scan(where, key)

    def check_chunks_stored(self, meta: ArrayMeta) -> None:
        """Uncompressed chunks (raw bytes and a 4-byte checksum) hold at least the array's size; compressed ones
        at least ``1 / MAX_COMPRESSION_RATIO`` of it; the chunk files present bound the grid."""
        stored, files = self.scan(meta.path, meta.key)
        ratio = 1 if meta.compression is None else MAX_COMPRESSION_RATIO
        if stored * ratio < meta.nbytes:
            raise MetadataError(
                f"leaf {meta.key!r}: the metadata claims a {meta.dtype.name} array of shape {meta.shape} "
                f"({meta.nbytes} bytes) but {meta.path!r} holds only {stored} bytes of chunks"
                + ("" if ratio == 1 else f", more than {ratio} times less than that")
            )
        check_chunk_count(meta, files, f"{meta.path!r} holds {files} chunk files")

    def stored_bytes(self, meta: ArrayMeta) -> int | None:
        return self.scan(meta.path, meta.key)[0]

    def scan(self, where: str, key: str) -> tuple[int, int]:
        """Check the files of one stored array (or OCDBT database) before anything reads them.

        Returns the bytes and the number of its chunk files (files but ``zarr.json``, whose
        bytes are not counted either).
        Refuses, with a CheckpointError naming the leaf and the path: a symbolic link that
        leads outside the checkpoint (links inside it are followed), anything but regular
        files and directories (a FIFO or a device would block or never end a read), a
        directory that cannot be read (permission denied, said as such) and link loops.
        Each place is walked once per Storage.
        """
        if where in self._scanned:
            return self._scanned[where]
        top = self.inside(self.root / where, key)
        total = files = 0
        seen: set[tuple[int, int]] = set()  # directories (device, inode): a link back up is walked once
        with contextlib.suppress(OSError):
            st = os.stat(top)
            seen.add((st.st_dev, st.st_ino))
        todo = [top]
        while todo:
            folder = todo.pop()
            try:
                with os.scandir(folder) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue  # a missing array: its size (0) says so
            except OSError as e:
                raise _os_failure(e, folder, f"leaf {key!r}", "list") from e
            for entry in entries:
                try:
                    if entry.is_symlink():
                        real = self.inside(Path(entry.path), key)
                        st = os.stat(real)
                        path = real
                    else:
                        st = entry.stat(follow_symlinks=False)
                        path = Path(entry.path)
                except FileNotFoundError:
                    continue  # gone since it was listed
                except OSError as e:
                    raise _os_failure(e, Path(entry.path), f"leaf {key!r}", "stat") from e
                if stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        todo.append(path)
                elif stat.S_ISREG(st.st_mode):
                    if entry.name != "zarr.json":
                        total += st.st_size
                        files += 1
                else:
                    raise CheckpointError(
                        f"leaf {key!r}: {entry.path} is not a regular file (a FIFO, device or socket); refused"
                    )
        self._scanned[where] = (total, files)
        return total, files

    # ------------------------------------------------------------------ durability
    def note_chunks(self, meta: ArrayMeta, region: Region) -> None:
        if meta.database is not None:
            self.unsynced_trees.add(meta.database)
            return
        array = self.root / meta.path
        grid = ChunkGrid(meta.shape, meta.chunk_shape)
        self.unsynced.update(array / _chunk_key(index) for index in grid.touching(region))

    def note_array(self, meta: ArrayMeta) -> None:
        if meta.database is None:
            self.unsynced.add(self.root / meta.path / "zarr.json")
        else:
            self.unsynced_trees.add(meta.database)

    def sync(self) -> None:
        """fsync every file written since the last call, and the directories holding them, in parallel.

        Directories from each file up to the checkpoint root are synced (the commit syncs
        the root itself), so new names are durable too.
        """
        files = set(self.unsynced)
        for tree in self.unsynced_trees:
            for dirpath, _, names in os.walk(self.root / tree):
                files.update(Path(dirpath) / n for n in names)
                files.add(Path(dirpath))
        self.unsynced.clear()
        self.unsynced_trees.clear()
        if not files:
            return
        dirs: set[Path] = set()
        for f in files:
            for parent in f.parents:
                if parent == self.root or self.root not in parent.parents:
                    break
                dirs.add(parent)
        targets = sorted(files - dirs) + sorted(dirs, key=lambda d: -len(d.parts))
        errors: list[OSError | None] = [None] * len(targets)
        workers = min(16, len(targets))
        parts = [range(k, len(targets), workers) for k in range(workers)]

        nice = background_nice()
        caller = threading.current_thread()

        def run(part: range) -> None:
            if threading.current_thread() is not caller:
                lower_priority(nice)  # (a save written in the background stays there)
            for j in part:
                errors[j] = _fsync_quietly(targets[j])

        # Plain threads, not concurrent.futures: a save finishing while the interpreter
        # exits may still start threads, but an executor refuses new work then.
        threads = []
        for part in parts[1:]:
            t = threading.Thread(target=run, args=(part,), name="pytreeckpt-fsync", daemon=True)
            try:
                t.start()
            except RuntimeError:  # no new threads at all: this one does the part
                run(part)
                continue
            threads.append(t)
        run(parts[0])
        for t in threads:
            t.join()
        for path, error in zip(targets, errors, strict=True):
            if error is not None:
                raise CheckpointError(f"cannot make {path} durable (fsync): {error}")

    def link_chunk(self, base: Any, base_path: str, path: str, index: tuple[int, ...]) -> bool:
        key = _chunk_key(index)
        src = Path(base) / base_path / key
        dst = self.root / path / key
        try:
            if dst.parent not in self.made_dirs:  # (made without following a link: a link there is an error)
                make_dirs(self.root, dst.parent, f"the array {path!r}")
                self.made_dirs.add(dst.parent)
            os.link(src, dst)
        except OSError:
            return False
        self.unsynced.add(dst)  # its directory entry is new
        return True


class _Lock(Lock):
    """An ``flock`` held on the lock file open at ``fd``."""

    def __init__(self, fd: int | None) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _write_synced(fd: int, *data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` (its parts one after the other) to the new file open at ``fd`` (closed after), and make
    it durable."""
    with os.fdopen(fd, "wb") as f:
        for part in data:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())


def _fsync_quietly(path: Path) -> OSError | None:
    try:
        _fsync(path)
    except OSError as e:
        return e
    return None


def _fsync(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
