"""A load's per-rank parts: each rank matched to the subtree it saved, or the load's ``per_rank`` policy applied.

A checkpoint's per-rank parts are its ``per_rank`` nodes (:mod:`pytreeckpt.core._per_rank`),
one subtree per saving rank. At the world size that saved them, each rank's target (or,
without a target, the stored tree) takes its own rank's subtree there; its leaves are read
by this rank alone (``local``), outside the plan the ranks make together. At another world
size the policy decides: ``"own"`` refuses, naming each part and both world sizes;
``"keep"`` keeps the target's own leaves there; ``"all"`` gives every rank a
:class:`~pytreeckpt.PerRank` of every saved rank's subtree (with ``"all"`` at any world size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytreeckpt.core._errors import CheckpointError, MetadataError
from pytreeckpt.core._keys import KeyEntry, keystr
from pytreeckpt.core._node import Node, leaf_node
from pytreeckpt.core._per_rank import PER_RANK_POLICIES, rank_entry
from pytreeckpt.format import ArrayMeta, ValueMeta

__all__ = ["SKIP", "PerRankParts", "per_rank_sites"]

SKIP: Any = object()  # a target leaf whose result is known without the checkpoint (kept, or replaced by a site)

Site = tuple[tuple[KeyEntry, ...], Node]


def per_rank_sites(tree: Node) -> list[Site]:
    """The stored tree's per-rank nodes and their key paths, in the tree's order (none nested in another).

    Raises:
      MetadataError: a per_rank node inside another (a save never writes one).
    """
    out: list[Site] = []

    def walk(node: Node, path: tuple[KeyEntry, ...], inside: bool) -> None:
        if node.kind == "per_rank":
            if inside:
                raise MetadataError(
                    f"tree structure at key path {keystr(path)!r}: a per_rank node inside another (a save never "
                    f"writes one)"
                )
            out.append((path, node))
        for e, c in zip(node.entries, node.children, strict=True):
            if c.kind != "leaf":
                walk(c, (*path, e), inside or node.kind == "per_rank")

    walk(tree, (), False)
    return out


def check_policy(policy: str) -> None:
    if policy not in PER_RANK_POLICIES:
        raise CheckpointError(f"per_rank must be one of {PER_RANK_POLICIES}, found {policy!r}")


@dataclass(slots=True)
class PerRankParts:
    """A load's target (or the stored tree) resolved against the checkpoint's per-rank parts.

    After :meth:`target` or :meth:`stored`: ``structure`` (the result's), ``t_leaves`` and
    ``stored_of`` (each result leaf's target and stored leaf; :data:`SKIP` where the result is
    known now, in ``kept``), ``local`` (the result leaves this rank reads alone), ``problems``.
    """

    sites: list[Site]
    policy: str
    rank: int
    world: int
    structure: Node | None = None
    t_leaves: list[Any] = field(default_factory=list)
    stored_of: list[Any] = field(default_factory=list)
    local: set[int] = field(default_factory=set)
    kept: dict[int, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    touched: set[tuple[KeyEntry, ...]] = field(default_factory=set)  # the parts the target has (its leaves not
    # matched against other ranks' subtrees there)
    left: list[str] = field(default_factory=list)  # the keys of this rank's own stored leaves the target lacks

    def _refused(self, path: tuple[KeyEntry, ...], saved: int) -> None:
        self.problems.append(
            f"leaf {keystr(path)!r} is per rank, saved by {saved} ranks, and this load runs on {self.world}: "
            f"pass per_rank='keep' to keep the target's own there, or per_rank='all' to get every saved rank's"
        )

    def stored(self, doc_tree: Node, leaves: Sequence[ArrayMeta | ValueMeta]) -> None:
        """No target: the stored tree, each per-rank part as this rank's own subtree (or every rank's, ``"all"``)."""
        self.t_leaves = [None] * len(leaves)
        self.stored_of = list(leaves)
        if self.policy == "all":
            self.structure = doc_tree
            self.local = {i for _, node in self.sites for i in node.leaf_indices()}
            return
        swap: dict[int, Node] = {}
        for path, node in self.sites:
            if len(node.children) != self.world:
                if self.policy == "keep":
                    self.problems.append(
                        f"leaf {keystr(path)!r} is per rank, saved by {len(node.children)} ranks, and this load "
                        f"runs on {self.world}: per_rank='keep' keeps a target's leaves, and no target was given; "
                        f"pass per_rank='all' to get every saved rank's"
                    )
                else:
                    self._refused(path, len(node.children))
                continue
            swap[id(node)] = node.children[self.rank]
            self.local.update(node.children[self.rank].leaf_indices())
        self.structure = _view(doc_tree, swap)
        shown = set(self.structure.leaf_indices())
        self.stored_of = [m if i in shown else SKIP for i, m in enumerate(leaves)]

    def target(
        self,
        t_leaves: list[Any],
        t_paths: Sequence[tuple[KeyEntry, ...]],
        structure: Node,
        by_path: dict[tuple[KeyEntry, ...], ArrayMeta | ValueMeta],
        leaves: Sequence[ArrayMeta | ValueMeta],
    ) -> None:
        """A target: each leaf under a per-rank part matched to this rank's stored one, kept, or the part replaced."""
        at = dict(self.sites)
        lengths = sorted({len(p) for p in at})
        self.touched.update(p for p in at if _has(structure, p))  # (an empty subtree there too)
        asked: set[tuple[KeyEntry, ...]] = set()
        stored_of: list[Any] = []
        refused: set[tuple[KeyEntry, ...]] = set()
        spliced: list[Site] = []
        for i, p in enumerate(t_paths):
            site = next((p[:n] for n in lengths if len(p) >= n and p[:n] in at), None)
            if site is None:
                stored_of.append(by_path.get(p))
                continue
            node, n = at[site], len(site)
            saved = len(node.children)
            self.touched.add(site)
            if self.policy == "all":
                stored_of.append(SKIP)
                if all(site != q for q, _ in spliced):
                    spliced.append((site, node))
            elif saved == self.world:
                asked.add((*site, rank_entry(self.rank), *p[n:]))
                stored_of.append(by_path.get((*site, rank_entry(self.rank), *p[n:])))
                self.local.add(i)
            elif self.policy == "keep":
                stored_of.append(SKIP)
                self.kept[i] = t_leaves[i]
            else:
                stored_of.append(SKIP)
                if site not in refused:
                    refused.add(site)
                    self._refused(site, saved)
        if self.policy != "all":  # (this rank's own part, at the world that saved it: matched leaf by leaf)
            for site in sorted(self.touched, key=lambda p: [keystr(p)]):
                node = at[site]
                if len(node.children) == self.world:
                    own = node.children[self.rank]
                    prefix = (*site, rank_entry(self.rank))
                    self.left += [
                        leaves[i].key
                        for i, q in zip(own.leaf_indices(), own.paths(), strict=True)
                        if (*prefix, *q) not in asked
                    ]
        self.t_leaves, self.stored_of, self.structure = t_leaves, stored_of, structure
        for path, node in spliced:
            self.structure = self._splice(self.structure, path, node, leaves)

    def _splice(
        self, structure: Node, path: tuple[KeyEntry, ...], node: Node, leaves: Sequence[ArrayMeta | ValueMeta]
    ) -> Node:
        """``structure`` with the subtree at ``path`` replaced by every saved rank's (``node``, its leaves appended
        as new result leaves read by this rank alone)."""

        def copy(n: Node) -> Node:
            if n.kind == "leaf":
                self.t_leaves.append(None)
                self.stored_of.append(leaves[n.leaf])
                self.local.add(len(self.t_leaves) - 1)
                return leaf_node(len(self.t_leaves) - 1)
            return Node(n.kind, n.entries, [copy(c) for c in n.children], n.type, n.type_name, n.extra)

        new = copy(node)
        if not path:
            return new
        parent = structure
        for e in path[:-1]:
            parent = parent.children[list(parent.entries).index(e)]
        kids = list(parent.children)
        kids[list(parent.entries).index(path[-1])] = new
        parent.children = kids
        return structure


def _has(node: Node, path: tuple[KeyEntry, ...]) -> bool:
    """Whether the tree ``node`` holds a node at key path ``path``."""
    for e in path:
        if node.kind == "leaf" or e not in node.entries:
            return False
        node = node.children[list(node.entries).index(e)]
    return True


def _view(node: Node, swap: dict[int, Node]) -> Node:
    """``node`` with the nodes in ``swap`` replaced (a copy of the path to each; the rest shared)."""
    got = swap.get(id(node))
    if got is not None:
        return got
    if node.kind == "leaf" or not any(c.kind != "leaf" for c in node.children):
        return node
    kids = [_view(c, swap) for c in node.children]
    if all(a is b for a, b in zip(kids, node.children, strict=True)):
        return node
    return Node(node.kind, node.entries, kids, node.type, node.type_name, node.extra)
