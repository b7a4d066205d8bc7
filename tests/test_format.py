"""The metadata document: paths stay inside the checkpoint; malformed documents are clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import document, unpacked

import pytreeckpt
from pytreeckpt.format import array_names, parse_document


def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    pytreeckpt.save(unpacked(tmp_path / "c"), {"w": torch.arange(4.0), "step": 1})
    return tmp_path / "c", document(tmp_path / "c")


def rewrite(path: Path, doc: Any) -> None:
    (path / "pytreeckpt.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "bad",
    [
        "../x",
        "/etc",
        "arrays/../../x",
        "arrays/../arrays/w",
        "arrays/.",
        "arrays/a/b",
        "",
        "arrays/w\n",
        "arrays/w\x00",
    ],
)
def test_array_paths_cannot_leave_the_checkpoint(tmp_path: Path, bad: str) -> None:
    path, doc = saved(tmp_path)
    doc["leaves"][0]["path"] = bad
    rewrite(path, doc)
    with pytest.raises(pytreeckpt.MetadataError, match=r"leaf 'w': array path .* not of the form"):
        pytreeckpt.load(path)


def test_a_symlink_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    outside = tmp_path / "outside"
    os.rename(path / "arrays" / "w", outside)
    os.symlink(outside, path / "arrays" / "w")
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*leads outside the checkpoint"):
        pytreeckpt.load(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="other"), "not a pytreeckpt metadata document"),
        (lambda d: d.update(version=99), "version 99 is not supported"),
        (lambda d: d["leaves"][0].update(dtype="float128"), "unknown dtype"),
        (lambda d: d["leaves"][0].update(shape=[-1]), r"shape must be a list of integers from 0 to 2\*\*62 - 2"),
        (lambda d: d["leaves"][0].update(shape="big"), "shape must be a list"),
        (lambda d: d["leaves"][0].update(chunk_shape=[0]), "chunk_shape"),
        (lambda d: d["leaves"][0].update(kind="pickle"), "unknown kind"),
        (lambda d: d["leaves"][0].update(storage_dtype="int8"), "is stored as float32"),
        (lambda d: d.update(tree={"k": "dict", "keys": ["a"], "c": [5]}), "names leaf 5"),
        (lambda d: d.update(tree={"k": "evil", "c": []}), "unknown tree node kind"),
        (lambda d: d.update(leaves="x"), "'leaves' must be a list"),
        (lambda d: d["leaves"][1].update(value={"$class": "os.system"}), "malformed inline value"),
    ],
)
def test_malformed_metadata_is_a_metadata_error(tmp_path: Path, edit: Any, message: str) -> None:
    path, doc = saved(tmp_path)
    edit(doc)
    rewrite(path, doc)
    with pytest.raises(pytreeckpt.MetadataError, match=message):
        pytreeckpt.load(path)


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'{"format": NaN}', b"\xff\xfe", b"[" * 100000])
def test_garbage_documents_are_metadata_errors(raw: bytes) -> None:
    with pytest.raises(pytreeckpt.MetadataError):
        parse_document(raw)


def test_a_stored_array_that_disagrees_with_the_metadata_is_refused(tmp_path: Path) -> None:
    path, doc = saved(tmp_path)
    doc["leaves"][0]["shape"] = [2]  # smaller than stored: zarr.json disagrees
    rewrite(path, doc)
    # (its chunk files are read by the executor, not opened by TensorStore: its zarr.json is compared field by field)
    disagrees = r"leaf 'w': arrays/w/zarr\.json does not describe the array the document does: its shape is \[4\]"
    with pytest.raises(pytreeckpt.CheckpointError, match=disagrees + r", the document's array has \[2\]"):
        pytreeckpt.load(path)


def test_a_missing_or_foreign_zarr_json_is_refused(tmp_path: Path) -> None:
    """zarr.json is what TensorStore and zarr read: a load refuses a checkpoint whose arrays they could not read
    as the document says, though its own reads do not use it."""
    path, _ = saved(tmp_path)
    zarr = path / "arrays" / "w" / "zarr.json"
    kept = zarr.read_bytes()
    zarr.unlink()
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w': arrays/w/zarr\.json is missing"):
        pytreeckpt.load(path)
    zarr.write_bytes(kept.replace(b'"float32"', b'"int32"'))
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w': .*its data_type is \"int32\""):
        pytreeckpt.load(path)
    zarr.write_bytes(b"{" * 70_000)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w': .*zarr\.json holds 70000 bytes"):
        pytreeckpt.load(path)
    zarr.write_bytes(kept)
    assert pytreeckpt.load(path)["w"].shape == (4,)


def test_a_huge_claimed_shape_is_refused_before_any_allocation(tmp_path: Path) -> None:
    path, doc = saved(tmp_path)
    doc["leaves"][0]["shape"] = [2**40, 2**20]
    doc["leaves"][0]["chunk_shape"] = [2**20, 2**20]
    del doc["leaves"][0]["chunk_crc32c"]  # recorded for the true grid, it would be refused first
    rewrite(path, doc)
    with pytest.raises(pytreeckpt.MetadataError, match=r"leaf 'w': the metadata claims .* holds only \d+ bytes"):
        pytreeckpt.load(path)


def test_verify_reports_damaged_leaves_and_chunks(tmp_path: Path) -> None:
    pytreeckpt.save(
        unpacked(tmp_path / "c"),
        {"a": torch.arange(64.0), "b": torch.arange(64.0), "c": torch.ones(3)},
        chunking=pytreeckpt.ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=64),
    )
    assert pytreeckpt.verify(tmp_path / "c").ok
    chunk_files = sorted(
        p for p in (tmp_path / "c" / "arrays" / "a").rglob("*") if p.is_file() and p.name != "zarr.json"
    )
    raw = bytearray(chunk_files[1].read_bytes())
    raw[3] ^= 0x01
    chunk_files[1].write_bytes(bytes(raw))
    (tmp_path / "c" / "arrays" / "c" / "zarr.json").unlink()
    report = pytreeckpt.verify(tmp_path / "c")
    assert not report.ok
    assert report.damaged_leaves == ("a", "c")
    (a_problem,) = [p for p in report.problems if p[0] == "a"]
    assert a_problem[1] is not None  # the damaged chunk is named
    assert report.chunks >= 8


def test_a_missing_chunk_is_an_error_not_zeros(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    chunks = [p for p in (path / "arrays" / "w").rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert chunks
    for c in chunks:
        c.unlink()
    with pytest.raises(pytreeckpt.CheckpointError, match="leaf 'w'"):
        pytreeckpt.load(path)


def test_a_corrupted_chunk_fails_its_checksum(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    (chunk,) = [p for p in (path / "arrays" / "w").rglob("*") if p.is_file() and p.name != "zarr.json"]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*fails its checksum"):
        pytreeckpt.load(path)


def _small_chunks(tmp_path: Path) -> Path:
    """5 float32 in chunks of one element: each chunk file is 4 bytes and a 4-byte checksum, so a
    chunk can be damaged without the stored bytes falling below the array's size (the check
    before any read)."""
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=2, min_chunk_bytes=2, max_chunk_bytes=4)
    pytreeckpt.save(unpacked(tmp_path / "c"), {"w": torch.arange(5.0)}, chunking=chunking)
    assert json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())["leaves"][0]["chunk_shape"] == [1]
    return tmp_path / "c" / "arrays" / "w" / "c"


def test_a_truncated_chunk_is_refused_with_its_size(tmp_path: Path) -> None:
    chunks = _small_chunks(tmp_path)
    (chunks / "0").write_bytes((chunks / "0").read_bytes()[:2])
    damaged = r"leaf 'w'.*chunk \[0\] is damaged: .* holds 2 bytes, expected 8"
    with pytest.raises(pytreeckpt.CheckpointError, match=damaged):
        pytreeckpt.load(tmp_path / "c")


def test_a_missing_chunk_file_is_named(tmp_path: Path) -> None:
    chunks = _small_chunks(tmp_path)
    (chunks / "1").unlink()
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*chunk \[1\] is missing"):
        pytreeckpt.load(tmp_path / "c")


def test_array_names() -> None:
    assert array_names(["model.w", "model/w", "", "Model.W", "..", "-x"]) == [
        "model.w",
        "model_w",
        "root",
        "Model.W~1",
        "_..",
        "_-x",
    ]


def test_array_leaves_made_by_their_slots_are_the_ones_init_makes() -> None:
    """The typed parse (leaves of a kind seen before) and a save make their leaves by setting their
    slots: every field (those equality leaves out too) is what ``ArrayMeta(...)`` gives, and a
    field added to ArrayMeta and not set there fails here."""
    import dataclasses

    from pytreeckpt.core._dtypes import dtype_from_name
    from pytreeckpt.format import ArrayMeta, ChecksumFile, Compression, plain_array_meta
    from pytreeckpt.format._parse import _meta_like

    like = ArrayMeta("a", "torch", dtype_from_name("bfloat16"), (3, 5), (3, 5), "arrays/a", None, database="packed/1")
    file = ChecksumFile("checksums/crc32c", 64)
    for text, at, f in (("AAAAAA==", None, None), (None, (8, 1234), file), (None, None, None)):
        made = _meta_like(like, "b.c", "arrays/b.c", text, at, f)
        want = ArrayMeta(
            "b.c", "torch", like.dtype, (3, 5), (3, 5), "arrays/b.c", None, None, None, "packed/1", None, text, at, f
        )
        for field in dataclasses.fields(ArrayMeta):
            assert getattr(made, field.name) == getattr(want, field.name), field.name
        assert made.nbytes == 30
        assert made._decoded is not like._decoded
        assert made == want
        assert hash(made) == hash(want)  # (hashed by its compared fields, as when it was frozen)
    # and as a save makes its leaves: any layout, compression and database
    layout = pytreeckpt.ShardingSpec(pytreeckpt.Mesh(4), [pytreeckpt.Shard(1)])
    for compression, database in ((Compression("zstd", level=5), None), (None, "ocdbt/3"), (None, None)):
        args = ("w", "numpy", dtype_from_name("int16"), (6, 0, 4), (2, 1, 4), "arrays/w", layout, compression)
        made = plain_array_meta(*args, database)
        want = ArrayMeta(*args, database=database)
        for field in dataclasses.fields(ArrayMeta):
            assert getattr(made, field.name) == getattr(want, field.name), field.name
