"""How ranks agree on what they save or load: errors carried into the next collective, the spans of a call.

A rank that fails before a collective keeps its error (:class:`Carried`) and gives it to
the collective, so every rank raises together instead of some waiting for a timeout. The
first collective of a save, and a load's after rank 0 sent its document (:func:`from_rank0`),
is :func:`agree_on_specs`: rank 0's digest of the arrays it describes goes to every rank, which
compares its own (two tensor collectives, where the communicator can: ``DistComm.all_same``);
only when a rank failed or a digest differs do digests, then descriptions, travel, to say how.
Every rank's monitoring comes to rank 0 with a gather the call makes anyway (:func:`own_spans`,
:func:`take_spans`): a save's gather of checksums, a load's own gather of spans before its last
agreement (:func:`agree_with_spans`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, NoReturn

from pytreeckpt.core._errors import CheckpointError, where
from pytreeckpt.distributed._comm import Comm, describe_failure, failure
from pytreeckpt.execute._monitor import Monitor, Span
from pytreeckpt.plan import ArraySpec, spec_digest, spec_plan_key

__all__ = [
    "Carried",
    "agree_on_specs",
    "agree_with_spans",
    "everyone",
    "from_rank0",
    "own_spans",
    "state_digest",
    "take_spans",
]


class Carried:
    """Errors a rank meets before a collective, carried into it so that every rank raises together.

    In a single process (no comm) an error is raised where it happens. In a distributed
    save or load a rank that raised before the next collective would never join it and
    leave the others waiting for the collective's timeout; instead the first error is
    kept here and given to the collective (``comm.agree`` or the layout exchange).
    """

    def __init__(self, comm: Comm | None) -> None:
        self.comm = comm
        self.error: BaseException | None = None

    def catch(self, key: str | None = None) -> Catch:
        """Keep an exception of the block (as a CheckpointError naming ``key``, if given and it is not one)."""
        return Catch(self, key)

    def carry(self, e: Exception, key: str | None) -> None:
        """What :meth:`catch`'s block does with ``e``, for a loop that catches it itself (a try per leaf
        costs less than entering a block): raise it in a single process, else keep it."""
        if self.comm is None:
            raise e
        self.keep(e, key)

    def keep(self, e: Exception, key: str | None) -> None:
        if self.error is None:
            if key is not None and not isinstance(e, CheckpointError):
                wrapped = CheckpointError(f"leaf {where(key)}: {type(e).__name__}: {e}")
                wrapped.__cause__ = e
                e = wrapped
            self.error = e

    def agree(self, what: str) -> None:
        """Every rank raises if any rank failed so far (a collective; nothing in a single process)."""
        if self.comm is not None:
            error, self.error = self.error, None
            self.comm.agree(error, what)

    def fail(self, what: str) -> NoReturn:
        """This rank failed: raise, together with the other ranks at their agreement on ``what``."""
        error = self.error
        if error is None:
            raise AssertionError("Carried.fail without an error")
        self.agree(what)
        raise error  # (a single process; in a distributed one the agreement raised)


class Catch:
    """:meth:`Carried.catch`'s block (a class, not a generator: it is entered once per leaf)."""

    __slots__ = ("carried", "key")

    def __init__(self, carried: Carried, key: str | None) -> None:
        self.carried, self.key = carried, key

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, e: BaseException | None, tb: Any) -> bool:
        if not isinstance(e, Exception) or self.carried.comm is None:
            return False  # (none, or not ours to keep: raised as it is)
        self.carried.keep(e, self.key)
        return True


def from_rank0(comm: Comm, carried: Carried, value: Any, what: str) -> Any:
    """Rank 0's ``value`` on every rank, in one collective (a broadcast); or, where rank 0 failed at ``what``
    (its error carried), that failure, which every rank raises together. Another rank's own carried error stays
    carried, to the next agreement (:func:`agree_on_specs`): a load's first collectives are this and that one.

    ``value`` is bytes (a document); a failure travels as a tuple (its kind and message).
    """
    failed = comm.rank == 0 and carried.error is not None
    sent = comm.broadcast(
        ("failed", describe_failure(carried.error)) if failed else value if comm.rank == 0 else None, 0, what
    )
    if isinstance(sent, tuple):
        error, carried.error = carried.error, None
        raise failure(what, [(0, sent[1])], comm.world) from error
    return sent


def everyone(comm: Comm, mine: Any) -> list[Any]:
    """Every rank's ``mine``, on every rank, by rank."""
    return list(comm.broadcast(comm.gather(mine)))


def own_spans(monitor: Monitor, rank: int) -> list[Any]:
    """This rank's spans of ``monitor``, as they travel to rank 0 (with a collective the call makes anyway)."""
    return [s.to_json() for s in monitor.spans if s.rank == rank]


def take_spans(monitor: Monitor, gathered: Sequence[list[Any]]) -> None:
    """On rank 0: every other rank's spans (:func:`own_spans`, by rank) into its monitor."""
    monitor.extend([Span.from_json(s) for r, spans in enumerate(gathered) if r != 0 for s in spans])


def agree_with_spans(comm: Comm, error: BaseException | None, what: str, monitor: Monitor) -> None:
    """``comm.agree(error, what)`` after every rank's spans of this call came to rank 0's monitor: every rank
    raises if any rank failed (the spans kept)."""
    gathered = comm.gather(own_spans(monitor, comm.rank), what)
    if comm.rank == 0:
        take_spans(monitor, gathered)
    comm.agree(error, what)


def _describe(specs: Sequence[ArraySpec], dtypes: Sequence[str]) -> list[Any]:
    """What a rank says of the arrays it saves or loads, for an error message: key, dtype, shape, layout, ranks."""
    return [
        (s.key, d, list(s.shape), s.layout.to_json(), None if s.ranks is None else list(s.ranks))
        for s, d in zip(specs, dtypes, strict=True)
    ]


def agree_on_specs(
    comm: Comm,
    specs: Sequence[ArraySpec],
    dtypes: Sequence[str],
    what: str,
    error: BaseException | None = None,
    values: Sequence[str] = (),
    known: tuple[tuple[Any, ...], bytes] | None = None,
    contents: Sequence[tuple[str, int]] = (),
    sites: Sequence[str] = (),
    outline: Any = None,
) -> tuple[tuple[Any, ...], bytes] | None:
    """Check that every rank describes the same arrays, in the same layouts: the first collective of a save or load.

    Returns ``spec_plan_key(specs)`` and the digest this rank sent (None if this rank
    failed before): the plan cache's key, computed once per save or load, and what a
    later save of the same state sends (``known``).

    Every array's layout is a spec that every rank knows whole (a DTensor's mesh and
    placements, a ``ShardingSpec``, ``FlatRanges`` or ``ExplicitRegions``), so no rank's
    pieces travel: each rank has a 16-byte digest of its arrays (keys, dtypes, shapes,
    layouts, placements, and the keys of plain Python leaves ``values``). Rank 0's goes to
    every rank and one all-reduce says whether any rank's differs (``DistComm.all_same``);
    if one does, or a rank failed, or the communicator has no ``all_same`` (``SimComm``),
    each rank sends rank 0 its digest and rank 0 answers every rank with its verdict. What
    a rank receives does not grow with the world. Only when the digests differ do the
    descriptions travel, to say how they differ. A rank that failed before (``error``)
    sends its error instead, and every rank raises the same error. ``known``:
    ``spec_plan_key(specs)`` and this rank's digest (:func:`state_digest`), if a save of
    this state computed them before.

    ``contents``: a checksum of each leaf every rank holds whole and saves once (plain
    tensors and Python values), by key: ranks whose copies differ are refused, naming the
    leaf, since their state would collapse to one rank's copy. ``sites``: the key paths
    of the subtrees marked per rank (which are not compared: each rank's is its own).
    ``outline``: the tree's containers and leaf kinds (``Node.outline``), which every rank
    must save alike (a tuple on one rank and a list on another would be saved as rank 0's).
    """
    mine: Any = None
    if error is None:
        try:
            if known is None:
                base = spec_plan_key(specs)
                known = (base, state_digest(base, dtypes, values, outline))
            mine = ("ok", known[1] + (_digest(contents, sites) if contents or sites else b""))
        except Exception as e:
            error = e
    if error is not None:
        mine = ("error", describe_failure(error))
    # Every rank's digest equal to rank 0's, and none failed: two tensor collectives say so (DistComm.all_same),
    # where the gather and broadcast of objects below took five times as long. Otherwise, or with a Comm that
    # cannot (SimComm), every rank takes the gather below, together (all see the same answer).
    same = getattr(comm, "all_same", None)
    if same is not None and same(mine[1] if mine[0] == "ok" else None, f"agreeing on the {what}"):
        return known
    gathered = comm.gather(mine, f"comparing the ranks' {what}")
    verdict: Any = None
    # (every rank's digest equal to rank 0's: C compares them, at 16,384 ranks a Python loop cost 5 ms)
    if comm.rank == 0 and (mine[0] != "ok" or gathered.count(mine) != len(gathered)):
        failed = [(r, g[1]) for r, g in enumerate(gathered) if g[0] == "error"]
        if failed:
            verdict = ("failed", failed)
        elif any(g[1] != gathered[0][1] for g in gathered):
            verdict = ("differ",)
    verdict = comm.broadcast(verdict, 0, f"comparing the ranks' {what}")
    if verdict is None:
        if error is not None:  # (rank 0 says all agree though this rank failed: a simulated world, SimComm)
            raise error
        return known
    if verdict[0] == "failed":
        raise failure(f"preparing the {what}", verdict[1], comm.world) from error
    # The digests differ: rank 0's description goes to every rank, which says how its own differs.
    desc = (_describe(specs, dtypes), list(values), list(sites), [list(c) for c in contents], outline)
    ref = comm.broadcast(desc if comm.rank == 0 else None)
    problem = None
    if desc[2] != ref[2]:
        problem = CheckpointError(
            f"ranks disagree on the state to {what}: rank 0 marks the subtrees {ref[2]} PER_RANK, rank {comm.rank} "
            f"marks {desc[2]}; every rank must give the same spec tree"
        )
    elif desc[4] != ref[4]:
        problem = CheckpointError(
            f"ranks disagree on the state to {what}: rank 0 and rank {comm.rank} differ in the tree's structure "
            f"{_outline_difference(ref[4], desc[4], comm.rank)}: the checkpoint would hold rank 0's alone; every "
            f"rank must {what} the same containers and kinds of leaves (its own subtrees marked PER_RANK excepted)"
        )
    elif [m[:3] for m in desc[0]] != [m[:3] for m in ref[0]]:
        problem = CheckpointError(
            f"ranks disagree on the state to {what}: rank 0 and rank {comm.rank} differ in (key, dtype, shape): "
            f"{_difference([m[:3] for m in ref[0]], [m[:3] for m in desc[0]], comm.rank)}"
        )
    elif desc[0] != ref[0]:
        problem = CheckpointError(
            f"ranks disagree on the state to {what}: rank 0 and rank {comm.rank} differ in the layout of "
            f"{_difference(ref[0], desc[0], comm.rank)}"
        )
    elif desc[1] != ref[1]:
        problem = CheckpointError(
            f"ranks disagree on the state to {what}: rank 0 and rank {comm.rank} differ in their plain Python "
            f"leaves: {_difference(ref[1], desc[1], comm.rank)}"
        )
    elif desc[3] != ref[3]:
        problem = _collapse(ref[3], desc[3], comm.rank, what)
    comm.agree(problem, f"preparing the {what}")
    raise CheckpointError(f"ranks disagree on the state to {what}: their descriptions differ in a way not shown")


def _digest(contents: Sequence[tuple[str, int]], sites: Sequence[str]) -> bytes:
    return hashlib.blake2b(
        repr((list(contents), list(sites))).encode("utf-8", "surrogatepass"), digest_size=16
    ).digest()


def _collapse(ref: list[Any], mine: list[Any], rank: int, what: str) -> CheckpointError:
    """The error of a leaf saved once as every rank's copy, whose copies differ between rank 0 and ``rank``."""
    theirs = dict(map(tuple, ref))
    differ = [k for k, c in mine if theirs.get(k) != c]
    shown = ", ".join(repr(k) for k in differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    first = differ[0] if differ else ""
    return CheckpointError(
        f"leaf {shown} differs between rank 0 and rank {rank}: a tensor or Python value every rank holds is taken "
        f"as replicated and saved once, so the other ranks' copies would be lost. If it is each rank's own (an RNG "
        f"state, a data position, a counter), mark it per rank: {what}(..., spec={{{first!r}: PER_RANK}}) (or a "
        f"subtree holding it); if every rank should hold the same, the ranks have diverged before this {what}"
    )


def state_digest(base: tuple[Any, ...], dtypes: Sequence[str], values: Sequence[str], outline: Any = None) -> bytes:
    """What a rank sends to agree on a state: a digest of its arrays' key (``spec_plan_key``), dtypes and value keys,
    and of the tree's ``outline`` if given."""
    shape = "" if outline is None else json.dumps(outline, separators=(",", ":"))
    return spec_digest((*base, tuple(dtypes), tuple(values), shape))


def _outline_difference(ref: Any, mine: Any, rank: int, path: str = "") -> str:
    """Where two ranks' tree outlines (``Node.outline``) first differ, and how."""
    at = f"at key path {path!r}" if path else "at the root"
    if isinstance(ref, dict) and isinstance(mine, dict):
        for name in ("k", "type", "keys", "maxlen", "factory_name", "metadata_json"):
            if ref.get(name) != mine.get(name):
                return f"{at}: rank 0 has {_shown(ref, name)}, rank {rank} {_shown(mine, name)}"
        keys = ref.get("keys") or list(range(len(ref["c"])))
        for key, a, b in zip(keys, ref["c"], mine["c"], strict=False):
            if a != b:
                below = key if isinstance(key, str) else str(key[-1] if isinstance(key, list) else key)
                return _outline_difference(a, b, rank, f"{path}.{below}" if path else below)
        if len(ref["c"]) != len(mine["c"]):
            return f"{at}: rank 0 has {len(ref['c'])} children, rank {rank} {len(mine['c'])}"
    return f"{at}: rank 0 has {_shown_leaf(ref)}, rank {rank} {_shown_leaf(mine)}"


def _shown(outline: dict[str, Any], name: str) -> str:
    value = outline.get(name)
    if name == "k":
        return f"{_a(str(value))} {value} node"
    if name == "keys":
        return f"the keys {value}"
    return f"{name} {value!r}"


def _a(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _shown_leaf(outline: Any) -> str:
    if outline == "cut":
        return "a subtree of its own (PER_RANK)"
    if isinstance(outline, dict):
        return f"{_a(outline['k'])} {outline['k']} node"
    return f"a leaf of kind {outline!r}"


def _difference(ref: list[Any], other: list[Any], rank: int) -> str:
    """The first difference of two ranks' descriptions, by key where a key is missing on one side."""

    def name(m: Any) -> str:
        return str(m[0]) if isinstance(m, (list, tuple)) else str(m)

    ref_keys, other_keys = [name(m) for m in ref], [name(m) for m in other]
    ref_set, other_set = set(ref_keys), set(other_keys)
    only_ref = [k for k in ref_keys if k not in other_set]
    only_other = [k for k in other_keys if k not in ref_set]
    if only_ref or only_other:
        parts = [f"leaf {where(k)} only on rank 0" for k in only_ref[:3]]
        parts += [f"leaf {where(k)} only on rank {rank}" for k in only_other[:3]]
        return "; ".join(parts)
    return next((f"{a} versus {b}" for a, b in zip(ref, other, strict=False) if a != b), "their order")
