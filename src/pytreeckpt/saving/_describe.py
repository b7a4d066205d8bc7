"""A save's first stages: the tree described leaf by leaf, the ranks agreed on it, this rank's part planned.

Each leaf is described by its kind (:data:`pytreeckpt.leaves.KINDS`); a tree like one
saved before takes that save's description and plan (``_recall``) and describes only its
data. In a distributed save a rank's failure before the agreement is carried into it
(:class:`~pytreeckpt.distributed._agree.Carried`): a rank that raised alone would never
join it and leave the others waiting for its timeout.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._errors import CheckpointError, where
from pytreeckpt.core._keys import check_unique_keys
from pytreeckpt.core._per_rank import PER_RANK
from pytreeckpt.core._sharding import Layout
from pytreeckpt.core._tree import broadcast_prefix, flatten
from pytreeckpt.distributed._agree import Carried, agree_on_specs, everyone
from pytreeckpt.execute._executor import PieceData
from pytreeckpt.format import Compression
from pytreeckpt.leaves import (
    KINDS,
    SINGLE,
    ArrayIn,
    Describing,
    expand_save,
    is_leaf,
    plain_data,
    span,
    value_entry,
)
from pytreeckpt.plan import ArraySpec, ChunkingOptions, PlanCache, SavePlan, plan_save, plan_whole, spec_plan_key

from ._per_rank import Sites
from ._recall import Recalled, Remembered, recall, remember

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

__all__ = ["SAVE_PLANS", "Planned", "plan_state", "user_metadata_of"]

SMALL_REPLICA = 1 << 20
"""The largest plain tensor every rank holds that a distributed save compares across ranks by default (larger
ones with ``check_replicas="all"``: a crc32c of 1 GiB of DDP weights on every rank made their save 1.19-1.22x
as long)."""

SAVE_PLANS = PlanCache(4)  # the plans of the last few saves: a save in the layout of one of them reuses its plan


@dataclass(slots=True)
class Planned:
    """A state described and planned on this rank: what save() writes and what plan_save() returns."""

    arrays: list[ArrayIn]  # the array leaves as described (their data in the next three)
    data: list[PieceData]
    devices: list[Any]
    watches: list[tuple[torch.Tensor, ...]]
    entries: list[dict[str, Any] | None]  # a plain Python leaf's metadata, None for an array
    root: Any
    user: dict[str, Any]
    codecs: dict[str, Any]
    plan: SavePlan
    rank: int | None  # the rank planned for; None: every rank (a single process)
    memo: Remembered | None  # how the next save of such a tree recognises it (saving/_recall.py)


def plan_state(
    chunking: ChunkingOptions,
    tree: Any,
    spec: Any,
    user_metadata: Mapping[str, Any] | None,
    namespace: str,
    comm: Comm | None,
    compression: Any,
    carried: Carried,
    plan_only: bool = False,
    check_replicas: str = "small",
) -> Planned | None:
    """Describe the tree's leaves, agree with the other ranks, and plan this rank's part (None if this rank failed)."""
    options = chunking
    context = (None if comm is None else comm.world, None if comm is None else comm.rank, options, plan_only, namespace)
    if spec is None and compression is None:
        got = recall(tree, context)
        if got is not None:  # a tree like one saved before: its description and plan, with this tree's data
            return _recalled(got, user_metadata, comm, carried, check_replicas)
    d = Describing(comm, plan_only)
    user: dict[str, Any] = {}
    codecs: dict[str, Any] = {}
    root: Any = None
    leaves: list[Any] = []
    keys: list[str] = []
    objects = False  # whether the tree held objects (saved as their state dicts)
    kinds: list[str] = []  # each leaf's kind, for the ranks to compare with the tree's containers
    sites = Sites()
    with carried.catch():
        leaves, paths, root = flatten(tree, is_leaf, namespace=namespace, keys=keys)
        expanded = expand_save(leaves, keys, root)  # objects as their state dicts (None: the tree holds none)
        if expanded is not None:  # (before the spec is broadcast: a spec at an object's key covers its state)
            objects, keys = True, []
            leaves, paths, root = flatten(expanded, is_leaf, namespace=namespace, keys=keys)
        leaf_specs = broadcast_prefix(spec, root, _is_spec, len(leaves), namespace=namespace, covers=sites.cover)
        if sites.nodes:
            sites.rename(paths, keys, 0 if comm is None else comm.rank)
        keys = check_unique_keys(paths, keys)
        user = user_metadata_of(user_metadata)
        codecs = _compressions(compression, root, keys, len(leaves), namespace)
        kind = KINDS.kind
        with torch.no_grad():  # (a DTensor's to_local is then its local tensor, not an autograd call)
            for key, leaf, sp in zip(keys, leaves, leaf_specs, strict=True):
                try:  # (what carried.catch(key) does, without entering a block per leaf)
                    k = kind(leaf)
                    k.describe(key, leaf, sp, d)
                    kinds.append(k.name)
                except Exception as e:
                    carried.carry(e, key)
                    break
    entries = d.entries
    own = sites.own_keys(keys) if sites.nodes else frozenset()  # this rank's per-rank leaves
    shared = [a for a in d.arrays if a.key not in own] if own else d.arrays
    base: tuple[Any, ...] | None = None
    agreed: tuple[tuple[Any, ...], bytes] | None = None
    specs: list[ArraySpec] = []
    if comm is not None:
        contents: list[tuple[str, int]] = []
        with carried.catch():
            specs = [a.spec() for a in shared]
            contents = replica_contents(shared, [a.get for a in shared], comm.rank, entries, own, check_replicas)
        values = [k for k in d.values if k not in own] if own else d.values
        dtypes = [a.dtype.name for a in shared]
        outline = None
        with carried.catch():
            outline = root.outline(kinds, set(sites.paths)) if carried.error is None else None
        agreed = agree_on_specs(
            comm, specs, dtypes, "save", carried.error, values, None, contents, sites.keys(), outline
        )
        base = None if agreed is None or sites.nodes else agreed[0]  # (per-rank parts: planned anew below)
    if sites.nodes:
        mine: Any = None
        with carried.catch():
            mine = sites.own(d, codecs)
        gathered = everyone(comm, mine) if comm is not None else [mine]
        with carried.catch():
            failed = [r for r, g in enumerate(gathered) if g is None]
            if failed and carried.error is None:
                raise CheckpointError(f"ranks {failed} failed to describe their per-rank state")
            root, d.arrays, entries = sites.combine(root, d, gathered, 0 if comm is None else comm.rank, codecs)
    arrays = d.arrays
    # In a single process of one rank, arrays held whole as one chunk are planned by
    # plan_whole, without tables (the same plans: tests/test_plan.py); the others by plan_save.
    whole: list[bool] = []
    if comm is None and all(a.layout is SINGLE and a.ranks is None for a in arrays):
        limit = options.single_chunk_bytes
        whole = [0 not in a.shape and math.prod(a.shape) * a.dtype.itemsize <= limit for a in arrays]
    if comm is None or sites.nodes:  # (every rank's per-rank parts were combined: on a rank whose own is empty too)
        with carried.catch():
            specs = [a.spec() for a, w in itertools.zip_longest(arrays, whole) if not w]
    dtypes = [a.dtype.name for a in arrays]
    if comm is not None:
        world = comm.world
    elif whole:
        world = 1  # (every array held whole by this one process)
    else:
        world = max((span(a.layout, a.ranks) for a in arrays), default=1)
    with carried.catch():
        rank = None if comm is None else comm.rank
        plan_key = spec_plan_key(specs, world, options, rank) if base is None else (*base, world, options, rank)
        plan = SAVE_PLANS.get_or(plan_key, lambda: plan_save(specs, world, rank=rank, options=options))
        if any(whole):
            planned = iter(plan.arrays)
            plan = SavePlan(
                world,
                tuple(
                    plan_whole(a.key, a.shape, a.dtype.itemsize) if w else next(planned)
                    for a, w in zip(arrays, whole, strict=True)
                ),
            )
        for a, ap in zip(arrays, plan.arrays, strict=True):
            if a.present is not None and comm is None:
                for op in ap.writes:
                    for frag in op.sources:
                        if frag.rank not in a.present:
                            raise CheckpointError(
                                f"leaf {where(a.key)}: elements {frag.region} live only on rank {frag.rank}, "
                                f"whose shard is not in this ShardedLeaf (it holds ranks {sorted(a.present)})"
                            )
        data = [a.get for a in arrays]
        devices, watches = [a.device for a in arrays], [a.watch for a in arrays]
        memo = None
        if spec is None and compression is None and not objects:  # (after the data is taken: remember takes it
            # out of arrays; a tree of objects is never recognised: its leaves are not its objects)
            memo = remember(context, leaves, keys, root, arrays, codecs, plan, specs, dtypes, agreed)
        return Planned(arrays, data, devices, watches, entries, root, user, codecs, plan, rank, memo)
    return None


def _recalled(
    got: Recalled, user_metadata: Mapping[str, Any] | None, comm: Comm | None, carried: Carried, check_replicas: str
) -> Planned:
    """A tree like one saved before, planned as that one was: only its data and its Python values are new."""
    was, leaves = got.was, got.leaves
    user: dict[str, Any] = {}
    entries: list[dict[str, Any] | None] = [None] * len(leaves)
    data = [a.get for a in was.arrays]  # (an Abstract's: it refuses to be read)
    watches: list[tuple[torch.Tensor, ...]] = [()] * len(data)
    with carried.catch():
        user = user_metadata_of(user_metadata)
        if was.only_tensors:  # (the common case, its loops in C)
            data = list(map(plain_data, leaves, was.regions))
            watches = list(zip(leaves))
        else:
            for i, region in zip(was.tensors, was.regions, strict=True):
                t, j = leaves[i], was.array_of[i]
                data[j] = plain_data(t, region)
                watches[j] = (t,)
    for i in was.values:
        with carried.catch(was.keys[i]):
            entries[i] = value_entry(was.keys[i], leaves[i])
    if comm is not None:
        values = [was.keys[i] for i in was.values]
        contents: list[tuple[str, int]] = []
        with carried.catch():
            contents = replica_contents(was.arrays, data, comm.rank, entries, frozenset(), check_replicas)
        agree_on_specs(comm, was.specs, was.dtypes, "save", carried.error, values, was.agreed, contents)
    rank = None if comm is None else comm.rank
    devices = [None] * len(data)  # (CPU tensors and Abstract leaves)
    return Planned(was.arrays, data, devices, watches, entries, was.root, user, was.codecs, was.plan, rank, was)


def _is_spec(x: Any) -> bool:
    """A leaf of the spec tree: a layout, or the per-rank marker."""
    return isinstance(x, Layout) or x is PER_RANK


def replica_contents(
    arrays: Sequence[ArrayIn],
    data: Sequence[PieceData],
    rank: int,
    entries: Sequence[dict[str, Any] | None],
    own: frozenset[str],
    check: str = "small",
) -> list[tuple[str, int]]:
    """A checksum of each leaf this rank holds whole and saves once with the other ranks' copies (Python values,
    and plain tensors and numpy arrays in host memory: of at most :data:`SMALL_REPLICA` bytes, or all with
    ``check="all"``), by key, for the ranks to compare (``agree_on_specs``)."""
    out = []
    for e in entries:
        if e is not None and e["key"] not in own:
            out.append((e["key"], crc32c(json.dumps(e["value"], sort_keys=True).encode("utf-8", "surrogatepass"))))
    limit = None if check == "all" else SMALL_REPLICA
    for a, get in zip(arrays, data, strict=True):
        if a.replica and a.device is None and (limit is None or math.prod(a.shape) * a.dtype.itemsize <= limit):
            view, _ = get(rank, 0)
            out.append((a.key, crc32c(np.ascontiguousarray(view).reshape(-1).view(np.uint8))))
    return out


def user_metadata_of(user_metadata: Any) -> dict[str, Any]:
    """``user_metadata`` as the JSON object it will be stored as; refused unless it comes back equal."""
    if user_metadata is None:
        return {}
    if not isinstance(user_metadata, Mapping):
        raise CheckpointError(
            f"user_metadata must be a mapping from str to JSON values (a JSON object), found "
            f"{type(user_metadata).__name__}"
        )
    user = dict(user_metadata)
    try:
        again = json.loads(json.dumps(user, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"user_metadata is not a JSON object: {e}") from None
    if again != user or not _same_json_types(again, user):
        raise CheckpointError(
            "user_metadata would not come back equal: it must be a JSON object, with str keys and values that "
            "are str, int, float, bool, None, lists and dicts of them (tuples come back as lists, other keys "
            "as str)"
        )
    return user


def _same_json_types(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_json_types(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return all(_same_json_types(x, y) for x, y in zip(a, b, strict=True))
    return True


def _is_compression(x: Any) -> bool:
    return x is None or isinstance(x, (str, Compression))


def _compressions(compression: Any, root: Any, keys: list[str], n: int, namespace: str) -> dict[str, Any]:
    """Each leaf's Compression (or None) from a prefix tree of compressions."""
    if compression is None:
        return dict.fromkeys(keys)
    chosen = broadcast_prefix(compression, root, _is_compression, n, namespace=namespace)
    out = {}
    for key, c in zip(keys, chosen, strict=True):
        try:
            out[key] = Compression.parse(c)
        except ValueError as e:
            raise CheckpointError(f"leaf {where(key)}: {e}") from None
    return out
