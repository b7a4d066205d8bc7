"""Packed arrays in zip archives (``StorageOptions(pack_format="zip")``): stored form, readers, damage."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
import torch

import pytreeckpt
from pytreeckpt import Location, StorageOptions

ZIP = StorageOptions(pack_format="zip")


def _tree() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(37, 11, generator=g),
        "h": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "s": torch.tensor(7, dtype=torch.int64),
        "b": torch.tensor([True, False, True]),
        "n": np.arange(10, dtype=np.int16),
        "big": torch.randn(1 << 19, generator=g),  # 2 MiB: stored on its own
        "step": 3,
    }


def _doc(path: Path) -> dict[str, Any]:
    return json.loads((path / "pytreeckpt.json").read_text())


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


def test_small_leaves_go_to_zip_archives_that_zipfile_and_tensorstore_read(tmp_path: Path) -> None:
    path = tmp_path / "c"
    tree = _tree()
    pytreeckpt.save(Location(path, ZIP), tree)
    doc = _doc(path)
    assert doc["version"] == 3
    leaves = {leaf["key"]: leaf for leaf in doc["leaves"]}
    assert {k: leaves[k].get("database") for k in ("w", "h", "s", "b", "n", "big")} == {
        "w": "packed/0",
        "h": "packed/0",
        "s": "packed/0",
        "b": "packed/0",
        "n": "packed/0",
        "big": None,
    }
    assert os.listdir(path / "packed" / "0") == ["0.zip"]
    assert not (path / "ocdbt").exists()
    got = pytreeckpt.load(path)
    assert all(_equal(tree[k], got[k]) for k in tree)
    assert pytreeckpt.verify(path).ok
    archive = zipfile.ZipFile(path / "packed" / "0" / "0.zip")
    assert archive.testzip() is None  # every entry's CRC-32 as zip readers check it
    assert "arrays/w/zarr.json" in archive.namelist()
    for k in ("w", "h", "s", "n"):  # TensorStore opens each as a zarr v3 array through its zip kvstore
        kv = {"driver": "zip", "base": f"file://{path}/packed/0/0.zip"}
        stored = ts.open({"driver": "zarr3", "kvstore": kv, "path": leaves[k]["path"] + "/"}).result()
        want = tree[k].float().numpy() if k == "h" else np.asarray(tree[k])
        assert np.array_equal(np.asarray(stored.read().result(), dtype=want.dtype), want), k


def test_arrays_of_several_chunks_and_full_archives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytreeckpt.storage import _archive

    monkeypatch.setattr(_archive, "MAX_ENTRIES", 7)  # a new archive every 7 keys
    g = torch.Generator().manual_seed(3)
    tree = {f"w{i}": torch.randn(37, 11, generator=g) for i in range(12)}
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=256, min_chunk_bytes=64, max_chunk_bytes=256)
    path = tmp_path / "c"
    pytreeckpt.save(Location(path, ZIP), tree, chunking=chunking)
    assert _doc(path)["leaves"][0]["chunk_shape"] != [37, 11]  # several chunks, edge ones padded
    archives = sorted(os.listdir(path / "packed" / "0"))
    assert len(archives) > 10
    for name in archives:
        with zipfile.ZipFile(path / "packed" / "0" / name) as z:
            assert z.testzip() is None
            assert len(z.namelist()) <= 7
    got = pytreeckpt.load(path)
    assert all(torch.equal(got[k], v) for k, v in tree.items())
    assert torch.equal(pytreeckpt.load_slice(path, "w5", (slice(3, 30), slice(2, 9))), tree["w5"][3:30, 2:9])
    assert pytreeckpt.verify(path).ok


def test_an_overwrite_writes_the_next_generation_and_removes_the_last(tmp_path: Path) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(Location(path, ZIP), {"a": torch.ones(3)})
    pytreeckpt.save(Location(path, ZIP), {"a": torch.zeros(3)}, overwrite=True)
    assert os.listdir(path / "packed") == ["0~g1"]
    assert pytreeckpt.load(path)["a"].tolist() == [0.0, 0.0, 0.0]


def test_compressed_small_arrays_and_object_stores_are_not_zipped(tmp_path: Path) -> None:
    path = tmp_path / "c"
    tree = {"a": torch.ones(64), "z": torch.zeros(64)}
    pytreeckpt.save(Location(path, ZIP), tree, compression={"a": None, "z": "zstd"})
    leaves = {leaf["key"]: leaf for leaf in _doc(path)["leaves"]}
    assert leaves["a"]["database"] == "packed/0"
    assert "database" not in leaves["z"]  # the archives hold raw chunks: a compressed array is stored on its own
    assert all(torch.equal(pytreeckpt.load(path)[k], v) for k, v in tree.items())
    memory = Location("memory://zip-options/c", ZIP)
    pytreeckpt.save(memory, tree)
    assert {a.database for a in pytreeckpt.metadata(memory).arrays.values()} == {"ocdbt/0"}
    with pytest.raises(ValueError, match="pack_format must be 'ocdbt' or 'zip'"):
        StorageOptions(pack_format="tar")


def test_damaged_archives_are_refused_naming_the_leaf_or_the_archive(tmp_path: Path) -> None:
    path = tmp_path / "c"
    tree = {"a": torch.arange(8.0), "b": torch.ones(8)}
    pytreeckpt.save(Location(path, ZIP), tree)
    archive = path / "packed" / "0" / "0.zip"
    good = archive.read_bytes()
    # A chunk's byte changed: its checksum says so, naming the leaf.
    with zipfile.ZipFile(archive) as z:
        info = z.getinfo("arrays/b/c/0")
    at = info.header_offset + 30 + len(info.filename) + 2
    archive.write_bytes(good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1 :])
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'b'.*damaged"):
        pytreeckpt.load(path)
    assert torch.equal(pytreeckpt.load(path, include=["a"])["a"], tree["a"])
    assert not pytreeckpt.verify(path).ok
    # Cut short: the archive's end record is gone.
    archive.write_bytes(good[:-10])
    with pytest.raises(pytreeckpt.CheckpointError, match=r"packed archive packed/0/0.zip is damaged"):
        pytreeckpt.load(path)
    # An entry missing (the archive rewritten without it, by Python's zipfile): named with its leaf.
    archive.write_bytes(good)
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(tmp_path / "other.zip", "w") as out:
        for name in src.namelist():
            if name != "arrays/b/c/0":
                out.writestr(name, src.read(name))
    archive.write_bytes((tmp_path / "other.zip").read_bytes())
    assert torch.equal(pytreeckpt.load(path, include=["a"])["a"], tree["a"])
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'b'.*missing from the packed archives 'packed/0'"):
        pytreeckpt.load(path)
