"""A training loop saves one state object again and again, changing it in place between saves.

Each save must store the state as it is at that save: the description a save remembers
(saving/_recall.py) is reused only when the tree still matches it. Here one dict is saved,
changed in place in each of the ways a program can, and saved again; every checkpoint
must load back as the state was when it was saved. Property tests
(property_tests/test_recall.py) compare such saves byte for byte with fresh ones.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch

import pytreeckpt
from pytreeckpt.saving import _recall


def _same(loaded: Any, saved: Any) -> None:
    if isinstance(saved, torch.Tensor):  # (a Parameter loads as a tensor)
        assert isinstance(loaded, torch.Tensor)
        assert loaded.dtype == saved.dtype
        assert loaded.shape == saved.shape
        assert torch.equal(loaded, saved)
        return
    assert type(loaded) is type(saved), (loaded, saved)
    if isinstance(saved, dict):
        assert list(loaded) == list(saved)
        for k in saved:
            _same(loaded[k], saved[k])
    else:
        assert loaded == saved


def _snapshot(x: Any) -> Any:
    if isinstance(x, dict):
        return type(x)((k, _snapshot(v)) for k, v in x.items())
    return x.clone() if isinstance(x, torch.Tensor) else x


def _in_place_changes() -> list[tuple[str, Any]]:
    def data(s: dict) -> None:
        s["layers"]["w"].add_(1)  # the same tensors, other values: recognised

    def reorder(s: dict) -> None:
        s["layers"]["w"] = s["layers"].pop("w")

    def resize(s: dict) -> None:  # (set_: a tensor once saved cannot be resize_d, as torch.Tensor.numpy leaves it)
        s["layers"]["b"].set_(torch.full((5,), 3.0))

    def retype(s: dict) -> None:
        s["layers"]["b"] = s["layers"]["b"].double()

    def new_key(s: dict) -> None:
        s["layers"]["c"] = torch.ones(2)

    def drop_key(s: dict) -> None:
        del s["layers"]["b"]

    def value(s: dict) -> None:
        s["step"] += 1

    def value_type(s: dict) -> None:
        s["step"] = 7.5

    def to_param(s: dict) -> None:
        s["layers"]["w"] = torch.nn.Parameter(s["layers"]["w"].clone(), requires_grad=False)

    def to_odict(s: dict) -> None:
        s["layers"] = collections.OrderedDict(s["layers"])

    def transposed(s: dict) -> None:
        s["layers"]["w"] = s["layers"]["w"].t().contiguous().t() * 2  # other strides, same shape

    def meta(s: dict) -> None:
        s["layers"]["w"] = torch.empty(3, 3, device="meta")

    return [(f.__name__, f) for f in (data, reorder, resize, retype, new_key, drop_key, value, value_type,
                                      to_param, to_odict, transposed, meta)]  # fmt: skip


@pytest.mark.parametrize(("name", "change"), _in_place_changes())
def test_a_state_changed_in_place_is_saved_as_it_is_at_each_save(tmp_path: Path, name: str, change: Any) -> None:
    _recall.forget()
    state = {"layers": {"w": torch.arange(9.0).reshape(3, 3), "b": torch.zeros(3)}, "step": 1}
    pytreeckpt.save(tmp_path / "first", state)
    first = _snapshot(state)
    hits = _recall.hits()
    change(state)
    if name == "meta":  # refused as before: a meta tensor holds no data
        with pytest.raises(pytreeckpt.CheckpointError, match="meta device"):
            pytreeckpt.save(tmp_path / "second", state)
        return
    pytreeckpt.save(tmp_path / "second", state)
    assert (_recall.hits() == hits + 1) == (name in ("data", "value", "transposed")), "recognised when it should be"
    _same(pytreeckpt.load(tmp_path / "second"), state)
    _same(pytreeckpt.load(tmp_path / "first"), first)


def test_the_plan_of_equal_specs_made_anew_is_recognised_and_equal() -> None:
    from pytreeckpt import Abstract, Mesh, Shard, ShardingSpec
    from pytreeckpt.testing import SimComm

    def tree(dim: int) -> dict[str, Any]:
        spec = ShardingSpec(Mesh((2, 4), ("dp", "tp")), [Shard(0), Shard(1)])  # new objects each time
        return {f"layer{i}": Abstract((8, 16), torch.bfloat16, spec) for i in range(3)} | {
            "head": Abstract((8, dim), torch.float32, spec)
        }

    _recall.forget()
    first = pytreeckpt.plan_save(tree(16), process_group=SimComm(3, 8))
    hits = _recall.hits()
    assert pytreeckpt.plan_save(tree(16), process_group=SimComm(3, 8)) == first
    assert _recall.hits() == hits + 1
    other = pytreeckpt.plan_save(tree(32), process_group=SimComm(3, 8))  # one shape changed: planned anew
    assert _recall.hits() == hits + 1
    _recall.forget()
    assert other == pytreeckpt.plan_save(tree(32), process_group=SimComm(3, 8))


def test_trees_alike_saved_at_once_from_two_threads_each_get_their_own_checksums(tmp_path: Path) -> None:
    """Two states of one structure (other tensors, other values) share the remembered description and the
    document template it keeps (format.SumsTemplate); saved at the same time from two threads, each
    checkpoint's document holds its own data's checksums: every one verifies and loads back as saved."""
    import threading

    _recall.forget()
    states = [{f"p{i}": torch.full((16,), float(k * 10_000 + i)) for i in range(2000)} for k in range(2)]
    pytreeckpt.save(tmp_path / "warm", states[0])  # (described once: every save below recognises it)
    hits = _recall.hits()
    rounds = 20
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def saves(k: int) -> None:
        try:
            start.wait()
            for r in range(rounds):
                pytreeckpt.save(tmp_path / f"s{k}-{r}", states[k])
        except BaseException as e:  # (raised in the test's thread below)
            errors.append(e)

    threads = [threading.Thread(target=saves, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert _recall.hits() == hits + 2 * rounds
    for k in range(2):
        for r in range(rounds):
            path = tmp_path / f"s{k}-{r}"
            report = pytreeckpt.verify(path)
            assert report.ok, (path, report.damaged_leaves[:5])
            _same(pytreeckpt.load(path), states[k])
