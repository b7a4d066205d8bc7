"""Per-rank state (issue 41 items 1 and 2): each rank's own RNG, counters, data positions and ``dp_rank_<r>``
subtrees saved and given back to it, never collapsed silently to one rank's copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import per_rank_workers as w
import pytest
import torch
from multiproc import run_world

import pytreeckpt
from pytreeckpt import PER_RANK, PerRank

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def _same(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), (got, want)
        assert list(got) == list(want), (got, want)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert torch.equal(torch.as_tensor(got), want), (got, want)
    else:
        assert got == want, (got, want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    path = tmp_path_factory.mktemp("per_rank") / "ckpt"
    return path, run_world(2, w.save_per_rank, str(path), False)


@pytest.mark.parametrize("inplace", [False, True])
def test_each_rank_gets_its_own_state_back(saved: tuple[Path, list[dict[str, Any]]], inplace: bool) -> None:
    path, states = saved
    got = run_world(2, w.load_per_rank, str(path), inplace)
    for rank in range(2):
        _same(got[rank], states[rank])
    assert not torch.equal(states[0]["rng"], states[1]["rng"])


def test_async_save_keeps_each_ranks_state(tmp_path: Path) -> None:
    states = run_world(2, w.save_per_rank, str(tmp_path / "a"), True)
    got = run_world(2, w.load_per_rank, str(tmp_path / "a"), False)
    for rank in range(2):
        _same(got[rank], states[rank])


def test_metadata_shows_per_rank_parts(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    path, _states = saved
    meta = pytreeckpt.metadata(path)
    assert isinstance(meta.tree["seen"], PerRank)
    assert meta.tree["seen"].world == 2
    assert meta.tree["pos"] == {0: 100, 1: 101}
    assert list(meta.tree["dataloader"][1]) == ["dp_rank_1"]
    assert "seen.rank1" in meta.arrays
    assert "dataloader.rank0.dp_rank_0.order" in meta.arrays
    assert not isinstance(meta.tree["w"], PerRank)


def test_another_world_size_follows_the_policy(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    path, states = saved
    # the default: refused, naming the per-rank parts and both world sizes
    for got in (pytreeckpt.load, lambda p: pytreeckpt.load(p, w.empty_like_state(0))):
        with pytest.raises(pytreeckpt.CheckpointError) as e:
            got(path)
        text = str(e.value)
        assert "'seen' is per rank, saved by 2 ranks, and this load runs on 1" in text
        assert "'dataloader'" in text
        assert "per_rank='keep'" in text
        assert "per_rank='all'" in text
    # keep: the target's own leaves stay there, the rest loads
    target = w.empty_like_state(0)
    out = pytreeckpt.load(path, target, per_rank="keep")
    assert out["seen"] is target["seen"]
    assert out["pos"] == 0
    assert out["dataloader"] is not None
    assert out["step"] == 5
    assert torch.equal(out["w"], torch.ones(4))
    # all: every saved rank's, by rank, in place of the target's subtree
    out = pytreeckpt.load(path, w.empty_like_state(0), per_rank="all")
    assert isinstance(out["seen"], PerRank)
    _same(dict(out["seen"]), {0: states[0]["seen"], 1: states[1]["seen"]})
    _same(dict(out["dataloader"]), {r: states[r]["dataloader"] for r in range(2)})
    assert out["pos"] == {0: 100, 1: 101}
    out = pytreeckpt.load(path, per_rank="all")
    _same(dict(out["rng"]), {0: states[0]["rng"], 1: states[1]["rng"]})


def test_four_ranks_load_two_ranks_state_by_policy(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    path, states = saved
    errors = run_world(4, w.load_with_policy, str(path), "own")
    for text in errors:
        assert isinstance(text, str)
        assert "saved by 2 ranks, and this load runs on 4" in text
    kept = run_world(4, w.load_with_policy, str(path), "keep")
    for _rank, out in enumerate(kept):
        assert out["pos"] == 0
        assert out["step"] == 5
        assert int(out["seen"][0]) == 0
    every = run_world(4, w.load_no_target, str(path), "all")
    for out in every:
        assert out["pos"] == {0: 100, 1: 101}
        _same(out["dataloader"], {r: states[r]["dataloader"] for r in range(2)})


def test_single_process_per_rank_save_is_rank_0_of_one(tmp_path: Path) -> None:
    state = w.rank_state(0)
    pytreeckpt.save(tmp_path / "c", state, w.SPEC)
    _same(pytreeckpt.load(tmp_path / "c"), state)
    _same(pytreeckpt.load(tmp_path / "c", w.empty_like_state(0)), state)
    assert pytreeckpt.metadata(tmp_path / "c").tree["seen"].world == 1


@pytest.mark.parametrize("what", ["tensor", "value", "big"])
def test_unmarked_state_that_differs_is_refused(tmp_path: Path, what: str) -> None:
    got = run_world(2, w.save_unmarked, str(tmp_path / "c"), what)
    leaf = {"tensor": "seen", "value": "pos", "big": "big"}[what]
    for text in got:
        assert f"leaf '{leaf}' differs between rank 0 and rank 1" in text
        assert f"spec={{'{leaf}': PER_RANK}}" in text
    assert not (tmp_path / "c" / "metadata.json").exists()


@pytest.mark.parametrize(
    ("case", "where"),
    [
        ("tuple or list", "at key path 'x': rank 0 has a tuple node, rank 1 a list node"),
        ("dict or OrderedDict", "at key path 'x': rank 0 has a dict node, rank 1 an odict node"),
        ("list or deque", "at key path 'x': rank 0 has a list node, rank 1 a deque node"),
        ("deque maxlen", "at key path 'x': rank 0 has maxlen 3, rank 1 maxlen 4"),
        ("defaultdict factory", "at key path 'x': rank 0 has factory_name 'list', rank 1 factory_name 'dict'"),
        ("key 1 or '1'", "at key path 'x': rank 0 has the keys [['i', 1]], rank 1 the keys ['1']"),
        ("tensor or numpy", "at key path 'x': rank 0 has a leaf of kind 'tensor', rank 1 a leaf of kind 'numpy'"),
    ],
)
def test_ranks_whose_trees_differ_in_structure_are_refused(tmp_path: Path, case: str, where: str) -> None:
    for text in run_world(2, w.save_structures, str(tmp_path / "c"), case):
        assert "ranks disagree on the state to save: rank 0 and rank 1 differ in the tree's structure" in text, text
        assert where in text, text
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_a_per_rank_subtree_empty_on_one_rank_loads_back(tmp_path: Path) -> None:
    got = run_world(2, w.empty_part_on_one_rank, str(tmp_path / "c"), False)
    assert not isinstance(got[1], str), got[1]
    assert got[1]["data"] == {}
    assert torch.equal(got[1]["w"], torch.ones(2))
    assert torch.equal(got[0]["data"]["pos"], torch.tensor([5]))
    assert got[0]["data"]["n"] == 3
    refused = run_world(2, w.empty_part_on_one_rank, str(tmp_path / "d"), True)
    assert "leaf 'data.pos' of the target is not in the checkpoint" in refused[1], refused[1]
    assert "leaf 'data.rank0.n' of the checkpoint is not in the target" in refused[0], refused[0]


def test_unmarked_state_that_differs_is_refused_on_a_save_again(tmp_path: Path) -> None:
    for text in run_world(2, w.save_twice_unmarked, str(tmp_path)):
        assert "leaf 'pos' differs between rank 0 and rank 1" in text


def test_ranks_that_mark_differently_are_refused(tmp_path: Path) -> None:
    for text in run_world(2, w.save_mixed_marks, str(tmp_path / "c")):
        assert "PER_RANK" in text
        assert "same spec tree" in text


def test_per_rank_on_a_sharded_leaf_is_refused(tmp_path: Path) -> None:
    leaf = pytreeckpt.ShardedLeaf.from_global(
        torch.ones(4), pytreeckpt.ShardingSpec(pytreeckpt.Mesh(2), [pytreeckpt.Shard(0)])
    )
    with pytest.raises(pytreeckpt.CheckpointError, match="sharded across ranks already"):
        pytreeckpt.save(tmp_path / "c", {"x": leaf}, {"x": PER_RANK})


def test_cli_inspect_shows_per_rank_leaves(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    import json
    import subprocess
    import sys

    path, _ = saved
    text = subprocess.run(
        [sys.executable, "-m", "pytreeckpt", "inspect", str(path)], capture_output=True, text=True, check=True
    ).stdout
    line = next(x for x in text.splitlines() if x.startswith("seen.rank1 "))
    assert "per rank: 1 of 2" in line
    assert "per rank: seen, saved by 2 ranks" in text
    out = json.loads(
        subprocess.run(
            [sys.executable, "-m", "pytreeckpt", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert out["per_rank"] == {"rng": 2, "seen": 2, "pos": 2, "dataloader": 2}
    assert {a["key"]: a["saved_by_rank"] for a in out["arrays"]}["dataloader.rank1.dp_rank_1.order"] == 1


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"k": "dict", "keys": ["p"], "c": [{"k": "per_rank", "c": []}]}, "holds no rank's subtree"),
        (
            {"k": "dict", "keys": ["p"], "c": [{"k": "per_rank", "c": [{"k": "per_rank", "c": [0]}]}]},
            "a per_rank node inside another",
        ),
    ],
)
def test_a_hand_made_per_rank_node_a_save_never_writes_is_refused(tmp_path: Path, tree: Any, message: str) -> None:
    import json

    from helpers import document

    pytreeckpt.save(tmp_path / "c", {"p": {0: 5}}, {"p": PER_RANK})
    doc = document(tmp_path / "c")
    doc["tree"] = tree
    (tmp_path / "c" / "pytreeckpt.json").write_text(json.dumps(doc))
    with pytest.raises(pytreeckpt.MetadataError, match=message):
        pytreeckpt.load(tmp_path / "c")


def test_per_rank_leaves_under_strict_cast_and_a_report(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    """Other ranks' per-rank leaves are not 'unexpected' to a strict load; a part the target lacks is."""
    path, _states = saved
    target = w.empty_like_state(0)
    target["w"] = torch.zeros(4, dtype=torch.bfloat16)
    report = pytreeckpt.LoadReport()
    out = pytreeckpt.load(path, target, per_rank="all", cast=True, report=report)
    assert out["w"].dtype == torch.bfloat16
    assert report.unexpected == []
    assert report.cast == [("w", "float32", "bfloat16")]
    del target["rng"]
    with pytest.raises(
        pytreeckpt.TargetMismatchError, match=r"leaf 'rng.rank0' of the checkpoint is not in the target"
    ):
        pytreeckpt.load(path, target, per_rank="all", cast=True)
    pytreeckpt.load(path, target, per_rank="all", cast=True, strict=False, report=report)
    assert report.unexpected == ["rng.rank0", "rng.rank1"]


def test_each_rank_gets_its_own_state_cast(saved: tuple[Path, list[dict[str, Any]]]) -> None:
    path, _states = saved
    got = run_world(2, w.load_cast, str(path))
    for rank in range(2):
        assert got[rank]["seen"].dtype == torch.int32
        assert int(got[rank]["seen"][0]) == 10 * rank + 7


class _Loader:
    """A stateful object each rank holds for itself."""

    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seen": torch.arange(self.position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def test_an_object_marked_per_rank_is_restored_from_its_own_rank(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"data": _Loader(7), "step": 3}, {"data": PER_RANK})
    assert pytreeckpt.metadata(tmp_path / "c").per_rank == {"data": 1}
    loader = _Loader(0)
    out = pytreeckpt.load(tmp_path / "c", {"data": loader, "step": 0})
    assert out["data"] is loader
    assert loader.position == 7
    with pytest.raises(pytreeckpt.TargetMismatchError, match="per_rank='all'"):
        pytreeckpt.load(tmp_path / "c", {"data": loader, "step": 0}, per_rank="all")
