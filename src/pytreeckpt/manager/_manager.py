"""CheckpointManager: numbered steps in one directory, with retention."""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import os
import stat
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np

from pytreeckpt.api import SaveHandle, async_save, load, save
from pytreeckpt.core._errors import CheckpointError, NotCommittedError
from pytreeckpt.core._timeout import resolve as resolve_timeout
from pytreeckpt.distributed._comm import DistComm
from pytreeckpt.distributed._comm import distributed_comm as _comm
from pytreeckpt.distributed._vote import vote_max
from pytreeckpt.execute._staging import staging_pool
from pytreeckpt.format import LOCK_FILE, METADATA_FILE, STEP_DIR, STORED_DIRS
from pytreeckpt.storage import LOCK_WAIT, Location, Storage, Where, describe, remove_tree, resolve

from ._fallback import first_that_loads
from ._policy import Deleter, Retention, StepFacts
from ._preempt import Triggers

__all__ = ["CheckpointManager", "CheckpointSkippedWarning"]

logger = logging.getLogger("pytreeckpt")

_TRASH = ".pytreeckpt-removing-"
"""A step directory being deleted is first renamed to this prefix (atomically: it is never half there)."""


_SAVE_NAMES = frozenset({*STORED_DIRS, METADATA_FILE, LOCK_FILE})
"""What a save writes at the top of a step (and temporaries ``.tmp-*``): the names a save's storage accepts in a
directory it writes into."""


class CheckpointSkippedWarning(UserWarning):
    """A save was due but skipped: the previous asynchronous save was still writing (``on_busy="skip"``)."""


def step_of(name: str) -> int | None:
    """The step named ``name`` (a directory, or a key prefix): only ``step_<n>`` exactly as the manager writes it
    (ASCII digits, no leading zero, nothing after them); None for any other name, which is not a step and is left
    alone (``step_007``, ``"step_5\\n"``, ``step_1.tmp``, other digits than ASCII ones)."""
    m = STEP_DIR.match(name)
    if m is None:
        return None
    try:
        step = int(m.group(1))
    except ValueError:  # (more digits than int() takes)
        return None
    return step if f"step_{step}" == name else None


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """The steps' directories in ``directory``, oldest first: directories named by :func:`step_of`. A symbolic
    link, a file or anything else of a step's name is not a step: left alone, never counted nor deleted."""
    out: list[tuple[int, Path]] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                step = step_of(entry.name)
                with contextlib.suppress(OSError):  # (an entry vanishing meanwhile: another manager's)
                    if step is not None and entry.is_dir(follow_symlinks=False):
                        out.append((step, Path(entry.path)))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(out)


def only_a_save_wrote(names: Iterable[str]) -> bool:
    """Whether a directory of these entries holds only what a save writes: uncommitted, it is what a crashed
    save left; anything else in it is foreign, and the directory is left alone."""
    return all(name in _SAVE_NAMES or name.startswith(".tmp-") for name in names)


def check_step(step: Any) -> int:
    """``step`` as an int if it is a non-negative integer (numpy integers too), else a CheckpointError."""
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"a step is a non-negative integer, found {step!r} ({type(step).__name__})")
    return int(step)


def check_on_busy(on_busy: Any) -> None:
    """A ValueError unless ``on_busy`` is ``"wait"`` or ``"skip"``."""
    if on_busy not in ("wait", "skip"):
        raise ValueError(f"on_busy is 'wait' or 'skip', found {on_busy!r}")


class ClosesOnExit(abc.ABC):
    """A manager used in ``with``: closed when the block ends, however it ends."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish what is in flight and release the manager's threads and resources."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class CheckpointManager(ClosesOnExit):
    """Saves numbered steps under one directory and keeps the ones worth keeping.

    Each step, a non-negative integer, is a checkpoint at ``directory/step_<n>``; only
    those names (``n`` as ``str(n)`` writes it) are steps: anything else there
    (``step_007``, a symbolic link, a file, a directory holding files no save writes) is
    left alone, never counted, restored nor deleted, and a step whose name it holds
    cannot be saved.
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

    Retention rules combine: a step kept by any rule is kept, and the newest committed
    step is never deleted. ``keep_best`` keeps the best steps by ``best_fn`` of their
    ``user_metadata`` (``best_mode`` ``"min"`` or ``"max"``); ``keep_period_seconds``
    keeps one step per period (walking from the oldest, a step saved at least that long
    after the previous one kept so; a step's time is when this manager saved it, else
    its metadata file's modification time, and unknown on an object store, which keeps
    it). With either of these and ``max_to_keep=None``, the newest step is the only one
    the count keeps. Deletions run on a thread of their own (a step still vanishes
    whole: renamed away, then deleted); :meth:`wait` and :meth:`close` wait for them, and
    one that fails is logged and asked for again by the next retention.

    ``save_interval_seconds`` adds a save whenever that long passed since the last one
    (rank 0's ``clock`` decides for every rank). ``save_on_signals`` (e.g.
    ``(signal.SIGTERM,)``) installs a handler that only notes the signal and chains to
    the handler installed before it (a Python callable; not ``SIG_DFL``, whose default
    action would end the process before the save, nor ``SIG_IGN``, nor
    ``signal.default_int_handler``, whose ``KeyboardInterrupt`` would). The next
    :meth:`save` on every rank, once any rank got the signal, saves that step whatever
    the intervals, synchronously, and :meth:`reached_preemption` then says to stop.
    Ranks agree at each :meth:`save` (one all-reduce of two integers on the checkpoint's
    own group when either option is on). :meth:`close` restores the previous handlers.
    The handlers need the main thread.

    ``on_busy`` says what a due save does while the previous asynchronous save is still
    writing: ``"wait"`` (the default) waits for it, then saves; ``"skip"`` saves
    nothing for this step, :meth:`save` returns False, and a
    :class:`CheckpointSkippedWarning` names the step skipped and the step still being
    written, with how long ago it started (filter it as any warning). The training loop
    is then never held by a slow store; the next due step tries again (a timed save
    stays due). A save with ``force=True`` and the save after a preemption signal always
    wait. In a distributed program the ranks vote (one all-reduce of one integer, on the
    manager's own gloo group, at a due step while an asynchronous save is in flight): all
    skip if any rank's save is still writing, none otherwise.

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
        save_interval_seconds: float | None = None,
        save_on_signals: Iterable[int] = (),
        keep_best: int | None = None,
        best_fn: Callable[[Mapping[str, Any]], float] | None = None,
        best_mode: str = "min",
        keep_period_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
        timeout: float | None = None,
        on_busy: str = "wait",
    ) -> None:
        """See the class. Also:

        Args:
          on_busy: ``"wait"`` or ``"skip"``: what a due save does while the previous
            asynchronous save is still writing (see the class).
          timeout: seconds any one wait of this manager's saves, restores, votes and
            listings may last for another rank or a store (see :func:`pytreeckpt.save`);
            None: the process-wide default at each call. Past it a
            :class:`CheckpointTimeoutError` names the phase and the ranks that did not come.
          save_interval_seconds: also save when this long passed since the last save
            (or since the manager was made).
          save_on_signals: signals (``signal.SIGTERM``) after which the next save is
            made whatever the intervals, and :meth:`reached_preemption` says to stop.
          keep_best: keep the best this many steps by ``best_fn`` (needs ``best_fn``).
          best_fn: a step's metric from its ``user_metadata``; a step it raises on, or
            returns None, NaN or an infinity for, is not ranked: ``keep_best`` never keeps
            it, so it never displaces a step of a finite metric.
          best_mode: ``"min"`` or ``"max"``: which metric is best.
          keep_period_seconds: keep one step per this many seconds.
          clock: the time in seconds since the epoch (``time.time``; tests inject theirs).

        Raises:
          ValueError: a bad option, or ``save_on_signals`` off the main thread.
        """
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 or None, found {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be at least 1, found {save_interval_steps}")
        if keep_best is not None and (keep_best < 1 or best_fn is None):
            raise ValueError(f"keep_best must be at least 1 and comes with a best_fn, found {keep_best}, {best_fn}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode is 'min' or 'max', found {best_mode!r}")
        check_on_busy(on_busy)
        for name, value in (
            ("save_interval_seconds", save_interval_seconds),
            ("keep_period_seconds", keep_period_seconds),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None, found {value}")
        self._where = resolve(directory)
        self.directory: Path | str = self._where.path if self._where.path is not None else self._where.url
        self._kv = None if self._where.is_local else Storage(directory).kv
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self.save_interval_steps = save_interval_steps
        self.async_ = async_
        self.incremental = incremental
        self._process_group = process_group
        self.timeout = None if timeout is None else resolve_timeout(timeout)
        self._comm = _comm(process_group, self.timeout, "manager")
        if isinstance(self._comm, DistComm):
            self._comm.monitor = None  # (its votes are not a call's: not recorded, nothing grows step by step)
        self._handle: SaveHandle | None = None
        self._handle_step = 0  # the step of the save in flight and when it started (time.monotonic())
        self._handle_started = 0.0
        self.on_busy = on_busy
        self._closed = False
        self.retention = Retention(
            max_to_keep=max_to_keep,
            keep_every_n_steps=keep_every_n_steps,
            keep_best=keep_best,
            best_mode=best_mode,
            keep_period_seconds=keep_period_seconds,
        )
        self.best_fn = best_fn
        self.save_interval_seconds = save_interval_seconds
        self._facts = StepFacts(best_fn, str(self.directory), self.metadata_of, self._metadata_file)
        self._deleter = Deleter(self._remove_soon, str(self.directory))
        self.last_restored_step: int | None = None
        """The step the last :meth:`restore` loaded (after a fallback, the older step it fell back to)."""
        self._triggers = Triggers(save_on_signals, save_interval_seconds, clock, self._comm, self._is_leader)
        if self._is_leader:
            if isinstance(self.directory, Path):
                self.directory.mkdir(parents=True, exist_ok=True)
            self._clean_uncommitted(may_fail=True)  # (a manager that only restores may have no write access)

    # ------------------------------------------------------------------ paths and listing
    @property
    def _is_leader(self) -> bool:
        return self._comm is None or self._comm.rank == 0

    def _agree(self, value: Any) -> Any:
        return value if self._comm is None else self._comm.broadcast(value, 0, "rank 0's view of the steps")

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
        """Every step (only names :func:`step_of` reads), its place, and whether it is committed; oldest first."""
        out: list[tuple[int, Path | Location, bool]] = []
        if self._kv is not None:
            keys = set(self._kv.list())
            for name in {k.split("/", 1)[0] for k in keys if "/" in k}:
                step = step_of(name)
                if step is not None:
                    out.append((step, self._location(name), f"{name}/{METADATA_FILE}" in keys))
            return sorted(out, key=lambda e: e[0])
        if isinstance(self.directory, Path):  # entries vanishing meanwhile (another manager) read as absent
            out += [(step, p, Storage(p).is_committed()) for step, p in step_dirs(self.directory)]
        return out

    def _committed(self) -> list[int]:
        """(rank 0) The committed steps, oldest first, but those retention is deleting on its thread."""
        going = self._deleter.pending()
        return [s for s, _, committed in self._listed() if committed and s not in going]

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (not those retention is deleting on its thread)."""
        return list(self._agree(self._committed() if self._is_leader else None))

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save
    def save(self, step: int, tree: Any, spec: Any = None, *, force: bool = False, **kwargs: Any) -> bool:
        """Save ``tree`` as ``step``; returns False (and saves nothing) when no save is due.

        A save is due on the step interval, when ``save_interval_seconds`` passed since
        the last save, and at the first call after a preemption signal (then it is
        synchronous: the save in flight is waited for, this one is committed before the
        call returns). Call it at every step: off the intervals it costs a comparison,
        or, with ``save_interval_seconds`` or ``save_on_signals`` in a distributed
        program, one small all-reduce. ``force`` saves off the interval and replaces a
        committed step of the same number (which stays loadable until the new one
        commits); otherwise saving a step that exists is an error. Other keyword
        arguments go to :func:`pytreeckpt.save`. With ``async_`` the call returns after
        the snapshot; a failure of that save (which removes what it wrote) is raised by
        the next call that waits for it (``save``, ``wait``, ``restore``, ``delete``,
        ``close``), and the manager carries on from there.
        """
        self._check_open()
        step = check_step(step)
        preempt, timed = self._triggers.due(step)
        if not (force or preempt or timed or step % self.save_interval_steps == 0):
            return False
        if not (force or preempt) and self._skipped(step):
            return False
        self._finish_in_flight()
        taken = self._agree(self._taken(step, force) if self._is_leader else None)
        if taken is not None:
            raise CheckpointError(taken)
        if self._is_leader:
            self._clean_uncommitted()  # a crashed save's leftovers take no room from this one
        path = self._location(f"step_{step}")
        kwargs.setdefault("process_group", self._process_group)
        kwargs.setdefault("timeout", self.timeout)
        if self.incremental:
            # unchanged chunks are hard-linked from the newest step: each step stays whole on its own
            kwargs.setdefault("chunk_hashes", True)
            latest = self.latest_step()
            local = isinstance(self.directory, Path)  # object stores have no links: every chunk is written
            if local and latest is not None and latest != step and "base" not in kwargs:
                kwargs["base"] = self.step_path(latest)
        self._facts.note(step, self._triggers.saved(step, preempt), kwargs.get("user_metadata") or {})
        if self.async_ and not preempt:
            started = time.monotonic()
            self._handle = async_save(path, tree, spec, overwrite=force, **kwargs)
            self._handle_step, self._handle_started = step, started
        else:
            save(path, tree, spec, overwrite=force, **kwargs)
            self._apply_retention()
        if preempt:
            logger.warning("%s: step %d saved for a preemption signal", self.directory, step)
        return True

    def _skipped(self, step: int) -> bool:
        """Whether the due save of ``step`` is skipped, on every rank alike: ``on_busy="skip"`` and the previous
        asynchronous save still writing on some rank (then a :class:`CheckpointSkippedWarning` says so)."""
        handle = self._handle  # (started, and not yet waited for, on every rank alike)
        if self.on_busy != "skip" or handle is None:
            return False
        mine = not handle.done()
        busy = mine
        if self._comm is not None:
            busy = bool(vote_max(self._comm, [mine], f"the vote on skipping step {step}")[0])
        if busy:
            where = "" if mine else " on another rank"
            warnings.warn(
                f"{self.directory}: step {step} is not saved: the asynchronous save of step {self._handle_step}, "
                f"started {time.monotonic() - self._handle_started:.1f} s ago, is still writing{where} "
                f"(on_busy='skip')",
                CheckpointSkippedWarning,
                stacklevel=3,
            )
        return busy

    def _foreign(self, step: int, doing: str) -> str | None:
        """(rank 0) Why step ``step`` cannot be ``doing`` (saved, restored): a foreign thing (a link, a file) holds
        its name; None: nothing does."""
        path = self.step_path(step)
        if not isinstance(path, Path):
            return None
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISDIR(mode):
            return None
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
        return f"{path} is {kind}, not a step this manager wrote; it is left alone, and step {step} is not {doing}"

    def _taken(self, step: int, force: bool) -> str | None:
        """(rank 0) Why ``step`` cannot be saved: its name is held by something foreign (a link, a file), or
        without ``force``, the step is saved already; None: it can be."""
        foreign = self._foreign(step, "saved there (move it away)")
        if foreign is not None:
            return foreign
        if not force and step in self._committed():
            return f"step {step} is already saved in {self.directory}; pass force=True to replace it"
        return None

    @property
    def preemption_step(self) -> int | None:
        """The step saved for a preemption signal, once it is saved."""
        return self._triggers.preemption_step

    def reached_preemption(self, step: int) -> bool:
        """Whether the loop should stop at ``step``: a preemption signal reached some rank and its step is saved.

        True on every rank alike once the step saved for the signal (by :meth:`save`,
        which every rank calls at every step) is ``step`` or older. A signal noted here
        after the ranks agreed at this step's ``save`` is seen by the next ``save``, which
        is then the preemption's; this returns False until then. Called at a step whose
        ``save`` was not called, it looks for a signal itself, with one small all-reduce.
        """
        self._check_open()
        return self._triggers.reached(check_step(step))

    def _finish_in_flight(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.wait()
            self._apply_retention()

    def wait(self) -> None:
        """Block until the save in flight has committed and retention's deletions have run."""
        self._finish_in_flight()
        self._deleter.wait()

    # ------------------------------------------------------------------ retention
    def _apply_retention(self) -> None:
        """Ask the deleter thread to delete the committed steps no rule keeps (rank 0)."""
        if not self._is_leader:
            return
        committed = [s for s, _, c in self._listed() if c]
        facts = self._facts
        metrics = {s: facts.metric(s) for s in committed} if self.retention.keep_best else None
        times = {s: facts.time(s) for s in committed} if self.retention.keep_period_seconds else None
        keep = self.retention.keep(committed, metrics, times)
        for s in committed:
            if s not in keep:
                self._deleter.submit(s)

    def _metadata_file(self, step: int) -> Path | None:
        path = self.step_path(step)
        return path / METADATA_FILE if isinstance(path, Path) else None

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
            # No lock on an object store tells a crashed save from one in progress: only steps
            # older than the newest commit are taken as crashed.
            if committed or (not isinstance(path, Path) and (newest is None or step >= newest)):
                continue
            if not only_a_save_wrote(self._entries(step, path)):
                logger.info("%s: not a crashed save's leftovers (it holds other files): left alone", describe(path))
            elif isinstance(path, Path):
                attempt(functools.partial(_discard, path, committed=False), path)  # skipped while a save writes it
            else:
                attempt(Storage(path).remove, path)
        if isinstance(self.directory, Path) and not self._deleter.pending():  # removals a crash interrupted
            with contextlib.suppress(FileNotFoundError):
                for p in self.directory.iterdir():
                    if p.name.startswith(_TRASH):
                        attempt(functools.partial(remove_tree, p), p)

    def _entries(self, step: int, path: Path | Location) -> set[str]:
        """The names at the top of a step's directory (or under its key prefix); unreadable: a foreign name."""
        if not isinstance(path, Path):
            assert self._kv is not None
            prefix = f"step_{step}/"
            return {k[len(prefix) :].split("/", 1)[0] for k in self._kv.list(prefix)}
        try:
            return set(os.listdir(path))
        except OSError:
            return {"?"}

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
        """Load ``step`` into ``target`` (see :func:`pytreeckpt.load`); without a step, the newest that loads.

        Without ``step``, committed steps are tried newest first: one that fails to load
        with a :class:`CheckpointError` (a chunk failing its checksum, a missing or
        unreadable file, malformed metadata) is skipped with a
        :class:`CheckpointDamageWarning` naming the step and the damage, and the next
        older one is tried. A target mismatch, a bad layout or a permission error is the
        caller's and is raised. In a distributed restore the ranks agree on each step's
        outcome, so every rank falls back to the same step. A step removed while it is
        being loaded (another manager's retention) gives way to the newest one then.
        :attr:`last_restored_step` says which step was restored. ``restore(step=N)`` is
        strict: it loads N or raises.

        Raises:
          NotCommittedError: no committed step (none that loads, without ``step``).
          CheckpointError: ``step`` does not load, or the target does not match.
        """
        self._check_open()
        if step is not None:
            step = check_step(step)
        self._finish_in_flight()
        kwargs.setdefault("process_group", self._process_group)
        kwargs.setdefault("timeout", self.timeout)
        if step is not None:
            foreign = self._agree(self._foreign(step, "restored from it") if self._is_leader else None)
            if foreign is not None:
                raise NotCommittedError(foreign)
            result = load(self._location(f"step_{step}"), target, **kwargs)
            self.last_restored_step = step
            return result
        result, self.last_restored_step, _ = first_that_loads(
            lambda: self._candidates(target, kwargs), self._comm, f"no committed checkpoint in {self.directory}"
        )
        return result

    def _candidates(self, target: Any, kwargs: dict[str, Any]) -> list[tuple[int, str, Callable[[], Any]]]:
        """This manager's committed steps, newest first, each with its load (for :func:`first_that_loads`)."""
        where = str(self.directory)
        return [
            (s, where, functools.partial(load, self._location(f"step_{s}"), target, **kwargs))
            for s in reversed(self.all_steps())
        ]

    def metadata_of(self, step: int) -> Mapping[str, Any]:
        """The user metadata stored with ``step``."""
        from pytreeckpt.api import metadata

        return metadata(self._location(f"step_{check_step(step)}")).user_metadata

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the CheckpointManager of {self.directory} is closed")

    def close(self) -> None:
        """Finish the save in flight and the deletions, restore the signal handlers it replaced, and free the
        staging memory; the manager cannot be used afterwards."""
        if not self._closed:
            try:
                self._finish_in_flight()
                self._deleter.close()
            finally:
                self._closed = True
                self._triggers.close()
                staging_pool().free()

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
