"""docs/format.md says what the files are: its zarr.json examples byte for byte, its reader specs."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
from helpers import packed_in, unpacked

import pytreeckpt

FORMAT_MD = Path(__file__).parent.parent / "docs" / "format.md"
CHANGELOG = Path(__file__).parent.parent / "CHANGELOG.md"


def _documented_zarr_json() -> list[str]:
    """The zarr.json examples of docs/format.md, one per line."""
    return [line for line in FORMAT_MD.read_text().splitlines() if line.startswith('{"chunk_grid"')]


def test_the_zarr_json_examples_are_the_files_save_writes(tmp_path: Path) -> None:
    leaves = {
        "w": torch.zeros(1024, 1024, dtype=torch.bfloat16),
        "mask": torch.zeros(100, dtype=torch.bool),
        "q": torch.zeros(256, 256, dtype=torch.float8_e4m3fn),
    }
    compression = {"w": None, "mask": None, "q": "zstd"}
    pytreeckpt.save(unpacked(tmp_path / "c"), leaves, compression=compression)
    written = [(tmp_path / "c" / "arrays" / name / "zarr.json").read_text() for name in leaves]
    assert _documented_zarr_json() == written
    # A packed array's zarr.json, inside its OCDBT database or its zip archive, is the same document.
    pytreeckpt.save(packed_in(tmp_path / "p", "ocdbt"), {"mask": leaves["mask"]})
    db = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/p/ocdbt/0/"}).result()
    assert db.read("arrays/mask/zarr.json").result().value.decode() == written[1]
    pytreeckpt.save(tmp_path / "z", {"mask": leaves["mask"]})
    with zipfile.ZipFile(tmp_path / "z" / "packed" / "0" / "0.zip") as z:
        assert z.read("arrays/mask/zarr.json").decode() == written[1]


def _leaves() -> dict[str, torch.Tensor | np.ndarray]:
    """A leaf of every dtype docs/format.md lists, with varied bits."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor | np.ndarray] = {"bool": torch.rand(10, generator=g) > 0.5}
    for dtype in (
        torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
        torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.bits8, torch.bits16,
    ):  # fmt: skip
        raw = torch.randint(0, 256, (10 * dtype.itemsize,), dtype=torch.uint8, generator=g)
        out[str(dtype).removeprefix("torch.")] = raw.view(dtype)
    out["int4"] = np.arange(-8, 8).astype(ml_dtypes.int4)
    out["float4_e2m1fn"] = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -6]).astype(ml_dtypes.float4_e2m1fn)
    out["float8_e4m3b11fnuz"] = np.linspace(-2, 2, 9).astype(ml_dtypes.float8_e4m3b11fnuz)
    return out


def _raw(x: torch.Tensor | np.ndarray) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes() if isinstance(x, torch.Tensor) else x.tobytes()


@pytest.mark.parametrize("pack", ["", "ocdbt", "zip"], ids=["own-files", "packed-ocdbt", "packed-zip"])
def test_every_storage_type_opens_with_plain_tensorstore_by_the_documented_spec(tmp_path: Path, pack: str) -> None:
    leaves = _leaves()
    ckpt = tmp_path / "c"
    pytreeckpt.save(packed_in(ckpt, pack) if pack else unpacked(ckpt), leaves)
    doc = json.loads((ckpt / "pytreeckpt.json").read_text())
    assert all(("database" in leaf) == bool(pack) for leaf in doc["leaves"])
    for leaf in doc["leaves"]:
        if pack == "zip":  # the spec docs/format.md gives for an array in a zip archive
            base = f"file://{ckpt}/{leaf['database']}/0.zip"
            spec = {"driver": "zarr3", "kvstore": {"driver": "zip", "base": base}, "path": leaf["path"] + "/"}
        elif pack:  # and for one in an OCDBT database
            kvstore = {"driver": "ocdbt", "base": f"file://{ckpt}/{leaf['database']}/", "path": leaf["path"] + "/"}
            spec = {"driver": "zarr3", "kvstore": kvstore}
        else:
            spec = {"driver": "zarr3", "kvstore": f"file://{ckpt}/{leaf['path']}/"}
        data = ts.open(spec).result().read().result()
        assert data.dtype.name == leaf["storage_dtype"], leaf["key"]
        assert data.tobytes() == _raw(leaves[leaf["key"]]), leaf["key"]


@pytest.mark.parametrize(
    ("children", "message"),
    [
        ([0, 0], r"names leaf 0 \('v0'\) 2 times and leaf 1 \('v1'\) not at all"),
        ([0, 1, 1], r"names leaf 1 \('v1'\) 2 times$"),
        ([1], r"names leaf 0 \('v0'\) not at all$"),
    ],
)
def test_a_tree_that_names_a_leaf_twice_or_not_at_all_says_which(
    tmp_path: Path, children: list[int], message: str
) -> None:
    """A tree structure must describe exactly the leaves the document lists, each once."""
    (tmp_path / "c").mkdir()
    leaves = [{"kind": "value", "key": f"v{i}", "value": i} for i in range(2)]
    tree = {"k": "list", "c": children}
    doc = {"format": "pytreeckpt", "version": 3, "tree": tree, "leaves": leaves, "user_metadata": {}}
    (tmp_path / "c" / "pytreeckpt.json").write_text(json.dumps(doc))
    for read in (pytreeckpt.load, pytreeckpt.metadata, pytreeckpt.verify):
        with pytest.raises(pytreeckpt.MetadataError, match=message):
            read(tmp_path / "c")


def test_the_changelog_tables_every_format_version_this_release_reads() -> None:
    from pytreeckpt.format import FORMAT_VERSION

    rows = re.findall(r"^\| (\d+) \| .* \| (\w+) \| .* \|$", CHANGELOG.read_text(), re.MULTILINE)
    assert rows == [(str(v), "yes") for v in range(1, FORMAT_VERSION + 1)]
