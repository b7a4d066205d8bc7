"""What a load with a target found: the target's leaves the checkpoint lacks, the stored ones it left, the casts."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LoadReport"]


@dataclass
class LoadReport:
    """Filled in by ``load(path, target, report=LoadReport())``: how the target met the checkpoint.

    ``load`` returns the tree, as it always does; the report is an object the caller
    passes in and reads after, so that a caller who does not ask pays nothing and the
    result keeps the target's structure (DCP's and Megatron's non-strict loads return
    the missing and unexpected keys beside the state instead; a tree has no room for them).
    Its lists are emptied and filled by each load it is given to. In a distributed load every
    rank gets the same report when the ranks' targets have the same structure.

    Attributes:
      missing: key paths of target leaves the checkpoint lacks (with ``strict=False``
        the result holds the target's own leaf there; with ``strict=True`` the load raises).
      unexpected: key paths of stored leaves the target does not ask for (not read).
      cast: ``(key path, stored dtype, target dtype)`` of each array converted by
        ``cast=True``.
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    cast: list[tuple[str, str, str]] = field(default_factory=list)
