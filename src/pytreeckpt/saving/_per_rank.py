"""A save's per-rank parts: the subtrees the spec tree marks :data:`~pytreeckpt.PER_RANK`, every rank's own stored.

Each rank describes its own copy of such a subtree (its leaves keyed under ``rank<r>``,
held by it alone: ``ranks=(r,)``); in a distributed save the ranks then tell each other what
they hold there (its structure, its leaves' keys, dtypes and shapes, its values' entries),
so that every rank plans the same arrays and rank 0's document holds every rank's subtree
under a ``per_rank`` node. Ranks may hold different subtrees there (``dp_rank_<r>`` keys).
Each rank writes its own arrays; no per-rank data travels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytreeckpt.core._dtypes import dtype_from_name
from pytreeckpt.core._keys import KeyEntry, keystr
from pytreeckpt.core._node import Node, leaf_node
from pytreeckpt.core._per_rank import PER_RANK, rank_entry
from pytreeckpt.leaves import SINGLE, ArrayIn, Describing
from pytreeckpt.leaves._sources import no_data

__all__ = ["Sites"]


@dataclass(slots=True)
class Sites:
    """The per-rank subtrees of a tree being saved, in the tree's order."""

    paths: list[tuple[KeyEntry, ...]] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)

    def cover(self, value: Any, node: Node, path: tuple[KeyEntry, ...]) -> None:
        """``broadcast_prefix``'s ``covers``: note the subtrees the spec tree marks per rank."""
        if value is PER_RANK:
            self.paths.append(path)
            self.nodes.append(node)

    def own_keys(self, keys: Sequence[str]) -> frozenset[str]:
        """The keys of this rank's leaves under the sites (after :meth:`rename`)."""
        return frozenset(keys[i] for node in self.nodes for i in node.leaf_indices())

    def keys(self) -> list[str]:
        """The sites' key paths (what the ranks agree on)."""
        return [keystr(p) for p in self.paths]

    def rename(self, paths: Sequence[tuple[KeyEntry, ...]], keys: list[str], rank: int) -> None:
        """Key the leaves under each site as rank ``rank``'s: ``site.rank<r>.rest``."""
        for path, node in zip(self.paths, self.nodes, strict=True):
            n = len(path)
            for i in node.leaf_indices():
                keys[i] = keystr((*path, rank_entry(rank), *paths[i][n:]))

    def own(self, d: Describing, codecs: dict[str, Any]) -> list[tuple[Any, list[tuple[Any, ...]]]]:
        """What this rank holds at each site: the subtree's JSON (its leaves numbered from 0) and each leaf's
        description (an array's key, container, dtype, shape and compression; a value's entry)."""
        slots = _array_slots(d.entries)
        out = []
        for node in self.nodes:
            leaves = node.leaf_indices()
            first = leaves[0] if leaves else 0
            described: list[tuple[Any, ...]] = []
            for i in leaves:
                entry = d.entries[i]
                if entry is None:
                    a = d.arrays[slots[i]]
                    described.append(("a", a.key, a.container, a.dtype.name, list(a.shape), codecs.get(a.key)))
                else:
                    described.append(("v", entry))
            out.append((_shifted(node.to_json(), -first), described))
        return out

    def combine(
        self, root: Node, d: Describing, gathered: list[Any], rank: int, codecs: dict[str, Any]
    ) -> tuple[Node, list[ArrayIn], list[dict[str, Any] | None]]:
        """The stored tree, its arrays and its leaves' entries in the tree's order: each site replaced by a
        ``per_rank`` node of every rank's subtree (``gathered[r]``: rank r's :meth:`own`; this rank's own
        leaves as described here, the others' arrays held by their rank alone, their compression added to
        ``codecs``)."""
        slots = _array_slots(d.entries)
        sources: list[tuple[int, int, int]] = []  # per stored leaf: (rank, or -1 for this rank's; site; index)
        site_of = {id(node): s for s, node in enumerate(self.nodes)}
        world = len(gathered)

        def build(node: Node, source: int, site: int) -> Node:
            """``node`` with its sites made per_rank nodes, its leaves numbered in walk order."""
            s = site_of.get(id(node)) if source == -1 else None
            if s is not None:
                kids = [
                    build(node if r == rank else Node.from_json(gathered[r][s][0], len(gathered[r][s][1])), r, s)
                    for r in range(world)
                ]
                return Node("per_rank", [rank_entry(r) for r in range(world)], kids)
            if node.kind == "leaf":
                sources.append((-1 if source == rank else source, site, node.leaf))
                return leaf_node(len(sources) - 1)
            node.children = [build(c, source, site) for c in node.children]
            return node

        new_root = build(root, -1, -1)
        arrays: list[ArrayIn] = []
        entries: list[dict[str, Any] | None] = []
        for source, s, i in sources:
            if source == -1:
                entry = d.entries[i]
                entries.append(entry)
                if entry is None:
                    arrays.append(d.arrays[slots[i]])
                continue
            desc = gathered[source][s][1][i]
            if desc[0] == "v":
                entries.append(desc[1])
                continue
            _, key, container, dtype, shape, codecs[key] = desc
            entries.append(None)
            arrays.append(
                ArrayIn(
                    key,
                    container,
                    dtype_from_name(dtype),
                    tuple(shape),
                    SINGLE,
                    None,
                    {rank: ()},
                    no_data,
                    ranks=(source,),
                )
            )
        return new_root, arrays, entries


def _array_slots(entries: Sequence[dict[str, Any] | None]) -> list[int]:
    """Leaf index -> its index among the described arrays (-1 for a value)."""
    slots, n = [], 0
    for e in entries:
        slots.append(n if e is None else -1)
        n += e is None
    return slots


def _shifted(data: Any, by: int) -> Any:
    """A structure's JSON with its leaf indices moved by ``by``."""
    if type(data) is int:
        return data + by
    out = dict(data)
    out["c"] = [_shifted(c, by) for c in data["c"]]
    return out
