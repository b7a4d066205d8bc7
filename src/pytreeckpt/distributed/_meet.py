"""Meetings of a checkpoint group's ranks before each collective, each with a deadline and a name.

A collective waits, inside gloo, for every rank, bounded by nothing the library chose
(a rank stopped by SIGSTOP held the others past the process group's own timeout). So
before each collective the ranks meet on the group's rendezvous store, where a rank
that waits can see who has come: each rank marks itself there and counts itself in,
the last to come says so, and the collective runs only once every rank is there. A
rank that has waited its deadline gives the meeting up for everyone, atomically (one
``add`` that the count of the others can no longer reach), names the ranks that never
came, and raises :class:`CheckpointTimeoutError`; the others waiting raise the same
error as soon as they see it, and a rank that comes later raises it on arrival. Either
every rank passes a meeting or every rank that reaches it raises there: the ranks stay
in step, and the gloo groups stay usable.

The store's calls run on a thread of their own (one per calling thread, with its own
client of the store: a client serves one call at a time, and a manager's vote must not
wait behind an asynchronous save's writer waiting in a meeting), given up after the
deadline: a store whose server is stopped (rank 0's process, without torchrun) answers
no call, and its client waits for ever.

Cost: one hop to the worker thread and three store requests a rank a meeting (the
last to come needs one), plus the deletion of the keys of the meeting two before
(``python -m benchmarks.deadlines``).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from pytreeckpt.core._errors import CheckpointError, CheckpointTimeoutError

__all__ = ["Meetings", "Waited", "meetings_of", "ranks_text", "store_call"]

_T = TypeVar("_T")

# Added to a meeting's count by a rank that gives it up: beyond any world's count, so that the
# rank whose arrival would have completed it sees it given up instead.
_GIVEN_UP = 1 << 40
# How long past the deadline a call to the store may take before the store is deemed not answering.
_GRACE = 5.0
# False: no meeting is held, collectives wait inside gloo as before (only benchmarks.deadlines sets it, to
# measure what the meetings cost a save).
ENABLED = True


@dataclass(frozen=True, slots=True)
class Waited:
    """One meeting this rank passed: what it was, when this rank came and left, and who came last."""

    phase: str
    start: float  # time.time() at arrival
    end: float
    last: int  # the rank of the group that came last


class _Worker:
    """A daemon thread that runs store calls, so that the caller can stop waiting for one.

    It has its own client of each store (``Store.clone``: a connection of its own): a store's
    client serves one call at a time, and another thread's meeting (a manager's vote beside an
    async save's writer) may be waiting in one. It ends, closing them, once its caller's thread
    has ended (or given it up) and let it go.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, Callable[[Any], Any], Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(self._jobs,), name="pytreeckpt-store", daemon=True).start()
        weakref.finalize(self, self._jobs.put, None)

    def call(self, store: Any, fn: Callable[[Any], _T], seconds: float) -> _T:
        box: Future[_T] = Future()
        self._jobs.put((store, fn, box))
        return box.result(timeout=seconds)


def _serve(jobs: queue.SimpleQueue[tuple[Any, Callable[[Any], Any], Future[Any]] | None]) -> None:
    clones: dict[int, tuple[Any, Any]] = {}
    while True:
        job = jobs.get()
        if job is None:  # (its worker is gone)
            return
        store, fn, box = job
        try:
            mine = clones.get(id(store))
            if mine is None or mine[0] is not store:
                mine = clones[id(store)] = (store, store.clone())
            box.set_result(fn(mine[1]))
        except BaseException as e:
            box.set_exception(e)


_workers = threading.local()


def store_call(store: Any, fn: Callable[[Any], _T], seconds: float, what: str) -> _T:
    """``fn(client)``: calls to ``store`` through this thread's worker's own client of it, given up after
    ``seconds``: a store that does not answer is an error.

    Raises:
      CheckpointTimeoutError: no answer within ``seconds`` (the worker thread waiting for it is left
        to its call; this thread's next call gets another).
    """
    worker = getattr(_workers, "worker", None)
    if worker is None:
        worker = _workers.worker = _Worker()
    try:
        return worker.call(store, fn, seconds)
    except dist.DistNetworkError as e:
        raise CheckpointTimeoutError(
            f"{what}: the rendezvous store is gone ({e}); the process serving it ended (rank 0's, when "
            f"torch.distributed was initialised without torchrun)",
            phase=what,
            timeout=seconds,
        ) from e
    except FutureTimeout:
        _workers.worker = None
        raise CheckpointTimeoutError(
            f"{what}: the rendezvous store did not answer within {seconds:g} s; the process serving it is stopped "
            f"or gone (rank 0's, when torch.distributed was initialised without torchrun)",
            phase=what,
            timeout=seconds,
        ) from None


def ranks_text(ranks: list[int] | tuple[int, ...]) -> str:
    """>>> ranks_text([3]), ranks_text([1, 2, 3]), ranks_text([0, 5])
    ('rank 3', 'ranks 1-3', 'ranks 0, 5')
    """
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class Meetings:
    """The meetings of one checkpoint group, numbered alike on its ranks (every rank meets at every
    collective of the group, in the same order)."""

    def __init__(self, store: Any, rank: int, world: int, name: str) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.name = name
        self.count = 0
        # the meetings this rank passed (a rank that passed n - 1 knows every rank came to it, so every rank is
        # done with n - 2: its keys go; those of a meeting given up are kept for the ranks that come late)
        self.passed: set[int] = set()
        self._lock = threading.Lock()

    def _key(self, n: int, what: str) -> str:
        return f"pytreeckpt/meet/{n}/{what}"

    def meet(self, phase: str, timeout: float) -> Waited:
        """Wait until every rank of the group has come to this meeting, or ``timeout`` seconds.

        Raises:
          CheckpointTimeoutError: a rank did not come within ``timeout`` seconds of this rank's arrival
            (every rank that came raises it too), or this rank came after the others gave the meeting up,
            or the store did not answer.
        """
        with self._lock:
            n = self.count
            self.count += 1
            tidy = n - 2 if {n - 2, n - 1} <= self.passed else None
            self.passed.discard(n - 2)
        base, rank, world = self.store, self.rank, self.world
        start, begun = time.time(), time.monotonic()
        key = self._key
        done = key(n, "done")

        def meeting(store: Any) -> tuple[int, str | None]:  # (one call to the worker: the usual case costs one hop)
            if tidy is not None:
                store.delete_key(key(tidy, f"r{rank}"))
                if rank == 0:
                    store.delete_key(key(tidy, "n"))
                    store.delete_key(key(tidy, "done"))
            store.set(key(n, f"r{rank}"), b"")
            count = int(store.add(key(n, "n"), 1))
            if count == world:
                said = f"ok {rank}"
                store.set(done, said)
                return count, said
            if count > world:
                return count, None
            left = max(timeout - (time.monotonic() - begun), 0.001)
            try:
                store.wait([done], timedelta(seconds=left))
            except dist.DistStoreError:  # the store's wait timed out
                return count, None
            return count, store.get(done).decode()

        count, answer = store_call(base, meeting, timeout + _GRACE, phase)
        if count > world:
            self._late(n, phase, timeout)
        if answer is None:
            self._give_up(n, phase, timeout)  # (returns when every rank came meanwhile)
            answer = store_call(base, lambda store: store.get(done), _GRACE, phase).decode()
        if not answer.startswith("ok "):
            self._raise(answer, phase, timeout, late=False)
        with self._lock:
            self.passed.add(n)
        return Waited(phase, start, time.time(), int(answer.split()[1]))

    def _give_up(self, n: int, phase: str, timeout: float) -> None:
        """This rank waited ``timeout``: give meeting ``n`` up for every rank, naming who did not come (unless
        everyone came meanwhile: then it goes on)."""
        base, world, key = self.store, self.world, self._key

        def give_up(store: Any) -> str | None:
            total = int(store.add(key(n, "n"), _GIVEN_UP))
            came = total % _GIVEN_UP
            if total // _GIVEN_UP == 1 and came < world:  # the first to give up, before the last came
                missing = [r for r in range(world) if not store.check([key(n, f"r{r}")])]
                said = json.dumps({"by": self.rank, "missing": missing, "timeout": timeout})
                store.set(key(n, "done"), said)
                return said
            return None

        said = store_call(base, give_up, 2 * _GRACE + timeout / 10, phase)
        if said is None:  # another rank gave it up first, or all came: its verdict, once written
            wait = lambda store: store.wait([key(n, "done")], timedelta(seconds=_GRACE))  # noqa: E731
            store_call(base, wait, 2 * _GRACE, phase)
            return
        self._raise(said, phase, timeout, late=False)

    def _late(self, n: int, phase: str, timeout: float) -> None:
        done = self._key(n, "done")
        store_call(self.store, lambda store: store.wait([done], timedelta(seconds=_GRACE)), 2 * _GRACE, phase)
        said = store_call(self.store, lambda store: store.get(done), _GRACE, phase).decode()
        self._raise(said, phase, timeout, late=True)

    def _raise(self, said: str, phase: str, timeout: float, late: bool) -> None:
        try:
            verdict = json.loads(said)
            missing = tuple(int(r) for r in verdict["missing"])
            by = int(verdict["by"])
            waited = float(verdict["timeout"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{phase}: the meeting of the checkpoint group holds {said!r}") from e
        who = ranks_text(missing) if missing else "no rank (all came just as it gave up)"
        message = (
            f"{phase}: timed out after {waited:g} s waiting for {who} of {self.world} "
            f"(rank {by} gave up; the checkpoint group's gloo ranks are {self.name})"
        )
        if late:
            message += f"; this rank, {self.rank}, came after that"
        message += (
            "; nothing of this call is committed. The rank that did not come is stopped, dead or slower than the "
            "timeout: end the job and restart it from the last committed checkpoint (or pass a longer timeout)"
        )
        raise CheckpointTimeoutError(message, phase=phase, ranks=missing, timeout=waited)


_MEETINGS: dict[tuple[int, str], Meetings] = {}
_MEETINGS_LOCK = threading.Lock()


def meetings_of(group: Any) -> Meetings:
    """The meetings of the checkpoint gloo group ``group``, on its own rendezvous store."""
    name = str(dist.distributed_c10d._get_process_group_name(group))
    key = (id(group), name)
    with _MEETINGS_LOCK:
        found = _MEETINGS.get(key)
        if found is None:
            store = dist.distributed_c10d._world.pg_map[group][1]  # (a PrefixStore of the group's name)
            found = _MEETINGS[key] = Meetings(store, dist.get_rank(group), dist.get_world_size(group), name)
        return found
