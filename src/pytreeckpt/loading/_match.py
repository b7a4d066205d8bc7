"""A load's second stage: its document read (by rank 0, sent to the others) and its target matched against it.

Each target leaf's kind (:mod:`pytreeckpt.leaves`) says where its stored leaf goes: a
value now, a small whole array read without a plan, or a destination the plan reads into
(:class:`~pytreeckpt.leaves.Dest`). Without a target, the stored leaves' own kinds make
them anew. Every mismatch is listed at once, before any array is read.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pytreeckpt.core._errors import TargetMismatchError, where
from pytreeckpt.core._keys import KeyEntry, keystr
from pytreeckpt.core._node import Node, leaf_node
from pytreeckpt.core._tree import flatten
from pytreeckpt.distributed._agree import Carried, from_rank0
from pytreeckpt.format import ArrayMeta, CheckpointDoc, ValueMeta
from pytreeckpt.leaves import KINDS, Buffers, Matching, Objects, expand_target, is_leaf
from pytreeckpt.storage import ExecutorOptions, Storage
from pytreeckpt.storage._location import Where, describe

from ._inspect import ambiguity_error, ambiguous_keys
from ._open import check_memory, parse
from ._per_rank import SKIP, PerRankParts, per_rank_sites
from ._report import LoadReport

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

__all__ = ["LoadRequest", "Matched", "match"]


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """What ``load`` (or ``plan_load``) was asked: its arguments, the process group made a Comm."""

    path: Where
    target: Any
    namespace: str
    executor: ExecutorOptions | None
    include: str | Sequence[str] | None
    comm: Comm | None
    inplace: bool = False
    plan_only: bool = False  # plan_load: the plan only, no array read
    cast: bool = False  # a target of another dtype gets the stored array converted to it
    strict: bool = True  # False: the target's leaves the checkpoint lacks are kept, stored leaves left are no error
    report: LoadReport | None = None  # filled in with what was missing, left over, cast
    per_rank: str = "own"  # what a per-rank part gives at another world size (loading/_per_rank.py)


@dataclass(slots=True)
class Matched:
    """A load's target matched: where each result comes from (``matching``), and the tree they go into."""

    storage: Storage
    matching: Matching
    structure: Node
    local: Matching | None = None  # in a distributed load, this rank's own per-rank leaves: read by it alone
    objects: Objects | None = None  # the target's objects: the result is objects.restore(results)


def match(request: LoadRequest, carried: Carried, seen: list[bytes] | None) -> Matched | None:
    """Read the document and match the target against it (None if this rank failed: ``carried`` holds why)."""
    comm = request.comm
    raw = None
    storage: Storage | None = None
    with carried.catch():
        storage = Storage(request.path, request.executor)
        if comm is None or comm.rank == 0:
            raw = storage.read_metadata()
            if seen is not None:
                seen.append(raw)  # to tell, after a failure, whether the checkpoint was replaced meanwhile
    if comm is not None:  # (rank 0's document, or its failure, which every rank raises)
        raw = from_rank0(comm, carried, raw, "reading the checkpoint metadata")
        if carried.error is not None:  # this rank's failure: the agreement on the layouts raises it on every rank
            return None
    assert raw is not None
    assert storage is not None
    matched = None
    with carried.catch():
        matched = _match(request, storage, parse(storage, raw, request.namespace), carried)
    return matched


def _match(request: LoadRequest, storage: Storage, doc: CheckpointDoc, carried: Carried) -> Matched:
    target, include, path = request.target, request.include, request.path
    t_paths: list[tuple[KeyEntry, ...]] | None = None  # the target's key paths (None: the stored tree's)
    objects: Objects | None = None  # the target's objects, restored after the read
    stored_of: list[ArrayMeta | ValueMeta | None]
    if include is None and target is None:  # the stored tree: its leaves in order, no paths to match
        t_leaves: list[Any] = [None] * len(doc.leaves)
        structure: Node = doc.tree
        stored_of = list(doc.leaves)
    else:
        stored_paths = doc.tree.paths()
        by_path = dict(zip(stored_paths, doc.leaves, strict=True))
    if include is not None:
        if target is not None:
            raise TargetMismatchError("include= selects leaves of the stored tree; give it with target=None")
        patterns = [include] if isinstance(include, str) else list(include)
        chosen = [
            (p, leaf)
            for p, leaf in zip(stored_paths, doc.leaves, strict=True)
            if any(fnmatch.fnmatchcase(leaf.key, pat) for pat in patterns)
        ]
        ambiguous = ambiguous_keys(doc)
        for _, leaf in chosen:
            if leaf.key in ambiguous:
                raise ambiguity_error(leaf.key, ambiguous[leaf.key], describe(path))
        t_leaves = [None] * len(chosen)
        t_paths = [p for p, _ in chosen]
        structure = Node("dict", [("s", leaf.key) for _, leaf in chosen], [leaf_node(i) for i in range(len(chosen))])
    elif target is not None:
        t_leaves, t_paths, structure = flatten(target, is_leaf, namespace=request.namespace)
        me, world = (0, 1) if request.comm is None else (request.comm.rank, request.comm.world)
        objects = expand_target(t_leaves, t_paths, structure, doc.tree, doc.leaves, request.namespace, me, world)
        if objects is not None:  # the target's objects as the checkpoint's subtrees at their keys
            t_leaves, t_paths, structure = flatten(objects.tree, is_leaf, namespace=request.namespace)
    given = len(t_leaves)
    sites = per_rank_sites(doc.tree) if include is None else []
    parts = None
    if sites:
        comm = request.comm
        parts = PerRankParts(
            sites, request.per_rank, 0 if comm is None else comm.rank, 1 if comm is None else comm.world
        )
        if target is None:
            parts.stored(doc.tree, doc.leaves)
        else:
            parts.target(t_leaves, t_paths, structure, by_path, doc.leaves)  # type: ignore[arg-type]
            if objects is not None and request.per_rank == "all" and parts.touched:
                raise TargetMismatchError(
                    "load(..., per_rank='all') puts every saved rank's subtree in place of the target's, which a "
                    "target holding objects (restored in place) cannot take: load with per_rank='keep', or read "
                    "every rank's part with load(path, per_rank='all') and no target"
                )
        assert parts.structure is not None
        structure, t_leaves, stored_of = parts.structure, parts.t_leaves, parts.stored_of
    elif t_paths is not None:
        stored_of = [by_path.get(p) for p in t_paths]
    unexpected: list[str] = []
    if target is not None:  # the stored leaves the target does not ask for (not read)
        covered = parts.touched if parts is not None else set()  # (per-rank parts the target has: its policy's)
        unexpected = _unexpected(stored_paths, doc, t_paths, covered)  # type: ignore[arg-type]
        if parts is not None:
            unexpected += parts.left
    # Before any destination is allocated: the stored bytes must back every claimed shape.
    wanted = [m for m in stored_of if type(m) is ArrayMeta]
    if not request.plan_only:  # (a plan reads no array: it needs only the metadata)
        storage.check_stored_sizes(wanted)
    target_given = target is not None
    if not target_given:  # whole arrays of the shapes the metadata claims (a target's shapes are the caller's)
        check_memory(path, [(m.key, m.nbytes) for m in wanted])
    # New memory for cold reads around the page cache is faulted in by the reads, in 4 KiB pages (Storage.cold).
    cold = not request.plan_only and not request.inplace and storage.cold(wanted)
    buffers = Buffers(huge=storage.options.huge_pages and not cold, meta=request.plan_only, prefault=not cold)
    lean = request.comm is None and not request.plan_only  # small whole arrays may be read without a plan
    m = Matching(request.comm, buffers, request.inplace, storage.small_whole if lean else None, [None] * len(t_leaves))
    m.cast = request.cast
    missing: list[str] = []
    if objects is not None:
        m.problems.extend(objects.problems)
    kind, of_stored = KINDS.kind, KINDS.stored
    local = None
    if parts is not None:
        m.problems += parts.problems
        for i, leaf in parts.kept.items():
            m.results[i] = leaf
        if request.comm is not None and parts.local:
            local = Matching(None, buffers, request.inplace, None, m.results, problems=m.problems)
            local.cast = request.cast
    with torch.no_grad():  # (a DTensor's to_local is then its local tensor, not an autograd call)
        for i, (leaf, stored) in enumerate(zip(t_leaves, stored_of, strict=True)):
            if stored is None:
                # (a leaf found by its path has the key the save gave that path: keystr's, made once then)
                missing.append(keystr(t_paths[i]))  # type: ignore[index]
                if request.strict:
                    m.problems.append(f"leaf {where(missing[-1])} of the target is not in the checkpoint")
                else:
                    m.results[i] = leaf  # (strict=False: the target's own leaf stays)
                continue
            if stored is SKIP:
                continue
            into = m if local is None or i not in parts.local else local  # type: ignore[union-attr]
            try:  # (what carried.catch(key) does, without entering a block per leaf)
                as_target = target_given and i < given  # (past them: every saved rank's leaves, per_rank="all")
                (kind(leaf) if as_target else of_stored(stored)).destination(i, stored.key, stored, leaf, into)
            except Exception as e:
                carried.carry(e, stored.key)
    if request.strict and unexpected:
        m.problems += [f"leaf {where(k)} of the checkpoint is not in the target" for k in unexpected]
        m.problems.append("(load(..., strict=False) loads the leaves both have and reports the others)")
    m.unstand()
    if local is not None:
        local.unstand()
    if request.report is not None:
        report = request.report
        casts = m.casts if local is None else sorted(m.casts + local.casts)
        report.missing[:], report.unexpected[:], report.cast[:] = missing, unexpected, casts
    if m.problems:
        raise TargetMismatchError(
            f"the target does not match the checkpoint at {describe(path)}:\n  " + "\n  ".join(m.problems)
        )
    return Matched(storage, m, structure, local, objects)


def _unexpected(
    stored_paths: list[tuple[KeyEntry, ...]], doc: CheckpointDoc, t_paths: list[Any], covered: set[Any]
) -> list[str]:
    """The keys of the stored leaves whose paths the target lacks, in the stored order (the leaves of per-rank
    parts the target has, ``covered``, are not: the load's per_rank policy says which it reads)."""
    if len(stored_paths) == len(t_paths) and stored_paths == t_paths:  # (the common case: the tree saved)
        return []
    asked = set(t_paths)
    lengths = sorted({len(c) for c in covered})
    return [
        leaf.key
        for p, leaf in zip(stored_paths, doc.leaves, strict=True)
        if p not in asked and not any(p[:n] in covered for n in lengths)
    ]
