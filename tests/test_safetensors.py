"""export_safetensors and import_safetensors: tensors and Python values make the round trip."""

from __future__ import annotations

import enum
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import pytreeckpt


class Stage(enum.IntEnum):
    PRETRAIN = 1
    FINETUNE = 2


def _state() -> dict[str, object]:
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)},
        "optim": {"step": 1200, "lr": 3e-4, "betas": (0.9, 0.95), "warm": True, "nan": math.nan},
        "data": {"epoch": 2, "position": 123_456_789, "file": "shard-00007.bin", "skip": None},
        "stage": Stage.FINETUNE,
    }


def _values() -> dict[str, object]:
    """The Python values of ``_state()`` by key path (tuples are containers: their items are leaves)."""
    return {
        "optim.step": 1200,
        "optim.lr": 3e-4,
        "optim.betas.0": 0.9,
        "optim.betas.1": 0.95,
        "optim.warm": True,
        "optim.nan": math.nan,
        "data.epoch": 2,
        "data.position": 123_456_789,
        "data.file": "shard-00007.bin",
        "data.skip": None,
        "stage": Stage.FINETUNE,
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("max_shard_size", ["5GB", "40B"])
def test_python_values_survive_export_and_import(tmp_path: Path, max_shard_size: str) -> None:
    state = _state()
    pytreeckpt.save(tmp_path / "c", state)
    files = pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "out", max_shard_size=max_shard_size)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) == (1 if max_shard_size == "5GB" else 2)
    with safe_open(str(shards[0]), "pt") as f:  # the safetensors library's own reader
        stored = json.loads(f.metadata()["pytreeckpt.values"])
    assert stored["optim.step"] == 1200
    assert stored["optim.nan"] == {"float": "nan"}
    assert stored["stage"] == {"enum": f"{__name__}:Stage", "value": 2}
    names = pytreeckpt.import_safetensors(tmp_path / "out", tmp_path / "back")
    assert sorted(names) == ["model.b", "model.w"]
    back = pytreeckpt.load(tmp_path / "back")
    want = _values()
    assert set(back) == {"model.w", "model.b", *want}
    for key, value in want.items():
        assert _same(back[key], value), (key, back[key], value)
    assert torch.equal(back["model.w"], torch.arange(12.0).reshape(3, 4))


def test_a_checkpoint_of_values_only_exports_and_imports(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"step": 7, "note": "no tensors"})
    pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "out")
    pytreeckpt.import_safetensors(tmp_path / "out" / "model.safetensors", tmp_path / "back")
    assert pytreeckpt.load(tmp_path / "back") == {"step": 7, "note": "no tensors"}


def _with_metadata(path: Path, meta: dict[str, str], tensor_name: str = "w") -> None:
    header = json.dumps(
        {"__metadata__": meta, tensor_name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<f", 1.0))


def test_malformed_or_clashing_values_in_a_header_are_refused(tmp_path: Path) -> None:
    _with_metadata(tmp_path / "bad.safetensors", {"pytreeckpt.values": "[1, 2]"})
    with pytest.raises(pytreeckpt.CheckpointError, match=r"bad\.safetensors.*malformed 'pytreeckpt\.values'"):
        pytreeckpt.import_safetensors(tmp_path / "bad.safetensors", tmp_path / "c1")
    _with_metadata(tmp_path / "clash.safetensors", {"pytreeckpt.values": '{"w": 1}'})
    with pytest.raises(pytreeckpt.CheckpointError, match="'w' names both a tensor and a value"):
        pytreeckpt.import_safetensors(tmp_path / "clash.safetensors", tmp_path / "c2")
    _with_metadata(tmp_path / "plain.safetensors", {"format": "pt"})  # other writers' files: tensors only
    assert pytreeckpt.import_safetensors(tmp_path / "plain.safetensors", tmp_path / "c3") == ["w"]
    assert list(pytreeckpt.load(tmp_path / "c3")) == ["w"]
