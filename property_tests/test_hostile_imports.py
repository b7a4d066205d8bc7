"""Hostile imports: mutated DCP metadata and safetensors headers end in a CheckpointError or an import.

Nothing else: no other exception type, no crash, no hang. What an import saves loads.
The DCP metadata is mutated as objects (a field of DCP's own classes replaced by a
value of another type or range, or deleted), as an attacker can pickle them for the
allowlist-only unpickler; the safetensors header as JSON.
"""

from __future__ import annotations

import contextlib
import copy
import json
import pickle
import shutil
import struct
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _json_paths import json_paths
from hypothesis import event, example, given
from hypothesis import strategies as st
from safetensors.torch import save_file

import pytreeckpt

_ROOT = Path(tempfile.mkdtemp(prefix="pytreeckpt-hostile-imports-"))
_DCP = _ROOT / "dcp-original"
with warnings.catch_warnings():  # (DCP says so on every save without a process group)
    warnings.simplefilter("ignore", UserWarning)
    dcp.save(
        {"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(4, dtype=torch.bfloat16), "n": 3, "s": "text"},
        checkpoint_id=_DCP,
    )
_METADATA = (_DCP / ".metadata").read_bytes()
_MD = pickle.loads(_METADATA)  # (this test's own file)
_TENSORS = sorted(k for k, v in _MD.state_dict_metadata.items() if hasattr(v, "size"))
_FQNS = sorted(_MD.state_dict_metadata)

# Where a mutation lands: a path from the Metadata object through attributes ("a") and dict entries ("k").
_PLACES: list[tuple[tuple[str, Any], ...]] = [
    (("a", "state_dict_metadata"),),
    (("a", "storage_data"),),
    (("a", "planner_data"),),
    *((("a", "state_dict_metadata"), ("k", f)) for f in _FQNS),
    *((("a", "state_dict_metadata"), ("k", f), ("a", n)) for f in _TENSORS for n in ("properties", "size", "chunks")),
    *((("a", "state_dict_metadata"), ("k", f), ("a", "properties"), ("a", "dtype")) for f in _TENSORS),
    *(
        (("a", "storage_data"), ("v", f), ("a", n))
        for f in _FQNS
        for n in ("relative_path", "offset", "length", "transform_descriptors")
    ),
    *((("a", "storage_data"), ("i", f), ("a", n)) for f in _FQNS for n in ("fqn", "offset")),
]

_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, -5, 1, 2**31, 2**40, 2**62, 2**63, 10**30]),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(["../__0_0.distcp", "/etc/passwd", ".", "..", "", "__0_0.distcp", ".metadata", "w", "n"]),
    st.lists(st.integers(-3, 2**40), max_size=4),
    st.lists(st.integers(0, 8), max_size=3).map(torch.Size),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.qint8, torch.complex64]),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just([[[[[[[[[[1]]]]]]]]]]),
)


def _parent_and_key(root: Any, place: tuple[tuple[str, Any], ...]) -> tuple[Any, tuple[str, Any]] | None:
    """The object holding the last step of ``place``, and that step (None where an earlier mutation broke it)."""
    here = root
    for kind, key in place[:-1]:
        try:
            if kind == "a":
                here = getattr(here, key)
            elif kind == "k":
                here = here[key]
            elif kind == "v":
                here = next(v for i, v in here.items() if i.fqn == key)
            else:
                here = next(i for i in here if i.fqn == key)
        except (AttributeError, KeyError, TypeError, StopIteration):
            return None
    return here, place[-1]


@st.composite
def metadata_mutations(draw: st.DrawFn) -> Any:
    md = copy.deepcopy(_MD)
    for _ in range(draw(st.integers(1, 3))):
        found = _parent_and_key(md, draw(st.sampled_from(_PLACES)))
        if found is None:
            continue
        parent, (kind, key) = found
        drop = draw(st.booleans())
        value = None if drop else draw(_VALUES)
        if kind == "a":  # (an earlier mutation may have made the parent None, an int, ...: no attributes)
            with contextlib.suppress(AttributeError, TypeError):
                if drop:
                    object.__delattr__(parent, key)  # (MetadataIndex is a frozen dataclass)
                else:
                    object.__setattr__(parent, key, value)
        elif kind == "k" and isinstance(parent, dict):
            if drop:
                parent.pop(key, None)
            else:
                parent[key] = value
    return md


def _pickled(md: Any) -> bytes | None:
    try:
        return pickle.dumps(md)
    except Exception:  # (TensorProperties pickles its fields through its own __getstate__, which may refuse them)
        return None


def _import(src: Path) -> None:
    """import_dcp: a CheckpointError, or an import that loads."""
    out = _ROOT / "dcp-out"
    shutil.rmtree(out, ignore_errors=True)
    try:
        pytreeckpt.import_dcp(src, out)
    except pytreeckpt.CheckpointError as e:
        event(f"refused: {str(e).split(': ')[-1][:40]}")
        return
    event("imported")
    pytreeckpt.load(out)


def test_the_genuine_files_import() -> None:
    """(So the properties below start from files that import.)"""
    assert sorted(pytreeckpt.import_dcp(_DCP, _ROOT / "dcp-genuine")) == _FQNS
    assert sorted(pytreeckpt.import_safetensors(_ST, _ROOT / "st-genuine")) == ["e", "h", "w"]


@given(metadata_mutations())
def test_mutated_dcp_metadata_is_a_checkpoint_error_or_an_import(md: Any) -> None:
    data = _pickled(md)
    if data is None:
        event("not picklable")
        return
    src = _ROOT / "dcp"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(_DCP, src)
    (src / ".metadata").write_bytes(data)
    _import(src)


@given(st.sampled_from([".metadata", "__0_0.distcp"]), st.sampled_from(["truncate", "flip"]), st.integers(0, 10**6))
def test_damaged_dcp_files_are_a_checkpoint_error_or_an_import(name: str, action: str, where: int) -> None:
    src = _ROOT / "dcp"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(_DCP, src)
    data = bytearray((src / name).read_bytes())
    if action == "truncate":
        data = data[: where % len(data)]
    else:
        data[where % len(data)] ^= 1 << (where % 8)
    (src / name).write_bytes(bytes(data))
    _import(src)


# --------------------------------------------------------------------------- safetensors headers

_ST = _ROOT / "st-original.safetensors"
save_file(
    {"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(4, dtype=torch.bfloat16), "e": torch.empty(0, 3)},
    _ST,
    metadata={"format": "pt", "pytreeckpt.values": json.dumps({"step": 3, "lr": {"float": "nan"}})},
)
_RAW = _ST.read_bytes()
(_HEADER_LENGTH,) = struct.unpack("<Q", _RAW[:8])
_HEADER = json.loads(_RAW[8 : 8 + _HEADER_LENGTH])
_DATA = _RAW[8 + _HEADER_LENGTH :]


_HEADER_PATHS = json_paths(_HEADER)[1:]
_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**31, 2**62, 2**63, 10**30]),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.sampled_from(["F32", "BF16", "I64", "F8_E4M3", "BOOL", "X", "__metadata__"]),
    st.lists(st.integers(-3, 2**40), max_size=4),
    st.sampled_from(['{"v": [1, 2]}', '{"v": {"float": "x"}}', "[1]", "{", '{"w": 1}', '{"step": {"enum": "os:sep"}}']),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def header_mutations(draw: st.DrawFn) -> dict[str, Any]:
    header = copy.deepcopy(_HEADER)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_HEADER_PATHS))
        parent: Any = header
        try:
            for k in path[:-1]:
                parent = parent[k]
            parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, dict | list):
            continue
        if draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(_JSON_VALUES)
    return header


@given(header_mutations(), st.integers(-16, 16))
@example({**_HEADER, "e": {**_HEADER["e"], "shape": [0, 2**62]}}, 0)  # numpy cannot address it
@example({**_HEADER, "__metadata__": {"pytreeckpt.values": '{"v": ' + "[" * 10**5 + "]" * 10**5 + "}"}}, 0)
def test_a_mutated_safetensors_header_is_a_checkpoint_error_or_an_import(header: dict[str, Any], cut: int) -> None:
    raw = json.dumps(header).encode()
    f = _ROOT / "st.safetensors"
    data = _DATA[: len(_DATA) + cut] if cut < 0 else _DATA + b"\0" * cut
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    out = _ROOT / "st-out"
    shutil.rmtree(out, ignore_errors=True)
    try:
        pytreeckpt.import_safetensors(f, out)
    except pytreeckpt.CheckpointError:
        pass
    else:
        pytreeckpt.load(out)
    target = {"w": torch.zeros(2, 3), "h": torch.zeros(4, dtype=torch.bfloat16), "e": torch.zeros(0, 3)}
    with contextlib.suppress(pytreeckpt.CheckpointError):
        pytreeckpt.load_safetensors(f, target, strict=False, cast=True)
