"""Chunk checksums kept in a file of their own (``checksums/crc32c``), when a document would hold too many.

The document names each array's part of the file with the crc32c of those bytes, so the
file is trusted only through the document: damaged, cut short, missing or another
checkpoint's, it is refused on the read of an array it covers, and a chunk moved or
swapped is caught as it is with the checksums in the document.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import bits, document

import pytreeckpt
from pytreeckpt import ChunkingOptions, Location, StorageOptions
from pytreeckpt.storage import Storage
from pytreeckpt.storage._local import LocalDir

FILE = StorageOptions(max_inline_checksum_bytes=0)
SMALL_CHUNKS = ChunkingOptions(single_chunk_bytes=4096, min_chunk_bytes=4096, max_chunk_bytes=4096)


def state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 64, generator=g),  # 16 chunks of 4 KiB, files of their own
        "e": torch.randn(64, 16, dtype=torch.float64, generator=g),  # 2 chunks
        "b": torch.randn(16, generator=g),  # packed
        "step": seed,
    }


def doc(path: Path) -> dict[str, Any]:
    return document(path)


def save(path: Path | str, seed: int = 1, **kw: Any) -> dict[str, Any]:
    tree = state(seed)
    options = kw.pop("options", FILE)
    pytreeckpt.save(Location(path, options), tree, chunking=SMALL_CHUNKS, **kw)
    return tree


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return got["step"] == want["step"] and all(torch.equal(bits(got[k]), bits(want[k])) for k in ("w", "e", "b"))


def test_past_the_limit_the_checksums_go_to_a_file_and_load_from_it(tmp_path: Path) -> None:
    path = tmp_path / "c"
    want = save(path)
    d = doc(path)
    assert d["checksums"] == {"path": "checksums/crc32c", "bytes": 4 * (16 + 2 + 1)}
    arrays = [leaf for leaf in d["leaves"] if leaf["kind"] == "array"]
    assert all("chunk_crc32c" not in leaf and len(leaf["chunk_crc32c_at"]) == 2 for leaf in arrays)
    assert (path / "checksums" / "crc32c").stat().st_size == 76
    assert same(pytreeckpt.load(path), want)
    assert torch.equal(pytreeckpt.load_slice(path, "w", (slice(3, 200), 5)), want["w"][3:200, 5:6])
    assert pytreeckpt.verify(path).ok
    meta = pytreeckpt.metadata(path).arrays["w"]
    assert meta.crc32c() is not None
    assert len(meta.crc32c() or b"") == 64


def test_under_the_limit_they_stay_in_the_document(tmp_path: Path) -> None:
    path = tmp_path / "c"
    want = save(path, options=StorageOptions())
    d = doc(path)
    assert "checksums" not in d
    assert not (path / "checksums").exists()
    assert all("chunk_crc32c" in leaf for leaf in d["leaves"] if leaf["kind"] == "array")
    assert same(pytreeckpt.load(path), want)


def test_a_chunk_swapped_for_another_checkpoints_is_caught(tmp_path: Path) -> None:
    """What the document's checksums are for: a chunk valid in itself, in the wrong place."""
    unpacked = StorageOptions(max_inline_checksum_bytes=0, pack_small_leaves=False)
    save(tmp_path / "a", 1, options=unpacked)
    save(tmp_path / "b", 2, options=unpacked)
    chunk = Path("arrays", "w", "c", "3", "0")
    shutil.copyfile(tmp_path / "b" / chunk, tmp_path / "a" / chunk)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*chunk \[3, 0\]"):
        pytreeckpt.load(tmp_path / "a")
    assert not pytreeckpt.verify(tmp_path / "a").ok


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p, _: p.write_bytes(p.read_bytes()[:-1]), r"ends at byte 75, the metadata records 76 bytes"),
        (lambda p, _: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]), r"damaged or another"),
        (lambda p, _: p.unlink(), r"chunk checksums 'checksums/crc32c' the metadata names are missing"),
        (lambda p, other: shutil.copyfile(other, p), r"its chunk checksums, bytes .* damaged or another"),
    ],
    ids=["cut short", "one bit", "missing", "another checkpoint's"],
)
def test_a_damaged_or_foreign_checksums_file_is_refused(tmp_path: Path, damage: Any, match: str) -> None:
    save(tmp_path / "a", 1)
    save(tmp_path / "b", 2)
    damage(tmp_path / "a" / "checksums" / "crc32c", tmp_path / "b" / "checksums" / "crc32c")
    with pytest.raises(pytreeckpt.CheckpointError, match=match):
        pytreeckpt.load(tmp_path / "a")


def test_a_checksums_file_leading_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    save(tmp_path / "a", 1)
    save(tmp_path / "b", 1)  # the same bytes: only the link is wrong
    (tmp_path / "a" / "checksums" / "crc32c").unlink()
    (tmp_path / "a" / "checksums" / "crc32c").symlink_to(tmp_path / "b" / "checksums" / "crc32c")
    with pytest.raises(pytreeckpt.CheckpointError, match=r"^the chunk checksums 'checksums/crc32c': .* outside"):
        pytreeckpt.load(tmp_path / "a")


def _with(path: Path, leaf: dict[str, Any] | None = None, checksums: Any = "same") -> None:
    d = doc(path)
    if leaf is not None:
        d["leaves"][0].update(leaf)
        d["leaves"][0] = {k: v for k, v in d["leaves"][0].items() if v is not None}
    if checksums != "same":
        d["checksums"] = checksums
        if checksums is None:
            del d["checksums"]
    (path / "pytreeckpt.json").write_text(json.dumps(d))


@pytest.mark.parametrize(
    ("leaf", "checksums", "match"),
    [
        ({"chunk_crc32c_at": [0, 2**32]}, "same", r"leaf 'w': chunk_crc32c_at must be \[offset, crc32c\]"),
        ({"chunk_crc32c_at": [-4, 0]}, "same", r"chunk_crc32c_at must be \[offset, crc32c\]"),
        ({"chunk_crc32c_at": [0, True]}, "same", r"chunk_crc32c_at must be \[offset, crc32c\]"),
        ({"chunk_crc32c_at": "0,1"}, "same", r"chunk_crc32c_at must be \[offset, crc32c\]"),
        ({"chunk_crc32c_at": [24, 1]}, "same", r"names bytes 24 to 88 of 'checksums/crc32c' .*16 chunks.*holds 76"),
        ({"chunk_crc32c": "A" * 88}, "same", r"leaf 'w': both chunk_crc32c and chunk_crc32c_at"),
        (None, None, r"leaf 'w': chunk_crc32c_at without a checksums file"),
        (None, {"path": "checksums/../pytreeckpt.json", "bytes": 76}, r"'checksums' must be"),
        (None, {"path": "checksums/crc32c~g0", "bytes": 76}, r"'checksums' must be"),
        (None, {"path": "checksums/crc32c", "bytes": -1}, r"'checksums' must be"),
        (None, {"path": "checksums/crc32c", "bytes": "84"}, r"'checksums' must be"),
        (None, "checksums/crc32c", r"'checksums' must be"),
    ],
)
def test_malformed_references_to_the_file_are_refused(tmp_path: Path, leaf: Any, checksums: Any, match: str) -> None:
    path = tmp_path / "c"
    save(path)
    _with(path, leaf, checksums)
    with pytest.raises(pytreeckpt.MetadataError, match=match):
        pytreeckpt.metadata(path)


def test_a_leaf_pointing_at_another_leafs_part_is_refused(tmp_path: Path) -> None:
    """An offset moved within the file: the crc32c of the part it names is not the one recorded."""
    path = tmp_path / "c"
    save(path)
    at = doc(path)["leaves"][0]["chunk_crc32c_at"]
    _with(path, {"chunk_crc32c_at": [at[0] + 4, at[1]]})
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w': its chunk checksums, bytes 4 to 68"):
        pytreeckpt.load(path)


def test_a_replacement_writes_its_own_file_and_the_old_one_goes_after_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "c"
    save(path, 1)
    want = save(path, 2, overwrite=True)
    assert doc(path)["checksums"]["path"] == "checksums/crc32c~g1"
    assert sorted(p.name for p in (path / "checksums").iterdir()) == ["crc32c~g1"]
    assert same(pytreeckpt.load(path), want)
    want = save(path, 3, overwrite=True, options=StorageOptions())  # back in the document: the file goes
    assert "checksums" not in doc(path)
    assert list((path / "checksums").iterdir()) == []
    assert same(pytreeckpt.load(path), want)


def test_a_commit_that_fails_after_the_file_is_written_keeps_the_checkpoint_it_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c"
    want = save(path, 1)
    real = LocalDir.write_checksums

    def write_then_fail(self: LocalDir, name: str, data: bytes) -> None:
        real(self, name, data)
        assert (path / name).is_file()
        raise pytreeckpt.CheckpointError("the disk is on fire")

    monkeypatch.setattr(LocalDir, "write_checksums", write_then_fail)
    for call in (save, lambda *a, **k: pytreeckpt.async_save(Location(a[0], FILE), state(2), **k).wait()):
        with pytest.raises(pytreeckpt.CheckpointError, match="on fire"):
            call(path, 2, overwrite=True) if call is save else call(path, overwrite=True)
        assert sorted(p.name for p in (path / "checksums").iterdir()) == ["crc32c"]
        assert same(pytreeckpt.load(path), want)


def test_on_a_key_value_store(tmp_path: Path) -> None:
    where = f"memory://{uuid.uuid4().hex}/c"
    want = save(where, 1)
    assert same(pytreeckpt.load(where), want)
    want = save(where, 2, overwrite=True)
    keys = Storage(where).kv.list()  # type: ignore[union-attr]
    assert [k for k in keys if k.startswith("checksums/")] == ["checksums/crc32c~g1"]
    assert same(pytreeckpt.load(where), want)
    assert torch.equal(pytreeckpt.load_slice(where, "e", (slice(None), 3)), want["e"][:, 3:4])


def test_a_save_too_big_for_the_metadata_limit_only_with_its_checksums_inline_is_taken(tmp_path: Path) -> None:
    """The refusal before writing counts what the document will hold: not the checksums that go to their file."""
    w = torch.randn(1024, 256)  # 1,024 chunks of 1 KiB: 5,464 bytes of checksums in the document
    one_kib = ChunkingOptions(single_chunk_bytes=1024, min_chunk_bytes=1024, max_chunk_bytes=1024)
    inline = Location(tmp_path / "inline", StorageOptions(max_metadata_bytes=4000))
    with pytest.raises(pytreeckpt.MetadataError, match=r"would hold about \d+ bytes, more than the 4000"):
        pytreeckpt.save(inline, {"w": w}, chunking=one_kib)
    in_file = Location(tmp_path / "file", StorageOptions(max_metadata_bytes=4000, max_inline_checksum_bytes=1000))
    pytreeckpt.save(in_file, {"w": w}, chunking=one_kib)
    assert (tmp_path / "file" / "pytreeckpt.json").stat().st_size < 4000
    assert torch.equal(pytreeckpt.load(in_file)["w"], w)
