"""Rank workers of tests/test_per_rank.py: per-rank state saved and loaded by real gloo ranks."""

from __future__ import annotations

from typing import Any

import torch

import pytreeckpt
from pytreeckpt import PER_RANK


def rank_state(rank: int) -> dict[str, Any]:
    """What each rank holds for itself (an RNG state, a counter, a data position, torchtitan-style loader
    state under its own key) beside what every rank holds alike."""
    torch.manual_seed(1000 + rank)
    return {
        "rng": torch.get_rng_state(),
        "seen": torch.tensor([10 * rank + 7]),
        "pos": rank + 100,
        "dataloader": {f"dp_rank_{rank}": {"sample": 3 * rank, "order": torch.arange(4) + rank}},
        "w": torch.ones(4),
        "step": 5,
    }


SPEC = {"rng": PER_RANK, "seen": PER_RANK, "pos": PER_RANK, "dataloader": PER_RANK}


def empty_like_state(rank: int) -> dict[str, Any]:
    return {
        "rng": torch.zeros(5056, dtype=torch.uint8),
        "seen": torch.zeros(1, dtype=torch.int64),
        "pos": 0,
        "dataloader": {f"dp_rank_{rank}": {"sample": 0, "order": torch.zeros(4, dtype=torch.int64)}},
        "w": torch.zeros(4),
        "step": 0,
    }


def save_per_rank(rank: int, world: int, path: str, asynchronously: bool) -> dict[str, Any]:
    state = rank_state(rank)
    if asynchronously:
        pytreeckpt.async_save(path, state, SPEC).wait()
    else:
        pytreeckpt.save(path, state, SPEC)
    return state


def load_per_rank(rank: int, world: int, path: str, inplace: bool) -> dict[str, Any]:
    target = empty_like_state(rank)
    out = pytreeckpt.load(path, target, inplace=inplace)
    if inplace:
        assert out["seen"] is target["seen"]
    return out


def load_with_policy(rank: int, world: int, path: str, policy: str) -> Any:
    target = empty_like_state(rank)
    try:
        return pytreeckpt.load(path, target, per_rank=policy)
    except pytreeckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"


def load_no_target(rank: int, world: int, path: str, policy: str) -> Any:
    try:
        return pytreeckpt.load(path, per_rank=policy)
    except pytreeckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"


def save_unmarked(rank: int, world: int, path: str, what: str) -> str:
    """Save per-rank state without marking it: refused, naming the leaf."""
    state: dict[str, Any] = {"w": torch.ones(4), "step": 5}
    if what == "tensor":
        state["seen"] = torch.tensor([10 * rank + 7])
    elif what == "value":
        state["pos"] = rank + 100
    elif what == "big":
        state["big"] = torch.ones(1 << 20)  # 4 MiB: compared with check_replicas="all"
        state["big"][12345] = rank
    try:
        pytreeckpt.save(path, state, check_replicas="all" if what == "big" else "small")
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "saved"


def save_twice_unmarked(rank: int, world: int, path: str) -> str:
    """The same tree saved twice (the second save recognises it): a value that differs on the second is refused."""
    state: dict[str, Any] = {"w": torch.ones(4), "pos": 100, "seen": torch.tensor([7])}
    pytreeckpt.save(path + "/a", state)
    state["pos"] = 100 + rank
    try:
        pytreeckpt.save(path + "/b", state)
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "saved"


def save_mixed_marks(rank: int, world: int, path: str) -> str:
    spec = {"rng": PER_RANK} if rank == 0 else None
    try:
        pytreeckpt.save(path, {"rng": torch.zeros(3)}, spec)
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "saved"


def load_cast(rank: int, world: int, path: str) -> dict[str, Any]:
    """This rank's own per-rank leaves cast to the target's dtype (read by this rank alone)."""
    target = empty_like_state(rank)
    target["seen"] = torch.zeros(1, dtype=torch.int32)
    report = pytreeckpt.LoadReport()
    out = pytreeckpt.load(path, target, cast=True, report=report)
    assert report.cast == [(f"seen.rank{rank}", "int64", "int32")], report.cast
    return out


def _structures(rank: int, case: str) -> dict[str, Any]:
    """A state whose containers or leaf kinds differ between rank 0 and the others, as ``case`` says."""
    import collections

    t = torch.arange(4.0)
    first = rank == 0
    x: Any = {
        "tuple or list": (t, 1) if first else [t, 1],
        "dict or OrderedDict": {"a": t} if first else collections.OrderedDict(a=t),
        "list or deque": [t, 2] if first else collections.deque([t, 2]),
        "deque maxlen": collections.deque([t], maxlen=3 if first else 4),
        "defaultdict factory": collections.defaultdict(list if first else dict, {"a": t}),
        "key 1 or '1'": {1: t} if first else {"1": t},
        "tensor or numpy": t if first else t.numpy().copy(),
    }[case]
    return {"w": torch.ones(2), "x": x, "step": 3}


def save_structures(rank: int, world: int, path: str, case: str) -> str:
    """Save a state whose structure differs between ranks: refused on every rank, naming where."""
    try:
        pytreeckpt.save(path, _structures(rank, case))
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "saved"


def empty_part_on_one_rank(rank: int, world: int, path: str, extra: bool) -> Any:
    """Rank 0's per-rank subtree holds leaves, rank 1's is empty: each loads its own back (with ``extra``, rank 1's
    target asks for a leaf its saved part lacks, and rank 0's lacks one its part has: refused on both)."""
    state = {"data": {} if rank else {"pos": torch.tensor([5]), "n": 3}, "w": torch.ones(2)}
    pytreeckpt.save(path, state, {"data": PER_RANK})
    target: dict[str, Any] = {"data": {} if rank else {"pos": torch.zeros(1, dtype=torch.int64), "n": 0}}
    target["w"] = torch.zeros(2)
    if extra:
        target["data"] = {"pos": torch.zeros(1, dtype=torch.int64)}
    try:
        return pytreeckpt.load(path, target)
    except pytreeckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
