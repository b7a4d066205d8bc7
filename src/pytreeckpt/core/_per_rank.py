"""Per-rank state: the spec marker that says a subtree is each rank's own, and what such a part loads as.

A tree's leaves are, by default, either sharded (DTensors, :class:`ShardedLeaf`) or held
whole by every rank and written once, as replicas. State each rank holds for itself (its
RNG, its data position, ``dp_rank_<r>`` subtrees) is marked :data:`PER_RANK` in the spec
tree: every rank's copy is stored, under a ``per_rank`` node of the stored tree whose
children are the ranks' subtrees, keyed ``rank0``, ``rank1``, ... (so rank 1's ``rng``
is stored as ``rng.rank1``). A load at the same world size gives each rank its own; at
another, the load's ``per_rank`` policy (:data:`PER_RANK_POLICIES`) says what happens.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PER_RANK", "PER_RANK_POLICIES", "PerRank", "PerRankSpec", "rank_entry"]

PER_RANK_POLICIES = ("own", "keep", "all")
"""What a load gives a per-rank part: ``"own"`` (each rank its own; at another world size a
CheckpointError), ``"keep"`` (each rank its own; at another world size the target's own leaves,
as for leaves a checkpoint lacks), ``"all"`` (every rank a :class:`PerRank` of every saved rank's)."""


class PerRankSpec:
    """The spec-tree marker of state each rank holds for itself (:data:`PER_RANK`, its one instance)."""

    _instance: PerRankSpec | None = None

    def __new__(cls) -> PerRankSpec:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "PER_RANK"

    def __reduce__(self) -> str:
        return "PER_RANK"


PER_RANK = PerRankSpec()
"""Mark a leaf or subtree of the spec tree per rank: ``save(path, state, spec={"rng": PER_RANK})``.

Every rank's own copy is stored (each rank writes its own), and a load at the same world
size gives each rank the copy it saved. Ranks may hold different subtrees there (torchtitan's
``{"dp_rank_<r>": ...}``)."""


class PerRank(dict[int, Any]):
    """Every saved rank's own subtree of a per-rank part of a checkpoint, by rank (``0`` to ``world - 1``).

    What ``metadata().tree`` shows at a per-rank part, and what ``load(..., per_rank="all")``
    returns there. Saved again, it is a dict keyed by rank.
    """

    @property
    def world(self) -> int:
        """How many ranks saved the part."""
        return len(self)


def rank_entry(rank: int) -> tuple[str, str]:
    """The typed key entry of rank ``rank``'s subtree under a stored per-rank node."""
    return ("s", f"rank{rank}")
