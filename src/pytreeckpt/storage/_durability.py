"""Durability: every file and directory a save makes is fsynced before the commit."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.format import (
    ArrayMeta,
)
from pytreeckpt.storage._base import StorageBase, _chunk_key, background_nice
from pytreeckpt.storage._chunkfiles import lower_priority, make_dirs

logger = logging.getLogger("pytreeckpt")


class Durability(StorageBase):
    """Remembers what was written without fsync, and makes it durable in :meth:`sync`."""

    def note_chunks(self, meta: ArrayMeta, region: Region) -> None:
        """Remember the chunk files a write of ``region`` (whole chunks) creates, to fsync them."""
        if self.kv is not None:
            return
        if meta.database is not None:
            self._unsynced_trees.add(meta.database)
            return
        array = self.root / meta.path
        self._unsynced.update(
            array / _chunk_key(index) for index in ChunkGrid(meta.shape, meta.chunk_shape).touching(region)
        )

    def sync(self) -> None:
        """fsync every file written since the last call, and the directories holding them, in parallel.

        Directories from each file up to the checkpoint root are synced (the commit syncs
        the root itself), so new names are durable too. Packed arrays' keys still in an
        OCDBT transaction are committed first.
        """
        if self._packed is not None:
            self._packed.commit()
        files = set(self._unsynced)
        for tree in self._unsynced_trees:
            for dirpath, _, names in os.walk(self.root / tree):
                files.update(Path(dirpath) / n for n in names)
                files.add(Path(dirpath))
        self._unsynced.clear()
        self._unsynced_trees.clear()
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

    def link_chunk(self, base: Path, base_path: str, path: str, index: tuple[int, ...]) -> bool:
        """Hard-link chunk ``index`` of the base checkpoint's array into this one; False where links fail.

        Only local directories have links; packed arrays live in a database, not in files.
        """
        if self.kv is not None:
            return False
        key = _chunk_key(index)
        src = base / base_path / key
        dst = self.root / path / key
        try:
            if dst.parent not in self._made_dirs:  # (made without following a link: a link there is an error)
                make_dirs(self.root, dst.parent, f"the array {path!r}")
                self._made_dirs.add(dst.parent)
            os.link(src, dst)
        except OSError:
            return False
        self._unsynced.add(dst)  # its directory entry is new
        return True


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
