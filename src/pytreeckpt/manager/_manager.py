"""CheckpointManager: numbered steps in one directory, with retention."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from pytreeckpt.api import SaveHandle, async_save, load, save
from pytreeckpt.core._errors import CheckpointError, NotCommittedError
from pytreeckpt.distributed._comm import distributed_comm as _comm
from pytreeckpt.execute._staging import staging_pool
from pytreeckpt.format import METADATA_FILE, STEP_DIR
from pytreeckpt.storage import LOCK_WAIT, Location, Storage, Where, describe, remove_tree, resolve

__all__ = ["CheckpointManager"]

logger = logging.getLogger("pytreeckpt")

_TRASH = ".pytreeckpt-removing-"
"""A step directory being deleted is first renamed to this prefix (atomically: it is never half there)."""
_RESTORE_ATTEMPTS = 4


def check_step(step: Any) -> int:
    """``step`` as an int if it is a non-negative integer (numpy integers too), else a CheckpointError."""
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"a step is a non-negative integer, found {step!r} ({type(step).__name__})")
    return int(step)


class CheckpointManager:
    """Saves numbered steps under one directory and keeps the ones worth keeping.

    Each step, a non-negative integer, is a checkpoint at ``directory/step_<n>``.
    Retention runs only once a save has committed: the newest ``max_to_keep`` committed
    steps are kept, and so is every step divisible by ``keep_every_n_steps``. With
    ``incremental=True`` each save writes only the chunks that changed since the newest
    step and hard-links the others from it (see ``base`` in :func:`pytreeckpt.save`), so
    retention may delete any step. A failed save removes what it wrote; directories of
    saves that never committed (a crash) are never listed or restored, and are removed,
    once no writer holds them, by every save and by the next manager (one that may only
    read the directory leaves them: listing and restoring need no write access). Several managers
    (processes) may share one local directory: a step is removed by renaming it away
    under its lock, and steps another manager removes meanwhile are skipped. On an object
    store (``s3://bucket/run``, or a :class:`Location`) there are no locks: an
    uncommitted step is removed only when it is older than the newest committed one, and
    one manager (one writer) per directory is the caller's responsibility.
    In a distributed program every rank makes the manager and calls its methods; rank 0
    lists and deletes, and the ranks agree on its answers.

    >>> import tempfile, torch
    >>> with CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as m:
    ...     for step in range(1, 5):
    ...         _ = m.save(step, {"w": torch.full((2,), float(step))})
    ...     m.wait()
    ...     m.all_steps(), m.restore()["w"]
    ([3, 4], tensor([4., 4.]))
    """

    def __init__(
        self,
        directory: Where,
        *,
        max_to_keep: int | None = None,
        keep_every_n_steps: int | None = None,
        save_interval_steps: int = 1,
        async_: bool = True,
        process_group: Any = None,
        incremental: bool = False,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, found {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be at least 1, found {save_interval_steps}")
        self._where = resolve(directory)
        self.directory: Path | str = self._where.path if self._where.path is not None else self._where.url
        self._kv = None if self._where.is_local else Storage(directory).kv
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self.save_interval_steps = save_interval_steps
        self.async_ = async_
        self.incremental = incremental
        self._process_group = process_group
        self._comm = _comm(process_group)
        self._handle: SaveHandle | None = None
        self._closed = False
        if self._is_leader:
            if isinstance(self.directory, Path):
                self.directory.mkdir(parents=True, exist_ok=True)
            self._clean_uncommitted(may_fail=True)  # (a manager that only restores may have no write access)

    # ------------------------------------------------------------------ paths and listing
    @property
    def _is_leader(self) -> bool:
        return self._comm is None or self._comm.rank == 0

    def _agree(self, value: Any) -> Any:
        return value if self._comm is None else self._comm.broadcast(value)

    def step_path(self, step: int) -> Path | Location:
        """Where ``step`` is (or would be) stored: a directory, or a Location on a key-value store."""
        step = check_step(step)
        if isinstance(self.directory, Path):
            return self.directory / f"step_{step}"
        return self._location(f"step_{step}")

    def _location(self, name: str) -> Location:
        """A step's location with the directory's storage options (local or not)."""
        r = self._where.child(name)
        return Location(r.path if r.path is not None else r.spec or {}, r.options)

    def _listed(self) -> list[tuple[int, Path | Location, bool]]:
        out: list[tuple[int, Path | Location, bool]] = []
        if self._kv is not None:
            keys = set(self._kv.list())
            steps = {k.split("/", 1)[0] for k in keys if "/" in k}
            for name in steps:
                m = STEP_DIR.match(name)
                if m:
                    out.append((int(m.group(1)), self._location(name), f"{name}/{METADATA_FILE}" in keys))
            return sorted(out, key=lambda e: e[0])
        if isinstance(self.directory, Path) and self.directory.is_dir():
            for p in self.directory.iterdir():  # entries vanishing meanwhile (another manager) read as absent
                m = STEP_DIR.match(p.name)
                if m and p.is_dir():
                    out.append((int(m.group(1)), p, Storage(p).is_committed()))
        return sorted(out, key=lambda e: (e[0], str(e[1])))

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        steps = [s for s, _, committed in self._listed() if committed] if self._is_leader else None
        return list(self._agree(steps))

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, tree: Any, spec: Any = None, *, force: bool = False, **kwargs: Any) -> bool:
        """Save ``tree`` as ``step``; returns False (and saves nothing) off the save interval.

        ``force`` saves off the interval and replaces a committed step of the same
        number (which stays loadable until the new one commits); otherwise saving a step
        that exists is an error. Other keyword arguments go to :func:`pytreeckpt.save`.
        With ``async_`` the call returns after the snapshot; a failure of that save (which
        removes what it wrote) is raised by the next call that waits for it (``save``,
        ``wait``, ``restore``, ``delete``, ``close``), and the manager carries on from there.
        """
        self._check_open()
        step = check_step(step)
        if not force and step % self.save_interval_steps != 0:
            return False
        self._finish_in_flight()
        if not force and step in self.all_steps():
            raise CheckpointError(f"step {step} is already saved in {self.directory}; pass force=True to replace it")
        if self._is_leader:
            self._clean_uncommitted()  # a crashed save's leftovers take no room from this one
        path = self._location(f"step_{step}")
        kwargs.setdefault("process_group", self._process_group)
        if self.incremental:
            # unchanged chunks are hard-linked from the newest step: each step stays whole on its own
            kwargs.setdefault("chunk_hashes", True)
            latest = self.latest_step()
            local = isinstance(self.directory, Path)  # object stores have no links: every chunk is written
            if local and latest is not None and latest != step and "base" not in kwargs:
                kwargs["base"] = self.step_path(latest)
        if self.async_:
            self._handle = async_save(path, tree, spec, overwrite=force, **kwargs)
        else:
            save(path, tree, spec, overwrite=force, **kwargs)
            self._apply_retention()
        return True

    def _finish_in_flight(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.wait()
            self._apply_retention()

    def wait(self) -> None:
        """Block until the save in flight has committed (and retention has run)."""
        self._finish_in_flight()

    # ------------------------------------------------------------------ retention
    def _apply_retention(self) -> None:
        if not self._is_leader:
            return
        committed = [s for s, _, c in self._listed() if c]
        keep = set(committed[-self.max_to_keep :]) if self.max_to_keep is not None else set(committed)
        if self.keep_every_n_steps:
            keep |= {s for s in committed if s % self.keep_every_n_steps == 0}
        for s in committed:
            if s not in keep:
                self._remove(s)

    def _remove(self, step: int) -> bool:
        """Remove a committed step; False if it was skipped (a save is replacing it, or it is gone already)."""
        path = self.step_path(step)
        if not isinstance(path, Path):
            Storage(path).remove()
            return True
        return _discard(path, committed=True)

    def _remove_soon(self, step: int) -> bool:
        """Remove a committed step, waiting a moment for a lock held briefly (another manager removing a step)."""
        deadline = time.monotonic() + LOCK_WAIT
        while not self._remove(step):
            if time.monotonic() > deadline or step not in [s for s, _, c in self._listed() if c]:
                return False
            time.sleep(0.01)
        return True

    def _clean_uncommitted(self, may_fail: bool = False) -> None:
        """Remove what crashed saves and removals left; with ``may_fail``, what cannot be removed (a directory
        this process may only read) is left for the next save."""

        def attempt(remove: Callable[[], object], what: Path | Location) -> None:
            try:
                remove()
            except (CheckpointError, OSError) as e:
                if not may_fail:
                    raise
                logger.info("%s: left for the next save to remove: %s", describe(what), e)

        listed = self._listed()
        newest = max((s for s, _, c in listed if c), default=None)
        for step, path, committed in listed:
            if committed:
                continue
            if not isinstance(path, Path):
                # No lock tells a crashed save from one in progress: only steps older than
                # the newest commit are taken as crashed.
                if newest is not None and step < newest:
                    attempt(Storage(path).remove, path)
                continue
            attempt(functools.partial(_discard, path, committed=False), path)  # skipped while a save is writing it
        if isinstance(self.directory, Path):  # removals a crash interrupted
            with contextlib.suppress(FileNotFoundError):
                for p in self.directory.iterdir():
                    if p.name.startswith(_TRASH):
                        attempt(functools.partial(remove_tree, p), p)

    def delete(self, step: int) -> None:
        """Delete a committed step."""
        self._check_open()
        step = check_step(step)
        self._finish_in_flight()
        if step not in self.all_steps():
            raise NotCommittedError(f"step {step} is not a committed checkpoint in {self.directory}")
        removed = self._remove_soon(step) if self._is_leader else None
        if not self._agree(removed) and step in self.all_steps():
            raise CheckpointError(f"step {step} in {self.directory} is being written by a save right now")

    # ------------------------------------------------------------------ restore
    def restore(self, step: int | None = None, target: Any = None, **kwargs: Any) -> Any:
        """Load ``step`` (the latest committed when None) into ``target`` (see :func:`pytreeckpt.load`).

        The latest step removed while it is being loaded (by another manager's retention)
        gives way to the latest one then.
        """
        self._check_open()
        if step is not None:
            step = check_step(step)
        self._finish_in_flight()
        kwargs.setdefault("process_group", self._process_group)
        if step is not None:
            return load(self._location(f"step_{step}"), target, **kwargs)
        attempts = 0
        while True:
            latest = self.latest_step()
            if latest is None:
                raise NotCommittedError(f"no committed checkpoint in {self.directory}")
            try:
                return load(self._location(f"step_{latest}"), target, **kwargs)
            except NotCommittedError:
                attempts += 1
                if attempts == _RESTORE_ATTEMPTS or latest in self.all_steps():
                    raise

    def metadata_of(self, step: int) -> Mapping[str, Any]:
        """The user metadata stored with ``step``."""
        from pytreeckpt.api import metadata

        return metadata(self._location(f"step_{check_step(step)}")).user_metadata

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.directory} is closed")

    def close(self) -> None:
        """Finish the save in flight and free the staging memory; the manager cannot be used afterwards."""
        if not self._closed:
            self._finish_in_flight()
            self._closed = True
            staging_pool().free()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, max_to_keep={self.max_to_keep})"


def _discard(path: Path, committed: bool) -> bool:
    """Remove the step directory ``path`` if no save holds it and it is (un)committed as expected.

    It is renamed away first, under its lock, so it vanishes at once and whole (a crash
    midway leaves no half checkpoint), and the lock is held only for that instant; then
    it is deleted. False if it was skipped: a save holds it, it is gone already, or it
    changed meanwhile (another manager saved or removed it).
    """
    storage = Storage(path)
    lock = storage.try_lock()
    if lock is None:
        return False
    try:
        if storage.is_committed() != committed:
            return False
        trash = path.parent / f"{_TRASH}{path.name}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return False
    finally:
        lock.release()
    remove_tree(trash)
    return True
