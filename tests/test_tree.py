"""Trees: every node kind, key paths, inline Python values, spec prefixes."""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import math
import re
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    NAMESPACE,
    Config,
    Pair,
    Point,
    assert_trees_equal,
    document,
    document_text,
    every_node_kind,
    unpacked,
)

import pytreeckpt
from pytreeckpt import Abstract, Mesh, Shard, ShardingSpec


class Phase(enum.IntEnum):
    WARMUP = 1
    DECAY = 2


class Mode(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Perm(enum.Flag):
    R = 1
    W = 2


class Shape(enum.Enum):
    SQUARE = (2, 2)
    FLAT = (1, 4)


class Hyper(enum.Enum):
    LR = 1e-3
    NONE = None


def test_every_node_kind_round_trips_without_a_target(tmp_path: Path) -> None:
    tree = every_node_kind()
    pytreeckpt.save(tmp_path / "c", tree, namespace=NAMESPACE)
    out = pytreeckpt.load(tmp_path / "c", namespace=NAMESPACE)
    assert_trees_equal(out, tree)
    assert out["default"].default_factory is list
    assert out["deque"].maxlen == 5


def test_every_node_kind_round_trips_into_a_target(tmp_path: Path) -> None:
    tree = every_node_kind()
    pytreeckpt.save(tmp_path / "c", tree, namespace=NAMESPACE)
    target = every_node_kind()  # same structure, other values
    out = pytreeckpt.load(tmp_path / "c", target, namespace=NAMESPACE)
    assert_trees_equal(out, tree)


def test_dict_keys_keep_their_types_and_order(tmp_path: Path) -> None:
    tree = {"b": 1, 3: 2, "a": 3, (1, "x"): 4, 2.5: 5, True: 6, None: 7}
    pytreeckpt.save(tmp_path / "c", tree)
    out = pytreeckpt.load(tmp_path / "c")
    assert list(out.items()) == list(tree.items())
    assert [type(k) for k in out] == [type(k) for k in tree]


def test_python_leaves_are_inline_in_the_metadata_with_their_types(tmp_path: Path) -> None:
    tree = {"i": 1, "f": 1.0, "b": True, "s": "text", "n": None, "nan": math.nan, "inf": -math.inf, "nz": -0.0}
    pytreeckpt.save(tmp_path / "c", tree)
    doc = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())
    inline = {leaf["key"]: leaf["value"] for leaf in doc["leaves"] if leaf["kind"] == "value"}
    assert inline["i"] == 1
    assert inline["s"] == "text"
    assert inline["b"] is True
    assert inline["n"] is None
    assert not list((tmp_path / "c" / "arrays").iterdir())  # no array files for values
    out = pytreeckpt.load(tmp_path / "c")
    assert type(out["i"]) is int
    assert type(out["f"]) is float
    assert type(out["b"]) is bool
    assert math.isnan(out["nan"])
    assert out["inf"] == -math.inf
    assert math.copysign(1.0, out["nz"]) == -1.0


def test_key_paths_are_dotted_and_readable(tmp_path: Path) -> None:
    m = torch.nn.Sequential(torch.nn.Linear(2, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    pytreeckpt.save(unpacked(tmp_path / "c"), {"model": m.state_dict(), "optim": opt.state_dict()})
    arrays = pytreeckpt.metadata(tmp_path / "c").arrays
    assert {"model.0.weight", "model.0.bias", "optim.state.0.momentum_buffer"} <= set(arrays)
    assert (tmp_path / "c" / "arrays" / "model.0.weight" / "zarr.json").exists()


def test_namedtuple_and_dataclass_types_are_resolved_only_when_imported(tmp_path: Path) -> None:
    tree = {"p": Point(1, 2), "c": Config(0.5, (0.1, 0.2), torch.ones(1))}
    pytreeckpt.save(tmp_path / "c", tree)
    doc = document_text(tmp_path / "c")
    # A checkpoint naming a type in a module that is not imported: rebuilt without importing it.
    (tmp_path / "c" / "pytreeckpt.json").write_text(doc.replace("helpers:", "not_imported_module_xyz:"))
    out = pytreeckpt.load(tmp_path / "c")
    assert out["p"] == (1, 2)
    assert out["p"]._fields == ("x", "y")
    assert type(out["p"]) is not Point
    assert out["c"]["lr"] == 0.5
    assert torch.equal(out["c"]["weights"], torch.ones(1))
    import sys

    assert "not_imported_module_xyz" not in sys.modules


def test_custom_node_without_its_namespace_is_an_error_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'x\.p'.*Pair"):
        pytreeckpt.save(tmp_path / "c", {"x": {"p": Pair(1, 2)}})


def test_spec_is_a_prefix_of_the_tree(tmp_path: Path) -> None:
    spec2 = ShardingSpec(Mesh(2), [Shard(0)])
    w = torch.arange(12.0).reshape(4, 3)
    tree = {"model": {"w": w, "b": torch.ones(4)}, "step": 3, "other": torch.zeros(2)}
    pytreeckpt.save(tmp_path / "c", tree, {"model": spec2, "step": None, "other": None})
    arrays = pytreeckpt.metadata(tmp_path / "c").arrays
    assert arrays["model.w"].layout == spec2
    assert arrays["model.b"].layout == spec2
    assert arrays["other"].layout is None
    out = pytreeckpt.load(
        tmp_path / "c", {"model": {"w": Abstract((4, 3), torch.float32), "b": torch.zeros(4)}}, strict=False
    )
    assert torch.equal(out["model"]["w"], w)


def test_a_spec_that_is_not_a_prefix_names_the_key_path(tmp_path: Path) -> None:
    spec2 = ShardingSpec(Mesh(2), [Shard(0)])
    tree = {"model": {"w": torch.ones(4)}}
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'model'.*\['w'\].*\['v'\]"):
        pytreeckpt.save(tmp_path / "c", tree, {"model": {"v": spec2}})
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'model\.w'.*leaf"):
        pytreeckpt.save(tmp_path / "c", tree, {"model": {"w": [spec2]}})


def test_defaultdict_with_an_unknown_factory_comes_back_without_one(tmp_path: Path) -> None:
    dd: collections.defaultdict[str, int] = collections.defaultdict(lambda: 3, {"a": 1})
    pytreeckpt.save(tmp_path / "c", {"d": dd})
    out = pytreeckpt.load(tmp_path / "c")["d"]
    assert out == {"a": 1}
    assert out.default_factory is None


# --------------------------------------------------------------------------- key paths that collide

_X, _Y = torch.ones(2), torch.zeros(3)
COLLIDING = [
    ({"a.b": _X, "a": {"b": _Y}}, "'a.b'", r"\['a\.b'\] and \['a'\]\['b'\]"),
    ({0: _X, "0": _Y}, "'0'", r"\[0\] and \['0'\]"),
    ({"l": [_X], "l.0": _Y}, "'l.0'", r"\['l'\]\[0\] and \['l\.0'\]"),
    ({(1, "x"): _X, "(1,x)": _Y}, "'(1,x)'", r"\[\(1, 'x'\)\] and \['\(1,x\)'\]"),
    ({None: 1, "None": _Y}, "'None'", r"\[None\] and \['None'\]"),
    ({1.5: _X, "1.5": 2}, "'1.5'", r"\[1\.5\] and \['1\.5'\]"),
    ({True: _X, "True": _Y}, "'True'", r"\[True\] and \['True'\]"),
]


@pytest.mark.parametrize(("tree", "key", "both"), COLLIDING)
def test_a_tree_whose_key_paths_collide_is_refused_before_anything_is_written(
    tmp_path: Path, tree: dict[Any, Any], key: str, both: str
) -> None:
    for save in (pytreeckpt.save, pytreeckpt.async_save):
        with pytest.raises(pytreeckpt.CheckpointError, match=f"key path {re.escape(key)}: {both}.*rename one"):
            save(tmp_path / "c", tree)
        assert not (tmp_path / "c").exists()


def test_an_incremental_manager_commits_no_checkpoint_it_cannot_load(tmp_path: Path) -> None:
    # Saved with chunk hashes, two leaves of one key path used to get each other's hashes:
    # a committed step that no load could read ("chunk_hashes must be 0 hex digests").
    tree = {"a": {"b": torch.zeros(0)}, "a.b": torch.ones(2)}
    with pytreeckpt.CheckpointManager(tmp_path / "run", incremental=True, async_=False) as m:
        with pytest.raises(pytreeckpt.CheckpointError, match=r"\['a'\]\['b'\] and \['a\.b'\]"):
            m.save(1, tree)
        assert m.all_steps() == []
        m.save(2, {"a.b": torch.ones(2), "a": {"c": torch.zeros(0)}})
        assert m.all_steps() == [2]
        assert torch.equal(m.restore()["a.b"], torch.ones(2))


def test_dotted_keys_of_flat_dicts_stay_as_they_are(tmp_path: Path) -> None:
    tree = {"model.layers.0.weight": torch.ones(2), "model.layers.1.weight": torch.zeros(2), "step": 3}
    pytreeckpt.save(tmp_path / "c", tree)
    assert list(pytreeckpt.metadata(tmp_path / "c").arrays) == ["model.layers.0.weight", "model.layers.1.weight"]
    assert set(pytreeckpt.load(tmp_path / "c", include="model.*")) == {"model.layers.0.weight", "model.layers.1.weight"}


def _old_document_with_a_duplicate_key(path: Path) -> None:
    """A checkpoint as an older pytreeckpt wrote ``{"a.b": x, "a": {"b": y}}``: two leaves keyed 'a.b'."""
    pytreeckpt.save(unpacked(path), {"a.b": torch.ones(2), "a": {"c": torch.arange(3.0)}, "n": {"0": 1, "1": 2}})
    doc_path = path / "pytreeckpt.json"
    doc = document(path)
    text = json.dumps(doc).replace('"a.c"', '"a.b"').replace('"keys": ["c"]', '"keys": ["b"]')
    doc = json.loads(text.replace('"n.1"', '"n.0"'))
    assert doc["tree"]["c"][2]["keys"] == ["0", "1"]
    doc["tree"]["c"][2]["keys"] = ["0", ["i", 0]]  # {"0": 1, 0: 2}
    doc_path.write_text(json.dumps(doc))


def test_an_old_checkpoint_with_a_duplicate_key_loads_whole_and_refuses_to_pick_one(tmp_path: Path) -> None:
    _old_document_with_a_duplicate_key(tmp_path / "c")
    out = pytreeckpt.load(tmp_path / "c")  # the typed structure tells the leaves apart
    assert torch.equal(out["a.b"], torch.ones(2))
    assert torch.equal(out["a"]["b"], torch.arange(3.0))
    assert out["n"] == {"0": 1, 0: 2}
    meta = pytreeckpt.metadata(tmp_path / "c")
    assert meta.tree["a"]["b"] == Abstract((3,), torch.float32)
    assert meta.nbytes == 5 * 4
    ambiguous = r"'a\.b' names 2 leaves .*\['a\.b'\] and \['a'\]\['b'\].*load it whole"
    with pytest.raises(pytreeckpt.MetadataError, match=ambiguous):
        meta.arrays["a.b"]
    with pytest.raises(pytreeckpt.MetadataError, match=ambiguous):
        list(meta.arrays.values())
    with pytest.raises(pytreeckpt.MetadataError, match=ambiguous):
        pytreeckpt.load(tmp_path / "c", include="a*")
    with pytest.raises(pytreeckpt.MetadataError, match=ambiguous):
        pytreeckpt.load_slice(tmp_path / "c", "a.b", slice(0, 1))
    with pytest.raises(pytreeckpt.MetadataError, match=ambiguous):
        pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "out")
    with pytest.raises(pytreeckpt.MetadataError, match=r"'n\.0' names 2 leaves .*\['n'\]\['0'\] and \['n'\]\[0\]"):
        pytreeckpt.load(tmp_path / "c", include="n.*")


# --------------------------------------------------------------------------- enums and other subclasses


def test_enum_members_come_back_as_members(tmp_path: Path) -> None:
    tree = {
        "phase": Phase.DECAY,
        "mode": Mode.EVAL,
        "perm": Perm.R | Perm.W,
        "shape": Shape.FLAT,
        "lr": Hyper.LR,
        "none": Hyper.NONE,
        "list": [Phase.WARMUP, 2],
    }
    pytreeckpt.save(tmp_path / "c", tree)
    doc = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())
    inline = {leaf["key"]: leaf["value"] for leaf in doc["leaves"]}
    assert inline["phase"] == {"enum": f"{__name__}:Phase", "value": 2}
    out = pytreeckpt.load(tmp_path / "c")
    for k, v in tree.items():
        assert out[k] == v, k
        assert type(out[k]) is type(v), k
    assert out["list"][0] is Phase.WARMUP
    assert type(out["list"][1]) is int
    target = {**tree, "phase": Phase.WARMUP, "mode": Mode.TRAIN}
    again = pytreeckpt.load(tmp_path / "c", target)
    assert again["phase"] is Phase.DECAY
    assert again["mode"] is Mode.EVAL
    assert pytreeckpt.metadata(tmp_path / "c").tree["phase"] is Phase.DECAY


def test_an_enum_whose_module_is_not_imported_needs_a_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("pytreeckpt_tests_levels")
    exec("import enum\nclass Level(enum.IntEnum):\n    LOW = 1\n    HIGH = 2\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    pytreeckpt.save(tmp_path / "c", {"opt": {"level": mod.Level.HIGH}, "w": torch.ones(1)})
    monkeypatch.delitem(sys.modules, mod.__name__)  # as in a process that never imported it
    with pytest.raises(
        pytreeckpt.TargetMismatchError, match=r"'opt\.level'.*pytreeckpt_tests_levels:Level.*not imported.*target"
    ):
        pytreeckpt.load(tmp_path / "c")
    meta = pytreeckpt.metadata(tmp_path / "c")  # no error: the stored member is shown as it is
    assert "pytreeckpt_tests_levels:Level" in repr(meta.tree["opt"]["level"])
    out = pytreeckpt.load(tmp_path / "c", {"opt": {"level": mod.Level.LOW}, "w": torch.zeros(1)})
    assert out["opt"]["level"] is mod.Level.HIGH
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"'opt\.level'.*not imported"):
        pytreeckpt.load(tmp_path / "c", meta.tree)  # the metadata's tree as the target knows no more
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # imported again: resolved, never imported by us
    assert pytreeckpt.load(tmp_path / "c")["opt"]["level"] is mod.Level.HIGH


def test_a_value_that_is_no_member_of_the_target_enum_is_a_mismatch(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"p": Phase.DECAY})

    class Other(enum.IntEnum):
        ONLY = 7

    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"'p'.*value 2.*not a member"):
        pytreeckpt.load(tmp_path / "c", {"p": Other.ONLY})


def test_enum_dict_keys_are_keyed_and_rebuilt_as_their_values(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"by_mode": {Mode.EVAL: torch.ones(1)}, "by_phase": {Phase.DECAY: torch.ones(2)}})
    assert list(pytreeckpt.metadata(tmp_path / "c").arrays) == ["by_mode.eval", "by_phase.2"]
    out = pytreeckpt.load(tmp_path / "c")
    assert [type(k) for k in (*out["by_mode"], *out["by_phase"])] == [str, int]
    assert set(pytreeckpt.load(tmp_path / "c", include="by_mode.eval")) == {"by_mode.eval"}


class Tokens(int):
    pass


class Rate(float):
    pass


class Name(str):
    pass


class Opaque(enum.Enum):
    THING = object()


@pytest.mark.parametrize(
    ("value", "base"), [(Tokens(5), "int"), (Rate(0.5), "float"), (Name("x"), "str"), (Opaque.THING, "cannot")]
)
def test_other_subclasses_of_plain_values_are_refused_by_name(tmp_path: Path, value: Any, base: str) -> None:
    for save in (pytreeckpt.save, pytreeckpt.async_save):
        with pytest.raises(pytreeckpt.CheckpointError, match=rf"'cfg\.v'.*{type(value).__qualname__}.*{base}"):
            save(tmp_path / "c", {"cfg": {"v": value}, "w": torch.ones(2)})
        assert not (tmp_path / "c").exists()
    pytreeckpt.save(tmp_path / "ok", {"n": np.float64(0.5), "i": np.int64(3)})  # numpy scalars are arrays
    assert pytreeckpt.load(tmp_path / "ok")["n"] == np.float64(0.5)


# --------------------------------------------------------------------------- depth


def test_a_tree_nested_too_deeply_is_refused_by_name(tmp_path: Path) -> None:
    deep: Any = torch.ones(1)
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(pytreeckpt.CheckpointError, match=r"deeper than 100 levels.*'w\.0\.0"):
        pytreeckpt.save(tmp_path / "c", {"w": deep})
    assert not (tmp_path / "c").exists()
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(1)})
    with pytest.raises(pytreeckpt.CheckpointError, match="deeper than 100 levels"):
        pytreeckpt.load(tmp_path / "c", {"w": deep})
    cycle: list[Any] = [torch.ones(1)]
    cycle.append(cycle)
    with pytest.raises(pytreeckpt.CheckpointError, match="holds itself"):
        pytreeckpt.save(tmp_path / "d", {"c": cycle})
    ok: Any = 1
    for _ in range(99):
        ok = {"k": ok}
    pytreeckpt.save(tmp_path / "e", ok)
    assert pytreeckpt.load(tmp_path / "e") == ok


class _Colour(enum.IntEnum):
    RED = 1


class _Name(str):
    pass


class _Wrapped(torch.Tensor):
    pass


def test_leaf_and_value_checks_answer_as_isinstance_does() -> None:
    """The leaf kinds' registry (its answers kept by type) answers as the isinstance checks it stands for."""
    from pytreeckpt.core._values import PYTHON_LEAF_TYPES, StoredEnum
    from pytreeckpt.leaves import is_leaf as _is_leaf
    from pytreeckpt.leaves import is_value as _is_value

    _LEAF_TYPES = (torch.Tensor, np.ndarray, np.generic, pytreeckpt.ShardedLeaf, Abstract, *PYTHON_LEAF_TYPES)

    spec = ShardingSpec(Mesh(2), [Shard(0)])
    things = [
        True, 3, 2.5, "s", None, _Colour.RED, _Name("n"), StoredEnum("pkg:Colour", 1),
        np.float64(1.0), np.int32(2), np.bool_(True), np.zeros(2), np.ma.zeros(2),
        torch.zeros(2), torch.nn.Parameter(torch.zeros(2)), torch.zeros(2).as_subclass(_Wrapped),
        Abstract((4,), torch.float32), Abstract((4,), torch.float32, spec),
        pytreeckpt.ShardedLeaf((4,), torch.float32, spec, {0: torch.zeros(2)}),
        {}, [], (), collections.OrderedDict(), Point(1, 2), object(), b"bytes", 1j,
    ]  # fmt: skip
    for x in things:
        assert _is_leaf(x) == isinstance(x, _LEAF_TYPES), x
        assert _is_value(x) == (isinstance(x, PYTHON_LEAF_TYPES) and not isinstance(x, np.generic)), x


def test_leaf_node_sets_every_field_as_the_constructor_does() -> None:
    """leaf_node stores a leaf's slots itself: each field of Node, one added later too, as Node(...) gives it."""
    import dataclasses

    from pytreeckpt.core._node import Node, leaf_node

    made, expected = leaf_node(3), Node("leaf", leaf=3)
    for f in dataclasses.fields(Node):
        got, want = getattr(made, f.name), getattr(expected, f.name)  # (an unset slot raises AttributeError)
        if isinstance(want, list | dict):
            assert type(got) not in (list, dict), f.name  # (shared, read-only: () and a proxy)
            assert list(got) == list(want), f.name
        else:
            assert got == want, f.name


def test_a_flag_combination_not_made_in_this_process_comes_back(tmp_path: Path) -> None:
    """A Flag value that is no single member is made by the enum module (its own _missing_), as Flag(3) is."""
    fresh = enum.Flag("Fresh", ["R", "W"], module=__name__)
    monkey = types.ModuleType("pytreeckpt_tests_flags")
    monkey.Fresh = fresh  # type: ignore[attr-defined]
    fresh.__module__ = monkey.__name__
    sys.modules[monkey.__name__] = monkey
    try:
        pytreeckpt.save(tmp_path / "c", {"f": fresh.R})
        doc = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())
        doc.pop("document_crc32c", None)  # (a document without its checksum is one of an older save)
        doc["leaves"][0]["value"]["value"] = 3  # R | W, which this process never made
        (tmp_path / "c" / "pytreeckpt.json").write_text(json.dumps(doc))
        assert pytreeckpt.load(tmp_path / "c")["f"] == fresh.R | fresh.W
    finally:
        del sys.modules[monkey.__name__]


class _Recording:
    """A data descriptor that records every value set through it."""

    calls: list[Any] = []  # noqa: RUF012

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return 0 if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        _Recording.calls.append(value)
        setattr(obj, self.slot, value)


@dataclasses.dataclass
class WithDescriptor:
    x: int = _Recording()  # type: ignore[assignment]


def test_a_dataclass_whose_field_is_a_descriptor_comes_back_as_a_dict(tmp_path: Path) -> None:
    """Setting its fields directly would run the descriptor's __set__: the type is not reused, nothing is called."""
    pytreeckpt.save(tmp_path / "c", {"d": WithDescriptor(5)})
    _Recording.calls.clear()
    assert pytreeckpt.load(tmp_path / "c") == {"d": {"x": 5}}
    assert pytreeckpt.metadata(tmp_path / "c").tree == {"d": {"x": 5}}
    assert _Recording.calls == []


def test_a_registered_node_its_unflatten_refuses_is_a_metadata_error_naming_it(tmp_path: Path) -> None:
    from helpers import Pair

    pytreeckpt.save(tmp_path / "c", {"x": {"p": Pair(1, 2)}, "n": 3}, namespace=NAMESPACE)
    doc = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())
    doc.pop("document_crc32c", None)  # (a document without its checksum is one of an older save)
    node = doc["tree"]["c"][0]["c"][0]
    node["keys"].append("extra")
    node["c"].append(len(doc["leaves"]))  # Pair(1, 2, 4): its unflatten function takes two children
    doc["leaves"].append({"kind": "value", "key": "x.p.extra", "value": 4})
    (tmp_path / "c" / "pytreeckpt.json").write_text(json.dumps(doc))
    with pytest.raises(pytreeckpt.MetadataError, match=r"at key path 'x\.p': a node of type helpers:Pair cannot be"):
        pytreeckpt.load(tmp_path / "c", namespace=NAMESPACE)
