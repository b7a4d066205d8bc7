"""Two tiers of checkpoints: frequent ones in fast memory, fewer on durable storage."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pytreeckpt.storage import Where, describe

from ._fallback import first_that_loads
from ._manager import CheckpointManager, ClosesOnExit, check_on_busy, check_step

__all__ = ["TwoTierManager"]


class TwoTierManager(ClosesOnExit):
    """Checkpoints every ``fast_interval_steps`` to a fast tier and every ``durable_interval_steps`` to durable storage.

    The fast tier is a directory in memory, such as ``/dev/shm/<run>``: saving there
    costs a memory copy, so it can be frequent, and it survives the training process (a
    crash, a kill) but not the machine. (``memory://`` works too, for a process that
    only needs to survive its own errors.) The durable tier is an ordinary directory. A
    step on both intervals goes to the durable tier only. :meth:`restore` takes the
    newest committed step of either tier, so a restarted process resumes from the fast
    tier when it holds a newer step, and from the durable one when the fast tier is
    gone. Each tier is a :class:`CheckpointManager` with its own retention; the fast
    tier keeps ``fast_max_to_keep`` steps. In a distributed program the fast directory
    must be one that every rank sees (``/dev/shm`` on a single machine).

    :meth:`restore` without a step falls back past steps that do not load (see
    :meth:`CheckpointManager.restore`), through the fast tier's and down to the durable
    tier's; :attr:`last_restored_step` and :attr:`last_restored_tier` say what it
    restored. With ``save_on_signals``, the save after a preemption signal goes to the
    durable tier (a preempted machine's memory goes with it), synchronously, and
    :meth:`reached_preemption` says to stop.

    ``on_busy`` is the durable tier's (see :class:`CheckpointManager`): with ``"skip"``,
    a durable step due while the durable tier's previous asynchronous save is still
    writing is skipped (:meth:`save` returns None, with a
    :class:`CheckpointSkippedWarning`). A fast step still waits for a durable save in
    flight (one save runs at a time), and the fast tier's saves, which replace a step
    of the same number, always wait for their own.

    >>> import tempfile, torch
    >>> fast, durable = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> with TwoTierManager(fast, durable, fast_interval_steps=2, durable_interval_steps=5) as m:
    ...     for step in range(1, 9):
    ...         _ = m.save(step, {"step": step})
    ...     m.wait()
    ...     m.all_steps(), m.restore()["step"]
    ({'fast': [6, 8], 'durable': [5]}, 8)
    """

    def __init__(
        self,
        fast_directory: Where,
        durable_directory: Where,
        *,
        fast_interval_steps: int,
        durable_interval_steps: int,
        fast_max_to_keep: int = 2,
        durable_max_to_keep: int | None = None,
        keep_every_n_steps: int | None = None,
        async_: bool = True,
        process_group: Any = None,
        save_on_signals: Iterable[int] = (),
        timeout: float | None = None,
        on_busy: str = "wait",
    ) -> None:
        if fast_interval_steps < 1 or durable_interval_steps < 1:
            raise ValueError(
                f"intervals must be at least 1, found fast {fast_interval_steps} and durable {durable_interval_steps}"
            )
        if describe(fast_directory) == describe(durable_directory):
            raise ValueError(f"the two tiers need two directories, both are {describe(fast_directory)}")
        check_on_busy(on_busy)
        self.fast_interval_steps = fast_interval_steps
        self.durable_interval_steps = durable_interval_steps
        self.fast = CheckpointManager(
            fast_directory, max_to_keep=fast_max_to_keep, async_=async_, process_group=process_group, timeout=timeout
        )
        self.durable = CheckpointManager(
            durable_directory,
            max_to_keep=durable_max_to_keep,
            keep_every_n_steps=keep_every_n_steps,
            async_=async_,
            process_group=process_group,
            save_on_signals=save_on_signals,
            timeout=timeout,
            on_busy=on_busy,
        )
        self.last_restored_step: int | None = None
        """The step the last :meth:`restore` loaded."""
        self.last_restored_tier: str | None = None
        """The tier (``"fast"`` or ``"durable"``) the last :meth:`restore` loaded from."""

    def save(self, step: int, tree: Any, spec: Any = None, *, force: bool = False, **kwargs: Any) -> str | None:
        """Save ``step`` to the tier whose interval it is on: returns ``"durable"``, ``"fast"`` or None.

        ``force``, and the first save after a preemption signal, save to the durable tier
        off its interval. None also when the durable tier skipped the step (``on_busy="skip"``).
        Other arguments are those of :meth:`CheckpointManager.save`.
        """
        step = check_step(step)
        triggers = self.durable._triggers
        preempt = triggers.flag is not None and triggers.preemption_step is None and triggers.due(step)[0]
        if force or preempt or step % self.durable_interval_steps == 0:
            self.fast.wait()  # one save runs at a time; let the fast tier's retention run now
            return "durable" if self.durable.save(step, tree, spec, force=force, **kwargs) else None
        if step % self.fast_interval_steps == 0:
            self.durable.wait()
            self.fast.save(step, tree, spec, force=True, **kwargs)  # a fast step may be redone after a restart
            return "fast"
        return None

    def all_steps(self) -> dict[str, list[int]]:
        """Committed steps of each tier, oldest first."""
        return {"fast": self.fast.all_steps(), "durable": self.durable.all_steps()}

    def latest_step(self) -> int | None:
        """The newest committed step of either tier, or None."""
        steps = [s for s in (self.fast.latest_step(), self.durable.latest_step()) if s is not None]
        return max(steps) if steps else None

    def reached_preemption(self, step: int) -> bool:
        """Whether the loop should stop at ``step`` (see :meth:`CheckpointManager.reached_preemption`)."""
        return self.durable.reached_preemption(step)

    def restore(self, step: int | None = None, target: Any = None, **kwargs: Any) -> Any:
        """Load ``step``, or without one the newest that loads of either tier (the fast tier first on a tie).

        A step that does not load is skipped with a warning, down to older steps of
        either tier (see :meth:`CheckpointManager.restore`); ``restore(step=N)`` is strict.
        """
        if step is not None:
            step = check_step(step)
        self.wait()
        if step is not None:
            tier = "fast" if step in self.fast.all_steps() else "durable"
            result = (self.fast if tier == "fast" else self.durable).restore(step, target, **kwargs)
            self.last_restored_step, self.last_restored_tier = step, tier
            return result
        tiers = {str(self.fast.directory): "fast", str(self.durable.directory): "durable"}

        def candidates() -> list[tuple[int, str, Callable[[], Any]]]:
            both = self.fast._candidates(target, {"process_group": self.fast._process_group, **kwargs})
            both += self.durable._candidates(target, {"process_group": self.durable._process_group, **kwargs})
            return sorted(both, key=lambda c: (-c[0], tiers[c[1]] != "fast"))

        result, self.last_restored_step, where = first_that_loads(
            candidates,
            self.fast._comm,
            f"no committed checkpoint in the fast tier {self.fast.directory} "
            f"nor in the durable tier {self.durable.directory}",
        )
        self.last_restored_tier = tiers[where]
        return result

    def wait(self) -> None:
        """Block until both tiers' saves have committed."""
        self.fast.wait()
        self.durable.wait()

    def close(self) -> None:
        self.fast.close()
        self.durable.close()

    def __repr__(self) -> str:
        return f"TwoTierManager(fast={str(self.fast.directory)!r}, durable={str(self.durable.directory)!r})"
