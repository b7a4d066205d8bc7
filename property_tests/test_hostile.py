"""Hostile checkpoints: mutated metadata and damaged files end in a CheckpointError or a correct load.

Nothing else: no other exception type, no crash, no read outside the checkpoint. Where
files are damaged, moved, swapped or replaced, ``load`` and ``verify`` agree: a load
fails exactly when verify finds a problem.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _json_paths import json_paths
from hypothesis import assume, example, given
from hypothesis import strategies as st

import pytreeckpt
from pytreeckpt import FlatRanges, ShardedLeaf

_ROOT = Path(tempfile.mkdtemp(prefix="pytreeckpt-hostile-"))
_ORIGINAL = _ROOT / "original"
_STATE = {
    "w": ShardedLeaf.from_global(torch.arange(40.0).reshape(8, 5), FlatRanges([(0, 13), (13, 40)])),
    "b": torch.arange(6, dtype=torch.int16),
    "h": torch.ones(3, dtype=torch.bfloat16),
    "opt": {0: {"step": torch.tensor(2.0)}},
    "n": 3,
    "s": "text",
}
pytreeckpt.save(
    _ORIGINAL, _STATE, chunking=pytreeckpt.ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=48)
)
_DOC = json.loads((_ORIGINAL / "pytreeckpt.json").read_text())
_FILES = sorted(str(p.relative_to(_ORIGINAL)) for p in _ORIGINAL.rglob("*") if p.is_file() and p.suffix != ".lock")
_CHUNKS = [f for f in _FILES if "/c/" in f]  # chunk files of the arrays stored on their own
assert len(_CHUNKS) > 4
_TENSORS = sorted(
    bytes(t.contiguous().view(torch.uint8).numpy())
    for t in (_STATE["w"].to_global(), _STATE["b"], _STATE["h"], _STATE["opt"][0]["step"].reshape(1))
)


_DOC_PATHS = json_paths(_DOC)[1:]

_REPLACEMENTS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**31, 2**63, 10**30]),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(["../../etc/passwd", "/etc/passwd", "arrays/../../x", "arrays/w/../../../x", "~", "arrays/"]),
    st.lists(st.integers(-5, 2**40), max_size=6),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
)


@st.composite
def doc_mutations(draw: st.DrawFn) -> dict[str, Any]:
    doc = copy.deepcopy(_DOC)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_DOC_PATHS))
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            parent[key]
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, dict | list):  # an earlier mutation turned the container into a string
            continue
        action = draw(st.sampled_from(["drop", "replace", "enlarge", "escape"]))
        if action == "drop":
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif action == "enlarge" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] = parent[key] * 2 ** draw(st.integers(1, 64)) + 1
        elif action == "enlarge" and isinstance(parent[key], list):
            parent[key] = parent[key] + parent[key]
        elif action == "escape" and isinstance(parent[key], str):
            parent[key] = draw(st.sampled_from(["../", "/", "arrays/../../"])) + parent[key]
        else:
            parent[key] = draw(_REPLACEMENTS)
    return doc


def _tensor_bytes(tree: Any) -> list[bytes]:
    out: list[bytes] = []
    if isinstance(tree, dict):
        for v in tree.values():
            out += _tensor_bytes(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            out += _tensor_bytes(v)
    elif isinstance(tree, torch.Tensor):
        out.append(bytes(tree.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return out


def _attempt(path: Path) -> None:
    """Load, read metadata and verify: only CheckpointErrors or correct results."""
    try:
        got = pytreeckpt.load(path)
    except pytreeckpt.CheckpointError:
        pass
    else:
        assert sorted(_tensor_bytes(got)) == _TENSORS  # whatever else changed, no array data is wrong
    with contextlib.suppress(pytreeckpt.CheckpointError):
        pytreeckpt.metadata(path)
    with contextlib.suppress(pytreeckpt.CheckpointError):
        pytreeckpt.verify(path)


def _load_and_verify_agree(path: Path) -> None:
    """Load gives the saved tensors or a CheckpointError, and verify finds a problem exactly when it fails."""
    try:
        got = pytreeckpt.load(path)
    except pytreeckpt.CheckpointError:
        loaded = False
    else:
        loaded = True
        assert sorted(_tensor_bytes(got)) == _TENSORS
    try:
        report = pytreeckpt.verify(path)
    except pytreeckpt.CheckpointError:
        checked = False
    else:
        checked = report.ok
    assert checked == loaded, ("load" if loaded else "load failed", report.problems if not checked else "verify ok")


def _fresh_copy(name: str) -> Path:
    target = _ROOT / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(_ORIGINAL, target)
    return target


def _with_chunk_shape(chunk_shape: list[int]) -> dict[str, Any]:
    doc = copy.deepcopy(_DOC)
    doc["leaves"][0]["chunk_shape"] = chunk_shape
    return doc


@given(doc_mutations())
@example(_with_chunk_shape([2**63 - 1, 3]))  # past TensorStore's limit: it refused the spec synchronously
@example(_with_chunk_shape([2**70, 3]))  # past int64
def test_mutated_metadata_is_a_checkpoint_error_or_a_correct_load(doc: dict[str, Any]) -> None:
    path = _fresh_copy("doc")
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    _attempt(path)


@given(
    st.sampled_from(_FILES),
    st.sampled_from(["truncate", "flip", "delete", "empty", "garbage"]),
    st.integers(0, 10_000),
)
def test_damaged_files_are_a_checkpoint_error_or_a_correct_load(name: str, action: str, where: int) -> None:
    path = _fresh_copy("files")
    f = path / name
    data = bytearray(f.read_bytes())
    if action == "truncate":
        f.write_bytes(bytes(data[: where % max(1, len(data))]))
    elif action == "flip" and data:
        data[where % len(data)] ^= 1 << (where % 8)
        f.write_bytes(bytes(data))
    elif action == "delete":
        f.unlink()
    elif action == "empty":
        f.write_bytes(b"")
    else:
        f.write_bytes(bytes((where * 7 + i) % 256 for i in range(64)))
    _attempt(path)
    _load_and_verify_agree(path)


@given(
    st.sampled_from(_CHUNKS),
    st.sampled_from(_CHUNKS),
    st.sampled_from(["swap", "copy", "append", "link_out", "link_in"]),
)
@example(_CHUNKS[0], _CHUNKS[1], "swap")
@example(_CHUNKS[0], _CHUNKS[1], "link_out")
def test_misplaced_chunks_are_caught_by_load_and_verify_alike(a: str, b: str, action: str) -> None:
    """Chunk files moved, swapped, copied over each other, extended or replaced by links."""
    assume(a != b or action in ("append", "link_out"))
    path = _fresh_copy("misplaced")
    fa, fb = path / a, path / b
    if action == "swap":
        fa.rename(path / "tmp")
        fb.rename(fa)
        (path / "tmp").rename(fb)
    elif action == "copy":
        shutil.copyfile(fb, fa)
    elif action == "append":
        with open(fa, "ab") as f:
            f.write(b"\0")
    elif action == "link_out":  # to an identical copy of b outside the checkpoint: refused whatever it holds
        outside = _ROOT / "outside-chunk"
        shutil.copyfile(fb, outside)
        fa.unlink()
        os.symlink(outside, fa)
    else:
        fa.unlink()
        os.symlink(os.path.relpath(fb, fa.parent), fa)
    if action == "link_out":
        with contextlib.suppress(pytreeckpt.CheckpointError):
            pytreeckpt.load(path)
            raise AssertionError("a chunk linked out of the checkpoint was read")
    _attempt(path)
    _load_and_verify_agree(path)


# --------------------------------------------------------------------------- the tree structure


@dataclasses.dataclass
class _Config:
    lr: float
    steps: int


_Pair = collections.namedtuple("_Pair", "x y")
_TREE_ROOT = _ROOT / "tree-original"
_default: collections.defaultdict[str, Any] = collections.defaultdict(list, {"a": 1})
pytreeckpt.save(
    _TREE_ROOT,
    {
        "d": {"a": 1, 2: "two", (1, "x"): 3.5, 1.5: None, True: False, None: 4},
        "o": collections.OrderedDict([("z", 1), ("y", 2)]),
        "dd": _default,
        "q": collections.deque([1, 2], maxlen=3),
        "l": [1, (2, 3), []],
        "p": _Pair(1, {"k": 2}),
        "c": _Config(0.5, 7),
        "w": torch.arange(4.0),
    },
)
_TREE_DOC = json.loads((_TREE_ROOT / "pytreeckpt.json").read_text())
_TREE_DOC.pop("document_crc32c", None)  # (rewritten below: a document without its checksum, as older saves wrote)
_TREE_PATHS = [("tree", *p) for p in json_paths(_TREE_DOC["tree"])]

_TREE_VALUES = st.one_of(
    _REPLACEMENTS,
    st.sampled_from(["dict", "odict", "defaultdict", "list", "tuple", "deque", "namedtuple", "dataclass", "custom"]),
    st.sampled_from(["os:stat_result", "torch:_dynamo", "numpy:fft", "collections:OrderedDict", "builtins:int"]),
    st.sampled_from([f"{__name__}:_Pair", f"{__name__}:_Config", "torch.nn.utils.rnn:PackedSequence", "x:y:z"]),
    st.sampled_from([["i", 1], ["b", True], ["f", "1.0"], ["f", "x"], ["n"], ["t", [["i", 1]]], ["t", 5], ["s", "a"]]),
    st.sampled_from([-1, 0, 1, 2, 10**30, 2**63, 7, 8]),  # leaf indices and maxlens
    st.lists(st.sampled_from(["a", "z", "y", ["i", 2], ["i", 1], ["b", True]]), max_size=4),
)


@st.composite
def tree_mutations(draw: st.DrawFn) -> dict[str, Any]:
    """The genuine document with one to three places of its tree replaced, dropped, doubled or swapped."""
    doc = copy.deepcopy(_TREE_DOC)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_TREE_PATHS))
        parent: Any = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, dict | list):  # an earlier mutation turned the container into a string
            continue
        key = path[-1]
        action = draw(st.sampled_from(["replace", "drop", "double", "copy"]))
        if action == "drop":
            del parent[key]
        elif action == "double" and isinstance(parent, list):
            parent.insert(key, parent[key])
        elif action == "copy":  # another place of the tree put here: a key or a subtree twice
            other = draw(st.sampled_from(_TREE_PATHS))
            source: Any = _TREE_DOC
            with contextlib.suppress(KeyError, IndexError, TypeError):
                for k in other:
                    source = source[k]
                parent[key] = copy.deepcopy(source)
        else:
            parent[key] = draw(_TREE_VALUES)
    return doc


def _count_leaves(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(_count_leaves(v) for v in tree.values())
    if isinstance(tree, list | tuple | collections.deque):
        return sum(_count_leaves(v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type | pytreeckpt.Abstract):  # (metadata's leaves)
        return sum(_count_leaves(getattr(tree, f.name)) for f in dataclasses.fields(tree))
    return 1


@given(tree_mutations())
@example({**_TREE_DOC, "tree": {**_TREE_DOC["tree"], "keys": ["d"] * len(_TREE_DOC["tree"]["keys"])}})
def test_a_mutated_tree_structure_is_a_metadata_error_or_describes_every_leaf(doc: dict[str, Any]) -> None:
    """Only CheckpointErrors escape; what loads holds exactly the leaves the document lists; nothing is imported."""
    path = _ROOT / "tree"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(_TREE_ROOT, path)
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    modules = set(sys.modules)
    for read in (pytreeckpt.load, lambda p: pytreeckpt.metadata(p).tree):
        try:
            got = read(path)
        except pytreeckpt.CheckpointError:
            continue
        assert _count_leaves(got) == len(doc["leaves"])
    with contextlib.suppress(pytreeckpt.CheckpointError):
        pytreeckpt.verify(path)
    assert set(sys.modules) == modules
