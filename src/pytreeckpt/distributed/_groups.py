"""The checkpoint's own process groups: made once per world (or per group of some ranks), released at exit.

All traffic runs on a process group of its own (gloo, over CPU tensors), never on the
user's default group, so a save running in a background thread cannot interleave its
collectives with the training loop's. Those groups are destroyed when the program ends
(``atexit``), while the interpreter is whole: held here, they would otherwise outlive
the user's ``destroy_process_group()`` and have their gloo threads torn down during
interpreter finalisation.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
from typing import Any

import torch.distributed as dist

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._timeout import default_timeout

__all__ = ["checkpoint_group", "group_ranks", "own_group", "release_groups", "this_rank"]

_GROUPS: dict[tuple[Any, ...], tuple[Any, Any]] = {}
_GROUPS_LOCK = threading.Lock()
_HOOKED: list[bool] = []  # release_groups is registered with atexit


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group given by the caller, this process among them."""
    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError("a process_group was given but torch.distributed is not initialised")
    try:
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"process_group {group!r} is not a process group of this process: {e}") from e
    if dist.get_rank() not in ranks:
        raise CheckpointError(
            f"rank {dist.get_rank()} is not a member of the process_group given (its ranks are {list(ranks)}): "
            f"only its members save or load with it"
        )
    return ranks


def this_rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


def checkpoint_group(group: Any = None, purpose: str = "") -> tuple[Any, Any]:
    """The process groups for checkpoint traffic: one for collectives, one for fragment transfers.

    With ``group`` given, its ranks are used. The gloo groups are made once
    (collectively, on first use) and reused; keeping point-to-point transfers on a
    group of their own means no collective can ever match one of their messages.
    Groups of the whole world are made by every rank; a group of some ranks only (a
    pipeline stage, a data-parallel replica) by its members alone, so the other ranks
    need not take part, and may make their own.

    ``purpose`` ``"manager"``: the groups of a manager's votes and listings, apart from those of its
    saves: an asynchronous save's collectives, on its writer thread, never interleave with them.
    """
    ranks = None if group is None else group_ranks(group)
    if ranks is not None and len(ranks) == dist.get_world_size():
        ranks = None
    key = (id(dist.distributed_c10d._get_default_group()), ranks, purpose)
    with _GROUPS_LOCK:
        if key not in _GROUPS or not all(_alive(g) for g in _GROUPS[key]):
            # (a group of a destroyed world is remade: a new default group may reuse the old one's id)
            if ranks is None:
                made = [dist.new_group(None, backend="gloo", timeout=_gloo_timeout()) for _ in range(2 - bool(purpose))]
            else:
                _check_group_history(group, ranks)
                members = list(ranks)
                made = [
                    dist.new_group(members, backend="gloo", use_local_synchronization=True, timeout=_gloo_timeout())
                    for _ in range(2 - bool(purpose))
                ]
            _GROUPS[key] = (made[0], made[-1])  # (a manager's collectives need no group for transfers)
            if not _HOOKED:
                _HOOKED.append(True)
                atexit.register(release_groups)
        return _GROUPS[key]


def own_group() -> Any:
    """A process group of this rank alone, for a save or load it runs by itself; None outside a distributed job.

    For a caller that saves on one rank while the others do not take part (Lightning saves
    on global rank 0 alone): with it, ``save`` runs as a single process does, issuing no
    collective. Made by this rank alone (``use_local_synchronization``), once per world.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    key = (id(dist.distributed_c10d._get_default_group()), "own")
    with _GROUPS_LOCK:
        if key not in _GROUPS or not all(_alive(g) for g in _GROUPS[key]):
            g = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
            _GROUPS[key] = (g, g)
            if not _HOOKED:
                _HOOKED.append(True)
                atexit.register(release_groups)
        return _GROUPS[key][0]


def _gloo_timeout() -> datetime.timedelta:
    """The gloo groups' own timeout: the process-wide default deadline (``core._timeout``). Their collectives
    run once every rank has come to them (``_meet``), and their transfers are waited for with each call's
    deadline; this bounds what nothing else does (the second collective of a pair, run without a meeting)."""
    return datetime.timedelta(seconds=default_timeout())


def _check_group_history(group: Any, ranks: tuple[int, ...]) -> None:
    """Refuse, rather than hang, when the members of ``group`` cannot make a group together.

    torch names a group made by its members alone after its ranks and the number of
    groups each member has made so far; members that made different numbers of groups
    would wait for each other under different names until the rendezvous timeout.
    """
    made = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    if made is None:  # another torch: nothing to check with
        return
    counts: list[Any] = [None] * len(ranks)
    dist.all_gather_object(counts, len(made), group=group)
    if len(set(counts)) > 1:
        detail = ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts, strict=True))
        raise CheckpointError(
            f"the ranks of process_group have made different numbers of process groups ({detail}), so torch "
            f"cannot name the checkpoint's gloo groups alike on all of them; make process groups in the same "
            f"order on every member, or pass no process_group (the whole world)"
        )


def release_groups() -> None:
    """Destroy the checkpoint process groups (at exit): their gloo threads end while Python is whole.

    Runs after Python has joined every non-daemon thread (an asynchronous save's writer
    included), so no checkpoint traffic is left. A group the user's
    ``destroy_process_group()`` already shut down is only let go; one still registered
    is destroyed. Later saves and loads make new groups.
    """
    with _GROUPS_LOCK:
        groups = [g for pair in _GROUPS.values() for g in pair]
        _GROUPS.clear()
    while groups:
        g = groups.pop()
        if _alive(g):
            with contextlib.suppress(ValueError, RuntimeError):  # gone with its world meanwhile
                dist.destroy_process_group(g)
        del g  # the last reference: the group's destructor joins its threads now


def _alive(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True
