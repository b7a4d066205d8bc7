"""Checkpoints whose files were moved, swapped, replaced or made hostile: every read says so, none hangs.

Each chunk's crc32c is recorded in the metadata, so a chunk that is not the one the
metadata describes (moved, swapped, taken from another checkpoint, truncated, extended)
is an error on `load`, `load_slice` and `verify` alike, for every kind of stored array.
Files that lead outside the checkpoint, special files, shapes no stored chunk backs,
oversized metadata documents and files the user may not read are refused with a
CheckpointError naming what is wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tensorstore as ts
import torch
from helpers import HANG, document, packed_in, swap_zip_entries, unpacked

import pytreeckpt
from pytreeckpt import ChunkingOptions, Location, StorageOptions
from pytreeckpt.storage import Storage

SRC = Path(pytreeckpt.__file__).parent.parent
TINY = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=16)  # 4 float32 per chunk


def _tree(offset: float = 0.0) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(16.0) + offset}


def _save(where: Any, offset: float = 0.0, **kwargs: Any) -> None:
    pytreeckpt.save(where, _tree(offset), chunking=TINY, **kwargs)


def _chunk(path: Path, i: int) -> Path:
    return path / "arrays" / "w" / "c" / str(i)


def _fails_everywhere(where: Any, pattern: str) -> None:
    """load, load_slice of the damaged chunk and verify all report it (verify naming chunk 1 or its file)."""
    with pytest.raises(pytreeckpt.CheckpointError, match=pattern):
        pytreeckpt.load(where)
    with pytest.raises(pytreeckpt.CheckpointError, match=pattern):
        pytreeckpt.load_slice(where, "w", slice(4, 6))
    report = pytreeckpt.verify(where)
    assert not report.ok
    assert report.damaged_leaves == ("w",)
    assert any(chunk == (1,) or "c/1" in message for _, chunk, message in report.problems), report.problems


NOT_RECORDED = r"leaf 'w'.*chunk \[1\] is not the chunk the metadata records"


# --------------------------------------------------------------------------- chunks bound to their place


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_swapped_chunk_files_are_caught(tmp_path: Path, compression: str | None) -> None:
    path = tmp_path / "c"
    _save(unpacked(path), compression=compression)
    a, b = _chunk(path, 1), _chunk(path, 2)
    a.rename(tmp_path / "x")
    b.rename(a)
    (tmp_path / "x").rename(b)
    _fails_everywhere(path, NOT_RECORDED)


def test_a_chunk_copied_from_another_checkpoint_is_caught(tmp_path: Path) -> None:
    _save(unpacked(tmp_path / "a"))
    _save(unpacked(tmp_path / "b"), offset=100.0)
    shutil.copyfile(_chunk(tmp_path / "b", 1), _chunk(tmp_path / "a", 1))  # same position, valid crc of its own
    _fails_everywhere(tmp_path / "a", NOT_RECORDED)


def test_a_symlink_to_another_checkpoints_chunk_is_refused(tmp_path: Path) -> None:
    _save(unpacked(tmp_path / "a"))
    _save(unpacked(tmp_path / "b"), offset=100.0)
    _chunk(tmp_path / "a", 1).unlink()
    os.symlink(_chunk(tmp_path / "b", 1), _chunk(tmp_path / "a", 1))
    _fails_everywhere(tmp_path / "a", r"leaf 'w'.*c/1 leads outside the checkpoint")


def test_a_chunk_moved_to_another_place_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "c"
    # 8 chunks of 16 bytes, 20 stored: 7 of them still hold the 128 bytes claimed (the size check passes)
    pytreeckpt.save(unpacked(path), {"w": torch.arange(32.0)}, chunking=TINY)
    _chunk(path, 1).rename(tmp_path / "moved")
    _chunk(path, 7).rename(_chunk(path, 1))  # the last chunk fills the hole; the grid now misses chunk 7
    with pytest.raises(pytreeckpt.CheckpointError, match=NOT_RECORDED):
        pytreeckpt.load_slice(path, "w", slice(4, 6))
    report = pytreeckpt.verify(path)
    assert [chunk for _, chunk, _ in report.problems] == [(1,), (7,)]
    assert "is missing" in report.problems[1][2]


@pytest.mark.parametrize("change", ["extend", "truncate"])
def test_load_and_verify_agree_on_a_chunk_of_the_wrong_size(tmp_path: Path, change: str) -> None:
    """Appending one byte made load fail but verify say OK."""
    path = tmp_path / "c"
    _save(unpacked(path))
    raw = _chunk(path, 1).read_bytes()
    _chunk(path, 1).write_bytes(raw + b"x" if change == "extend" else raw[:-1])
    _fails_everywhere(path, r"leaf 'w'.*chunk \[1\] is damaged: .* holds \d+ bytes, expected 20")


@pytest.mark.parametrize("pack_format", ["ocdbt", "zip"])
def test_swapped_chunks_of_a_packed_array_are_caught(tmp_path: Path, pack_format: str) -> None:
    path = tmp_path / "c"
    _save(packed_in(path, pack_format))  # 64 bytes: packed by rank 0
    (leaf,) = document(path)["leaves"]
    if pack_format == "zip":
        assert leaf["database"] == "packed/0"
        swap_zip_entries(path / "packed" / "0" / "0.zip", "arrays/w/c/1", "arrays/w/c/2")
    else:
        assert leaf["database"] == "ocdbt/0"
        db = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/ocdbt/0/"}).result()
        one, two = db.read("arrays/w/c/1").result().value, db.read("arrays/w/c/2").result().value
        db.write("arrays/w/c/1", two).result()
        db.write("arrays/w/c/2", one).result()
    _fails_everywhere(path, NOT_RECORDED)


def test_swapped_chunk_objects_in_a_key_value_store_are_caught() -> None:
    where = f"memory://{uuid.uuid4().hex}/c"
    _save(Location(where, StorageOptions(pack_small_leaves=False)))
    kv = Storage(where).kv
    assert kv is not None
    one, two = kv.read("arrays/w/c/1"), kv.read("arrays/w/c/2")
    assert one is not None
    assert two is not None
    kv.write("arrays/w/c/1", two)
    kv.write("arrays/w/c/2", one)
    _fails_everywhere(where, NOT_RECORDED)


@pytest.mark.parametrize("pack", [False, True])
def test_a_replaced_checkpoints_arrays_record_their_checksums_under_their_new_names(tmp_path: Path, pack: bool) -> None:
    where = Location(tmp_path / "c", StorageOptions(pack_small_leaves=pack, pack_format="ocdbt"))
    _save(where)
    _save(where, offset=100.0, overwrite=True)  # written beside the old arrays, under generation 1's names
    (leaf,) = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())["leaves"]
    assert leaf["database" if pack else "path"].endswith("~g1")
    assert len(leaf["chunk_crc32c"]) == 24
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["w"], _tree(100.0)["w"])
    assert pytreeckpt.verify(tmp_path / "c").ok
    if pack:
        db = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/c/{leaf['database']}/"}).result()
        one, two = db.read("arrays/w/c/1").result().value, db.read("arrays/w/c/2").result().value
        db.write("arrays/w/c/1", two).result()
        db.write("arrays/w/c/2", one).result()
    else:
        chunks = tmp_path / "c" / leaf["path"] / "c"
        (chunks / "1").rename(tmp_path / "x")
        (chunks / "2").rename(chunks / "1")
        (tmp_path / "x").rename(chunks / "2")
    _fails_everywhere(tmp_path / "c", NOT_RECORDED)


def test_every_chunk_crc32c_is_recorded_compactly(tmp_path: Path) -> None:
    _save(unpacked(tmp_path / "c"))
    (leaf,) = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())["leaves"]
    assert len(leaf["chunk_crc32c"]) == 24  # 4 chunks: 16 bytes in base64
    meta = pytreeckpt.metadata(tmp_path / "c").arrays["w"]
    for i in range(4):
        stored = int.from_bytes(_chunk(tmp_path / "c", i).read_bytes()[-4:], "little")
        assert meta.recorded_crc32c((i,)) == stored  # the checksum each chunk file ends with


def test_checkpoints_without_recorded_checksums_still_load_and_verify(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    doc = document(path)
    del doc["leaves"][0]["chunk_crc32c"]  # as written before checksums were recorded
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    assert torch.equal(pytreeckpt.load(path)["w"], _tree()["w"])
    report = pytreeckpt.verify(path)
    assert report.ok
    assert report.unrecorded == ("w",)
    golden = pytreeckpt.verify(Path(__file__).parent / "golden" / "v1")
    assert golden.ok
    assert golden.unrecorded


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("AAAA", r"chunk_crc32c must be the base64 of 4 little-endian uint32"),
        (12, r"chunk_crc32c must be the base64 of 4 .* found int"),
        ("*" * 24, r"chunk_crc32c is not valid base64"),
    ],
)
def test_a_malformed_checksum_field_is_a_metadata_error(tmp_path: Path, value: Any, message: str) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    doc = document(path)
    doc["leaves"][0]["chunk_crc32c"] = value
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    with pytest.raises(pytreeckpt.MetadataError, match=message):
        pytreeckpt.load(path)


def test_a_damaged_checksum_field_fails_the_load_that_reads_it_not_the_parse(tmp_path: Path) -> None:
    # Checksums are decoded when an array is read (a rank of a 16,384-rank job parses 45 MB
    # of them and reads few): a leaf nobody reads does not fail a load of the others.
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), {"a": torch.arange(8.0), "b": torch.ones(8)})
    doc = document(path)
    bad = next(leaf for leaf in doc["leaves"] if leaf["key"] == "b")
    bad["chunk_crc32c"] = "*" * len(bad["chunk_crc32c"])
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    meta = pytreeckpt.metadata(path).arrays["b"]
    with pytest.raises(pytreeckpt.MetadataError, match=r"leaf 'b': chunk_crc32c is not valid base64"):
        meta.crc32c()
    assert torch.equal(pytreeckpt.load_slice(path, "a", slice(0, 8)), torch.arange(8.0))
    with pytest.raises(pytreeckpt.MetadataError, match=r"chunk_crc32c is not valid base64"):
        pytreeckpt.load(path)
    assert not pytreeckpt.verify(path).ok


def test_leaves_saved_in_one_layout_share_it_and_a_retyped_layout_is_still_refused(tmp_path: Path) -> None:
    from pytreeckpt.format import parse_document

    path = tmp_path / "c"
    spec = pytreeckpt.ShardingSpec(pytreeckpt.Mesh((2,)), [pytreeckpt.Shard(0)])
    tree = {k: pytreeckpt.ShardedLeaf.from_global(torch.arange(8.0), spec) for k in ("a", "b", "c")}
    pytreeckpt.save(path, tree)
    raw = (path / "pytreeckpt.json").read_bytes()
    a, b, c = (leaf.layout for leaf in parse_document(raw).leaves)
    assert a == spec
    assert a is b is c
    doc = document(path)
    doc["leaves"][2]["layout"]["placements"] = [["shard", True]]  # equal to ["shard", 1] as a Python key
    with pytest.raises(pytreeckpt.MetadataError, match=r"malformed saved layout"):
        parse_document(json.dumps(doc).encode())


# --------------------------------------------------------------------------- links and special files


@pytest.mark.parametrize("name", ["c/1", "zarr.json"])
def test_array_files_linking_outside_the_checkpoint_are_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    target = path / "arrays" / "w" / name
    outside = tmp_path / "outside"
    target.rename(outside)
    os.symlink(outside, target)
    for op in (lambda: pytreeckpt.load(path), lambda: pytreeckpt.load_slice(path, "w", slice(0, 2))):
        with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*leads outside the checkpoint"):
            op()
    assert not pytreeckpt.verify(path).ok


@pytest.mark.parametrize("pack_format", ["ocdbt", "zip"])
def test_a_packed_file_linking_outside_the_checkpoint_is_refused(tmp_path: Path, pack_format: str) -> None:
    path = tmp_path / "c"
    _save(packed_in(path, pack_format))
    top = "packed" if pack_format == "zip" else "ocdbt"
    victim = next(p for p in (path / top / "0").rglob("*") if p.is_file())
    victim.rename(tmp_path / "outside")
    os.symlink(tmp_path / "outside", victim)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*leads outside the checkpoint"):
        pytreeckpt.load(path)
    assert not pytreeckpt.verify(path).ok


def test_links_inside_the_checkpoint_are_followed(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    _chunk(path, 1).rename(path / "arrays" / "w" / "kept")
    os.symlink("../kept", _chunk(path, 1))
    assert torch.equal(pytreeckpt.load(path)["w"], _tree()["w"])
    assert pytreeckpt.verify(path).ok


@pytest.mark.parametrize("where", ["chunk", "array"])
def test_symbolic_link_loops_are_checkpoint_errors(tmp_path: Path, where: str) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    loop = _chunk(path, 1) if where == "chunk" else path / "arrays" / "w"
    shutil.rmtree(loop) if loop.is_dir() else loop.unlink()
    os.symlink(loop.name, loop)  # a link to itself
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w'.*symbolic links"):
        pytreeckpt.load(path)
    assert not pytreeckpt.verify(path).ok


def _run(code: str, timeout: float = HANG, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (a hang is a failure, not a stuck test run)."""
    script = "import pytreeckpt, torch, json, sys\n" + textwrap.dedent(code)
    environ = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=environ)


ATTEMPT = """
for name, op in [("load", lambda: pytreeckpt.load(PATH)), ("verify", lambda: pytreeckpt.verify(PATH))]:
    try:
        out = op()
        print(name, "ok" if name == "load" or out.ok else "PROBLEMS " + str(out.problems))
    except pytreeckpt.CheckpointError as e:
        print(name, type(e).__name__, e)
"""


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("name", ["arrays/w/c/1", "arrays/w/zarr.json", "pytreeckpt.json"])
def test_special_files_are_refused_not_waited_on(tmp_path: Path, kind: str, name: str) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    (path / name).unlink()
    if kind == "fifo":
        os.mkfifo(path / name)
    else:
        try:
            os.mknod(path / name, 0o644 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's
        except PermissionError:
            pytest.skip("this process may not make device nodes")
    done = _run(f"PATH = {str(path)!r}" + ATTEMPT)
    assert done.returncode == 0, done.stderr
    load, verify = done.stdout.splitlines()
    assert re.match(r"load CheckpointError .*not a regular file", load), load
    assert "not a regular file" in verify, verify
    assert not verify.startswith("verify ok"), verify


# --------------------------------------------------------------------------- shapes and sizes


def test_a_zero_size_array_with_a_huge_dimension_loads_at_once(tmp_path: Path) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), {"e": torch.empty(4, 0), "w": torch.ones(2)})
    doc = document(path)
    doc["leaves"][0]["shape"] = [10**15, 0]
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    zarr = json.loads((path / "arrays" / "e" / "zarr.json").read_text())
    zarr["shape"] = [10**15, 0]
    (path / "arrays" / "e" / "zarr.json").write_text(json.dumps(zarr))
    done = _run(f"""
        got = pytreeckpt.load({str(path)!r})
        print(tuple(got["e"].shape), pytreeckpt.verify({str(path)!r}).ok)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(1000000000000000,", "0)", "True"]


def _claiming(tmp_path: Path, nbytes: int) -> Path:
    """A checkpoint whose one uint8 array claims ``nbytes`` in one chunk, backed by a sparse chunk file."""
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), {"w": torch.zeros(4, dtype=torch.uint8)})
    doc = document(path)
    doc["leaves"][0].update(shape=[nbytes], chunk_shape=[nbytes])
    del doc["leaves"][0]["chunk_crc32c"]
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    zarr = json.loads((path / "arrays" / "w" / "zarr.json").read_text())
    zarr["shape"] = [nbytes]
    zarr["chunk_grid"]["configuration"]["chunk_shape"] = [nbytes]
    (path / "arrays" / "w" / "zarr.json").write_text(json.dumps(zarr))
    os.truncate(path / "arrays" / "w" / "c" / "0", nbytes + 4)  # sparse: the stored size backs the claim
    return path


def test_a_claim_beyond_this_machines_memory_is_refused_before_allocating(tmp_path: Path) -> None:
    path = _claiming(tmp_path, 1 << 40)  # 1 TiB
    claim = r"would allocate 1099511627776 bytes .* leaf 'w'.* more than the \d+ bytes this machine has available"
    with pytest.raises(pytreeckpt.CheckpointError, match=claim):
        pytreeckpt.load(path)
    with pytest.raises(pytreeckpt.CheckpointError, match=claim):
        pytreeckpt.load_slice(path, "w")
    with pytest.raises(pytreeckpt.CheckpointError, match="allocate"):  # its chunk is read whole, to check it
        pytreeckpt.load_slice(path, "w", slice(0, 4))
    assert not pytreeckpt.verify(path).ok


def test_a_grid_no_chunk_files_back_is_refused_before_looping(tmp_path: Path) -> None:
    """A compressed leaf may claim 65,536 times its bytes; its chunk grid must still be backed by files."""
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), {"w": torch.zeros(1 << 16, dtype=torch.bool)}, compression="zstd")
    doc = document(path)
    doc["leaves"][0].update(shape=[1 << 30], chunk_shape=[1])
    del doc["leaves"][0]["chunk_crc32c"]
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    stored = sum(f.stat().st_size for f in (path / "arrays" / "w" / "c").rglob("*"))
    (path / "arrays" / "w" / "c" / "0").write_bytes(bytes((1 << 30) // 65536 - stored + 64))  # enough bytes
    done = _run(f"PATH = {str(path)!r}" + ATTEMPT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("load MetadataError")
    assert "in 1073741824 chunks of [1] but 'arrays/w' holds 1 chunk files" in done.stdout


@pytest.mark.parametrize("size", [500_000_000, 8 << 30])
def test_an_oversized_metadata_document_is_refused_without_reading_it(tmp_path: Path, size: int) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    os.truncate(path / "pytreeckpt.json", size)  # sparse
    done = _run(f"""
        import resource
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        try:
            pytreeckpt.load({str(path)!r})
        except pytreeckpt.MetadataError as e:
            print("MetadataError", e)
        print("grew", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
    """)
    assert done.returncode == 0, done.stderr
    assert f"holds {size} bytes, more than the limit of 268435456" in done.stdout
    assert int(done.stdout.split("grew")[-1]) < size // 4  # the document was not read


def test_the_metadata_size_limit_is_an_option(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    size = (path / "pytreeckpt.json").stat().st_size
    small = Location(path, StorageOptions(max_metadata_bytes=size - 1))
    for op in (pytreeckpt.load, pytreeckpt.metadata, pytreeckpt.verify):
        with pytest.raises(pytreeckpt.MetadataError, match=f"holds {size} bytes, more than the limit of {size - 1}"):
            op(small)
    assert pytreeckpt.verify(Location(path, StorageOptions(max_metadata_bytes=size))).ok
    where = f"memory://{uuid.uuid4().hex}/c"
    _save(where)
    with pytest.raises(pytreeckpt.MetadataError, match="holds more than 100 bytes"):
        pytreeckpt.load(Location(where, StorageOptions(max_metadata_bytes=100)))
    assert torch.equal(pytreeckpt.load(where)["w"], _tree()["w"])
    with pytest.raises(pytreeckpt.MetadataError, match=r"would hold about .* more than the 200 bytes a load reads"):
        _save(Location(tmp_path / "small", StorageOptions(max_metadata_bytes=200)))  # never saved unreadable
    assert not (tmp_path / "small").exists()


# --------------------------------------------------------------------------- the metadata document's bytes


def test_every_single_bit_flip_of_the_metadata_document_is_refused(tmp_path: Path) -> None:
    # The document is compact JSON (no whitespace, where a flip could be harmless): every one of
    # its bits changed alone makes a document that no load accepts. (Before its checksum was
    # recorded, 2 in 101 such flips loaded other values.)
    path = tmp_path / "c"
    tree = {"w": torch.arange(4.0), "n": 3, "s": "ab"}
    pytreeckpt.save(unpacked(path), tree)
    doc = path / "pytreeckpt.json"
    raw = doc.read_bytes()
    assert b" " not in raw
    accepted = []
    for bit in range(8 * len(raw)):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        doc.write_bytes(flipped)
        try:
            pytreeckpt.load(path)
        except pytreeckpt.MetadataError:
            continue
        except pytreeckpt.CheckpointError as e:
            accepted.append((bit, f"{type(e).__name__}: {e}"))
        else:
            accepted.append((bit, "loaded"))
    assert accepted == [], f"{len(accepted)} of {8 * len(raw)} flips not refused by the parse: {accepted[:10]}"
    assert re.fullmatch(rb'.*,"document_crc32c":"[0-9a-f]{8}"}', raw)
    doc.write_bytes(raw)
    got = pytreeckpt.load(path)
    assert torch.equal(got["w"], tree["w"])
    assert (got["n"], got["s"]) == (3, "ab")


def test_a_document_edited_by_hand_keeping_its_checksum_is_refused_and_without_it_loads(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    doc = json.loads((path / "pytreeckpt.json").read_bytes())
    doc["user_metadata"] = {"edited": True}
    (path / "pytreeckpt.json").write_text(json.dumps(doc))  # the member kept, not in its form
    with pytest.raises(pytreeckpt.MetadataError, match=r"document_crc32c is not its last member in the form"):
        pytreeckpt.load(path)
    (path / "pytreeckpt.json").write_text(json.dumps(doc, separators=(",", ":")))  # in its form: checked
    with pytest.raises(pytreeckpt.MetadataError, match=r"the metadata document is damaged: its bytes have crc32c"):
        pytreeckpt.load(path)
    del doc["document_crc32c"]  # a document without one is read as one written before it was recorded
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    assert pytreeckpt.metadata(path).user_metadata == {"edited": True}
    doc["extra"] = 1
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    with pytest.raises(pytreeckpt.MetadataError, match=r"has members \['extra'\], which no document has"):
        pytreeckpt.load(path)


@pytest.mark.parametrize("pack_format", ["zip", "ocdbt"])
def test_a_database_name_with_a_newline_after_it_is_refused(tmp_path: Path, pack_format: str) -> None:
    path = tmp_path / "c"
    _save(packed_in(path, pack_format))
    doc = document(path)
    assert doc["leaves"][0]["database"] == f"{'packed' if pack_format == 'zip' else 'ocdbt'}/0"
    doc["leaves"][0]["database"] += "\n"
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    for op in (pytreeckpt.load, pytreeckpt.metadata, pytreeckpt.verify):
        with pytest.raises(pytreeckpt.MetadataError, match=r"leaf 'w': database must be 'ocdbt/<rank>' or 'packed/"):
            op(path)


@pytest.mark.parametrize(
    ("encode", "message"),
    [
        (lambda raw: b"\xef\xbb\xbf" + raw, "starts with a UTF-8 byte order mark; the format is UTF-8 without"),
        (lambda raw: raw.decode().encode("utf-16"), "starts with a UTF-16 or UTF-32 byte order mark"),
        (lambda raw: raw.decode().encode("utf-16-be"), r"holds a NUL byte \(at byte 0\): it is not UTF-8 JSON"),
        (lambda raw: raw.decode().encode("utf-32-le"), r"holds a NUL byte \(at byte 1\): it is not UTF-8 JSON"),
        (lambda raw: raw.replace(b'"w"', b'"\xe9"'), r"is not UTF-8 \(at byte \d+: invalid continuation byte\)"),
    ],
    ids=["utf-8-bom", "utf-16", "utf-16-be", "utf-32-le", "latin-1"],
)
def test_a_document_not_in_utf8_is_refused(tmp_path: Path, encode: Any, message: str) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    sealed = (path / "pytreeckpt.json").read_bytes()  # as saved, its checksum that of its UTF-8 bytes
    plain = document(path)
    for raw in [sealed, json.dumps(plain).encode()]:  # and without one (as written before it was recorded)
        (path / "pytreeckpt.json").write_bytes(encode(raw))
        for op in (pytreeckpt.load, pytreeckpt.metadata, pytreeckpt.verify):
            with pytest.raises(pytreeckpt.MetadataError, match=message):
                op(path)
    # Non-ASCII UTF-8 is UTF-8: a document another writer wrote unescaped loads.
    plain["user_metadata"] = {"name": "\u00e9t\u00e9 \u2603"}
    (path / "pytreeckpt.json").write_bytes(json.dumps(plain, ensure_ascii=False).encode())
    assert pytreeckpt.metadata(path).user_metadata == {"name": "\u00e9t\u00e9 \u2603"}


# --------------------------------------------------------------------------- permissions


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory other users can reach (pytest's own temporary directories are private to root)."""
    d = Path(tempfile.mkdtemp(prefix="pytreeckpt-perm-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


NOBODY = 65534


def _as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by another user: the interpreter starts as this user, imports, then drops to ``nobody``.

    Permissions are not enforced for root, and the interpreter lives where ``nobody``
    cannot read it, so privileges are dropped after everything is imported (a warm-up
    load imports what loading needs).
    """
    prologue = f"""
        import os, tempfile
        warm = pytreeckpt.Location(tempfile.mkdtemp() + "/w", pytreeckpt.StorageOptions(pack_small_leaves=False))
        pytreeckpt.save(warm, {{"w": torch.ones(2)}})
        pytreeckpt.load(warm); pytreeckpt.verify(warm)
        from pytreeckpt import _cli
        os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
    """
    return _run(textwrap.dedent(prologue) + textwrap.dedent(code))


def _readable(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
@pytest.mark.parametrize(
    ("target", "mode", "message"),
    [
        ("arrays/w", 0o700, r"leaf 'w': permission denied: cannot list .*arrays/w"),
        ("arrays/w/c/1", 0o600, r"chunk \[1\]: permission denied reading .*arrays/w/c/1"),
        ("pytreeckpt.json", 0o600, r"the metadata document: permission denied reading .*pytreeckpt.json"),
        (".", 0o700, r"the metadata document: permission denied reading .*pytreeckpt.json"),
    ],
)
def test_permission_denied_is_said_naming_the_path(shared: Path, target: str, mode: int, message: str) -> None:
    path = shared / "c"
    _save(unpacked(path))
    _readable(path)
    (path / target).chmod(mode)
    done = _as_nobody(f"""
        PATH = {str(path)!r}
        for name, op in [("load", lambda: pytreeckpt.load(PATH)), ("metadata", lambda: pytreeckpt.metadata(PATH)),
                         ("verify", lambda: pytreeckpt.verify(PATH))]:
            try:
                out = op()
                if name == "verify":
                    assert not out.ok and not out.problems and not out.damaged_leaves, out
                    print(name, "unreadable", *out.unreadable)
                else:
                    print(name, "ok")
            except pytreeckpt.CheckpointError as e:
                print(name, type(e).__name__, e)
        print("cli", _cli.main(["verify", PATH]))
    """)
    assert done.returncode == 0, done.stderr
    skip = ("FAILED:", "UNREADABLE", "1", "2")  # (the command line's own lines)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0] not in skip)
    assert re.search(message, lines["load"]), lines["load"]
    assert re.search(message, lines["verify"]), lines["verify"]
    assert "holds only" not in done.stdout  # not mistaken for damage
    assert "damaged" not in done.stdout.lower(), done.stdout
    assert lines["cli"] == "2"  # not 1, the status of damage
    if target.startswith("arrays/"):  # the report says it could not read, and is not ok; nothing is damage
        assert lines["verify"].startswith("unreadable"), lines["verify"]
        assert re.search(r"UNREADABLE w \((whole array|chunk \[1\])\): .*permission denied", done.stdout)
        assert "could not be read (permission denied)" in done.stdout
    if target in ("pytreeckpt.json", "."):
        assert re.search(message, lines["metadata"]), lines["metadata"]
        assert "FAILED:" in done.stdout  # the command line printed a status
        assert "permission denied" in done.stderr


# --------------------------------------------------------------------------- zip archives


def _rewrite_archive(archive: Path, change: dict[str, bytes | None]) -> None:
    """Rewrite a zip archive (as Python's zipfile writes one) with entries changed (None: left out)."""
    import zipfile

    with zipfile.ZipFile(archive) as z:
        entries = [(name, z.read(name)) for name in z.namelist()]
    with zipfile.ZipFile(archive, "w") as z:
        for name, value in entries:
            new = change.get(name, value)
            if new is not None:
                z.writestr(name, new)


def _zarr_json_of(archive: Path, name: str) -> dict[str, Any]:
    import zipfile

    with zipfile.ZipFile(archive) as z:
        return json.loads(z.read(name))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mutation", ["dtype", "shape", "chunks", "missing"])
def test_a_zip_packed_arrays_own_zarr_json_must_describe_it(tmp_path: Path, mutation: str) -> None:
    """TensorStore and zarr read a zip-packed array through its zarr.json: one that says another dtype,
    shape or chunk grid than the document (or none) is refused by load, load_slice and verify."""
    path = tmp_path / "c"
    tree = {"w": torch.arange(16.0), "v": torch.ones(4)}
    pytreeckpt.save(packed_in(path, "zip"), tree)
    archive = path / "packed" / "0" / "0.zip"
    name = "arrays/w/zarr.json"
    zarr = _zarr_json_of(archive, name)
    if mutation == "dtype":
        zarr["data_type"] = "int32"
    elif mutation == "shape":
        zarr["shape"] = [8]
    elif mutation == "chunks":
        zarr["chunk_grid"]["configuration"]["chunk_shape"] = [8]
    _rewrite_archive(archive, {name: None if mutation == "missing" else json.dumps(zarr).encode()})
    pattern = r"leaf 'w': arrays/w/zarr.json in the packed archives 'packed/0' " + (
        "is missing" if mutation == "missing" else "does not describe the array"
    )
    with pytest.raises(pytreeckpt.CheckpointError, match=pattern):
        pytreeckpt.load(path)
    with pytest.raises(pytreeckpt.CheckpointError, match=pattern):
        pytreeckpt.load(path, {"w": torch.zeros(16), "v": torch.zeros(4)}, inplace=True)  # (the planned read)
    with pytest.raises(pytreeckpt.CheckpointError, match=pattern):
        pytreeckpt.load_slice(path, "w", slice(2, 5))
    report = pytreeckpt.verify(path)
    assert report.damaged_leaves == ("w",), report.problems
    assert re.search(pattern, report.problems[0][2]), report.problems
    assert torch.equal(pytreeckpt.load(path, include=["v"])["v"], tree["v"])  # (the other leaf's is intact)


def test_a_zarr_json_written_otherwise_but_saying_the_same_is_accepted(tmp_path: Path) -> None:
    """The same description in other bytes (another key order, spacing): what TensorStore reads is the same."""
    path = tmp_path / "c"
    tree = {"w": torch.arange(16.0)}
    pytreeckpt.save(packed_in(path, "zip"), tree)
    archive = path / "packed" / "0" / "0.zip"
    zarr = _zarr_json_of(archive, "arrays/w/zarr.json")
    again = json.dumps(dict(reversed(zarr.items())), indent=2).encode()
    _rewrite_archive(archive, {"arrays/w/zarr.json": again})
    assert torch.equal(pytreeckpt.load(path)["w"], tree["w"])
    assert pytreeckpt.verify(path).ok


def _sparse_archive(tmp_path: Path, claim: str) -> Path:
    """A zip-packed checkpoint whose archive is a few KB of data in a 2 GiB sparse file: its end record claims a
    2 GiB central directory (``"directory"``), or leaf w's chunk entry claims 2 GiB of holes (``"entry"``)."""
    import struct
    import zipfile

    path = tmp_path / "c"
    pytreeckpt.save(packed_in(path, "zip"), {"w": torch.arange(16.0), "v": torch.ones(4)})
    archive = path / "packed" / "0" / "0.zip"
    raw = archive.read_bytes()
    n, cd_size, cd_start = struct.unpack_from("<HII", raw, len(raw) - 22 + 10)
    huge = 2 << 30
    if claim == "directory":  # the real entries, then holes the directory is said to fill, then the end record
        with open(archive, "r+b") as f:
            f.truncate(cd_start + huge)
            f.seek(cd_start + huge)
            f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, huge, cd_start, 0))
        return path
    with zipfile.ZipFile(archive) as z:
        info = z.getinfo("arrays/w/c/0")
    directory = bytearray(raw[cd_start : cd_start + cd_size])
    p = 0
    while p < len(directory):  # the chunk's central entry claims 2 GiB; the directory goes after them
        name_len = struct.unpack_from("<H", directory, p + 28)[0]
        if bytes(directory[p + 46 : p + 46 + name_len]) == info.filename.encode():
            struct.pack_into("<II", directory, p + 20, huge, huge)
        p += 46 + name_len
    at = cd_start + huge
    with open(archive, "r+b") as f:
        f.truncate(at)
        f.seek(at)
        f.write(bytes(directory) + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, at, 0))
    return path


PEAK = """
import resource
PATH = {path!r}
for name, op in [
    ("load", lambda: pytreeckpt.load(PATH)),
    ("include", lambda: pytreeckpt.load(PATH, include=["w"])),
    ("load_slice", lambda: pytreeckpt.load_slice(PATH, "w", slice(0, 4))),
    ("verify", lambda: pytreeckpt.verify(PATH)),
]:
    try:
        out = op()
        print(name, "ok" if name != "verify" or out.ok else "PROBLEMS " + str(out.problems).replace(chr(10), " "))
    except pytreeckpt.CheckpointError as e:
        print(name, "CheckpointError", str(e).replace(chr(10), " "))
print("peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

LIMIT = """
import resource
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + {room}, vm + {room}))
"""


@pytest.mark.parametrize("claim", ["directory", "entry"])
def test_a_sparse_archive_claiming_gigabytes_is_refused_in_little_memory(tmp_path: Path, claim: str) -> None:
    path = _sparse_archive(tmp_path, claim)
    assert os.stat(path / "packed" / "0" / "0.zip").st_blocks * 512 < 1 << 20  # (holes: nearly nothing stored)
    for limit in ("", LIMIT.format(room=1 << 30)):  # free, and under an address-space limit of 1 GiB more
        done = _run(limit + PEAK.format(path=str(path)))
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        *ops, peak = lines
        assert len(ops) == 4, done.stdout
        expected = "central directory" if claim == "directory" else "holds 2147483648 bytes, expected"
        for line in ops:
            assert "CheckpointError" in line or "PROBLEMS" in line, line
            assert expected in line, line
        assert int(peak.split()[1]) < 1 << 30, peak  # (a Python with torch: some hundreds of MB)


_OPS = """
for name, op in [("load", lambda: pytreeckpt.load({path!r})), ("slice", lambda: pytreeckpt.load_slice({path!r}, "w"))]:
    try:
        op()
        print(name, "ok")
    except pytreeckpt.CheckpointError as e:
        print(name, "CheckpointError", e)
"""


def test_a_claim_past_the_address_space_limit_is_refused_before_allocating(tmp_path: Path) -> None:
    """16 GiB claimed, backed by a sparse chunk file, under an address-space limit far below it (and far
    below this machine's memory): refused before allocating, naming the leaf and the bytes."""
    path = _claiming(tmp_path, 16 << 30)
    done = _run(
        LIMIT.format(room=4 << 30)
        + """
from pytreeckpt.storage import available_memory
print("available", available_memory())
OPS""".replace("OPS", _OPS.format(path=str(path)))
    )
    assert done.returncode == 0, done.stderr
    available, load, load_slice = done.stdout.splitlines()
    assert 0 < int(available.split()[1]) <= 4 << 30, available
    for line in (load, load_slice):
        assert re.match(r"\w+ CheckpointError .*would allocate 17179869184 bytes .*leaf 'w'", line), line


def test_an_allocation_that_fails_is_a_checkpoint_error_naming_the_leaf(tmp_path: Path) -> None:
    """Where the system does not say how much memory is left, the allocation itself fails under the limit:
    a CheckpointError naming the leaf and the bytes, not torch's RuntimeError or a MemoryError."""
    path = _claiming(tmp_path, 16 << 30)
    done = _run(
        LIMIT.format(room=4 << 30)
        + """
import pytreeckpt.loading._open as load_module
load_module.available_memory = lambda: None  # (as on a system without /proc/meminfo)
OPS""".replace("OPS", _OPS.format(path=str(path)))
    )
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        assert re.match(r"\w+ CheckpointError leaf 'w': cannot allocate 17179869184 bytes", line), line


# --------------------------------------------------------------------------- a save never works through a link


def _outside(tmp_path: Path) -> Path:
    """A user's directory beside the checkpoint: a file, and a folder with a file of its own."""
    out = tmp_path / "outside"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("my notes")
    (out / "sub" / "more.txt").write_text("more notes")
    return out


def _snapshot(top: Path) -> dict[str, tuple[str, bytes]]:
    """Every entry below ``top`` (links not followed): its kind and its bytes or the link's target."""
    out: dict[str, tuple[str, bytes]] = {}
    for p in sorted(top.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(top))] = ("link", os.readlink(p).encode())
        elif p.is_dir():
            out[str(p.relative_to(top))] = ("dir", b"")
        else:
            out[str(p.relative_to(top))] = ("file", p.read_bytes())
    return out


_OPTIONS = {  # a checkpoint holding the top-level directory, and how to save it again
    "arrays": StorageOptions(pack_small_leaves=False),
    "packed": StorageOptions(pack_format="zip"),
    "ocdbt": StorageOptions(pack_format="ocdbt"),
    "checksums": StorageOptions(pack_small_leaves=False, max_inline_checksum_bytes=0),
}


@pytest.mark.parametrize("committed", [True, False], ids=["replacing", "first-save"])
@pytest.mark.parametrize("top", list(_OPTIONS))
def test_a_save_refuses_a_stored_directory_that_is_a_link_and_touches_nothing_outside(
    tmp_path: Path, top: str, committed: bool
) -> None:
    path = tmp_path / "c"
    where = Location(path, _OPTIONS[top])
    if committed:
        _save(where)
        assert (path / top).is_dir()
        shutil.rmtree(path / top)
    else:
        path.mkdir()
    out = _outside(tmp_path)
    before = _snapshot(out)
    os.symlink(out, path / top)
    for save in (_save, lambda w, **k: pytreeckpt.async_save(w, _tree(1.0), chunking=TINY, **k).wait()):
        with pytest.raises(
            pytreeckpt.CheckpointError,
            match=rf"{re.escape(str(path / top))} is a symbolic link to "
            rf"{re.escape(str(out))}.*refused",
        ):
            save(where, overwrite=True)
        assert _snapshot(out) == before
        assert (path / top).is_symlink()  # the link is the user's to remove: the save left it as it was
    (path / top).unlink()
    _save(where, 2.0, overwrite=True)  # without the link the save goes ahead
    assert torch.equal(pytreeckpt.load(path)["w"], _tree(2.0)["w"])
    assert _snapshot(out) == before


@pytest.mark.parametrize("dangling", [True, False])
def test_a_lock_file_that_is_a_link_is_refused_not_followed(tmp_path: Path, dangling: bool) -> None:
    path = tmp_path / "c"
    _save(path)
    out = _outside(tmp_path)
    target = out / ("new.txt" if dangling else "notes.txt")
    before = _snapshot(out)
    (path / ".pytreeckpt.lock").unlink()
    os.symlink(target, path / ".pytreeckpt.lock")
    with pytest.raises(pytreeckpt.CheckpointError, match=r"\.pytreeckpt\.lock is a symbolic link.*refused"):
        _save(path, 1.0, overwrite=True)
    assert _snapshot(out) == before
    assert not (out / "new.txt").exists()
    assert torch.equal(pytreeckpt.load(path)["w"], _tree()["w"])  # the committed checkpoint stays as it was


@pytest.mark.parametrize(
    "leftover",
    [
        "arrays/old",  # a leftover array directory that is a link to a directory outside
        "arrays/w~g1",  # ... under the very name the save is about to write
        "packed/7",  # a leftover database
        "checksums/crc32c~g1",  # a leftover checksums file, a link to a file outside
        "arrays/w/c/1",  # a chunk file of the checkpoint being replaced
    ],
)
def test_links_left_in_a_checkpoint_are_removed_as_links_never_followed(tmp_path: Path, leftover: str) -> None:
    path = tmp_path / "c"
    where = Location(path, _OPTIONS["checksums"])
    _save(where)
    out = _outside(tmp_path)
    before = _snapshot(out)
    link = path / leftover
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists():
        link.unlink()
    os.symlink(out / "notes.txt" if leftover.count("/") > 1 or leftover.startswith("checksums") else out, link)
    _save(where, 3.0, overwrite=True)
    assert _snapshot(out) == before
    assert not link.is_symlink()  # gone, or made anew by the save (a name it writes)
    assert torch.equal(pytreeckpt.load(path)["w"], _tree(3.0)["w"])
    assert pytreeckpt.verify(path).ok


def test_the_writers_files_and_folders_are_made_without_following_links(tmp_path: Path) -> None:
    """Links appearing where a save is writing (after its checks): its own mkdir and open refuse them."""
    from pytreeckpt.storage._archive import ArchiveWriter
    from pytreeckpt.storage._chunkfiles import write_chunk

    path = tmp_path / "c"
    path.mkdir()
    out = _outside(tmp_path)
    before = _snapshot(out)
    os.symlink(out, path / "packed")
    writer = ArchiveWriter(path, "packed/0~g1")
    with pytest.raises(pytreeckpt.CheckpointError, match=r"packed is a symbolic link to .*outside.*refused"):
        writer.write("w/zarr.json", b"{}")
    (path / "packed").unlink()
    (path / "packed").mkdir()
    os.symlink(out / "sub", path / "packed" / "0~g1")
    with pytest.raises(pytreeckpt.CheckpointError, match=r"packed/0~g1 is a symbolic link to .*sub.*refused"):
        writer.write("w/zarr.json", b"{}")
    os.symlink(out / "notes.txt", path / "packed" / "0.zip")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        ArchiveWriter(path, "packed").write("w/zarr.json", b"{}")
    os.symlink(out / "notes.txt", path / "chunk")
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        write_chunk(path / "chunk", torch.arange(4.0).numpy(), (4,), fsync=False)
    assert _snapshot(out) == before


def test_a_save_over_a_document_that_is_a_fifo_does_not_wait_on_it(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _save(unpacked(path))
    (path / "pytreeckpt.json").unlink()
    os.mkfifo(path / "pytreeckpt.json")
    done = _run(f"pytreeckpt.save({str(path)!r}, {{'w': torch.ones(3)}}, overwrite=True); print('saved')")
    assert done.stdout.strip() == "saved", done.stderr
    assert torch.equal(pytreeckpt.load(path)["w"], torch.ones(3))


# --------------------------------------------------------------------------- hand-made tree structures


def _hand_made(path: Path, tree: Any, values: list[Any], keys: list[str] | None = None) -> Path:
    """A checkpoint of Python values only: a directory holding a document written by hand."""
    path.mkdir(parents=True, exist_ok=True)
    keys = keys if keys is not None else [f"v{i}" for i in range(len(values))]
    leaves = [{"kind": "value", "key": k, "value": v} for k, v in zip(keys, values, strict=True)]
    doc = {"format": "pytreeckpt", "version": 3, "tree": tree, "leaves": leaves, "user_metadata": {}}
    (path / "pytreeckpt.json").write_text(json.dumps(doc))
    return path


def _dict(keys: list[Any], children: list[Any]) -> dict[str, Any]:
    return {"k": "dict", "keys": keys, "c": children}


# (tree, the values it lists, what the MetadataError says)
MALFORMED_TREES = {
    "a namedtuple type that is not a string": (
        {"k": "namedtuple", "keys": ["a"], "type": 5, "c": [0]},
        [1],
        r"at the root: the namedtuple node's type must be a 'module:qualname' string, found int 5",
    ),
    "os:stat_result as a node of one field": (
        {"k": "custom", "keys": ["a"], "type": "os:stat_result", "metadata_json": None, "c": [0]},
        [1],
        r"at the root: a node of type os:stat_result has 10 fields, found 1 children",
    ),
    "os:stat_result as a node of 11 fields, one hidden": (
        {
            "k": "custom",
            "keys": [f"f{i}" for i in range(11)],
            "type": "os:stat_result",
            "metadata_json": None,
            "c": list(range(11)),
        },
        list(range(11)),
        r"os:stat_result has 10 fields, found 11 children",
    ),
    "deque maxlen -1": ({"k": "deque", "maxlen": -1, "c": [0]}, [1], r"maxlen of None or an integer from 1.*int -1"),
    "deque maxlen 10**30": (
        {"k": "deque", "maxlen": 10**30, "c": [0]},
        [1],
        r"maxlen of None or an integer from 1 to 9223372036854775807, found int 1000000000000000000000000000000",
    ),
    "deque maxlen 1 holding 3 leaves": (
        _dict(["q"], [{"k": "deque", "maxlen": 1, "c": [0, 1, 2]}]),
        [1, 2, 3],
        r"at key path 'q': a deque of 3 leaves or subtrees needs a maxlen of None or an integer from 3",
    ),
    "a dict key that is a list": (_dict([["x"]], [0]), [1], r"at the root: a dict node's malformed key list \['x'\]"),
    "a float key that is no number": (_dict([["f", "x"]], [0]), [1], r"malformed key list \['f', 'x'\]"),
    "a dict with a key twice": (
        _dict(["a", "b", "a"], [0, 1, 2]),
        [1, 2, 3],
        r"at the root: the dict node has the key 'a' twice",
    ),
    "keys 1 and True": (_dict([["i", 1], ["b", True]], [0, 1]), [1, 2], r"the dict node has the key True twice"),
    "keys 1 and 1.0": (
        _dict([["i", 1], ["f", "1.0"]], [0, 1]),
        [1, 2],
        r"the root: the dict node has the key 1\.0 twice",
    ),
    "keys 1.0 and 1.00": (
        _dict(["m"], [_dict([["f", "1.0"], ["f", "1.00"]], [0, 1])]),
        [1, 2],
        r"at key path 'm': the dict node has the key 1\.0 twice",
    ),
    "tuple keys (1,) and (True,)": (
        {"k": "odict", "keys": [["t", [["i", 1]]], ["t", [["b", True]]]], "c": [0, 1]},
        [1, 2],
        r"the odict node has the key \(True,\) twice",
    ),
    "a defaultdict with a key twice": (
        {"k": "defaultdict", "keys": ["a", "a"], "factory_name": "list", "c": [0, 1]},
        [1, 2],
        r"the defaultdict node has the key 'a' twice",
    ),
    "a dataclass rebuilt as a dict, a field twice": (
        {"k": "dataclass", "keys": ["a", "a"], "type": "nowhere:Config", "c": [0, 1]},
        [1, 2],
        r"the dataclass node has the key 'a' twice",
    ),
    "a custom node rebuilt as a dict, a key twice": (
        {"k": "custom", "keys": ["a", "a"], "type": "nowhere:Pair", "metadata_json": None, "c": [0, 1]},
        [1, 2],
        r"the custom node has the key 'a' twice",
    ),
    "a namedtuple field that is not a string": (
        _dict(["p"], [{"k": "namedtuple", "keys": [["i", 1]], "type": "nowhere:P", "c": [0]}]),
        [1],
        r"at key path 'p': a namedtuple node's keys are field names \(strings\), found int 1",
    ),
    "a namedtuple field twice": (
        {"k": "namedtuple", "keys": ["a", "a"], "type": "nowhere:P", "c": [0, 1]},
        [1, 2],
        r"the namedtuple node has the key 'a' twice",
    ),
    "keys that are not a list": ({"k": "dict", "keys": {"a": 0}, "c": [0]}, [1], r"needs a list of keys, found dict"),
    "a node kind that is a list": ({"k": ["dict"], "keys": [], "c": []}, [], r"unknown tree node kind list"),
}


def _fails_alike(path: Path, message: str) -> None:
    for op in (pytreeckpt.load, pytreeckpt.metadata, pytreeckpt.verify):
        with pytest.raises(pytreeckpt.MetadataError, match=message):
            op(path)


@pytest.mark.parametrize("case", list(MALFORMED_TREES))
def test_a_malformed_tree_structure_is_a_metadata_error_naming_its_path(tmp_path: Path, case: str) -> None:
    tree, values, message = MALFORMED_TREES[case]
    _fails_alike(_hand_made(tmp_path / "c", tree, values), message)


def test_the_command_line_reports_malformed_tree_structures_without_a_traceback(tmp_path: Path) -> None:
    """Every hand-made document through `inspect` and `verify` in one process whose stdout is a pipe."""
    paths = {case: str(_hand_made(tmp_path / str(i), *MALFORMED_TREES[case][:2])) for i, case in
             enumerate(MALFORMED_TREES)}  # fmt: skip
    done = _run(f"""
        from pytreeckpt import _cli
        for case, path in {paths!r}.items():
            for command in ("inspect", "verify"):
                try:
                    print(json.dumps([case, command, _cli.main([command, path])]), flush=True)
                except BaseException as e:
                    print(json.dumps([case, command, type(e).__name__]), flush=True)
    """)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(results) == 2 * len(MALFORMED_TREES)
    assert all(status == 2 for _, _, status in results), results  # exit status 2: a checkpoint error, said
    assert "Traceback" not in done.stderr
    for case, (_, _, message) in MALFORMED_TREES.items():
        assert len(re.findall(f"pytreeckpt (inspect|verify): tree structure .*{message}", done.stderr)) == 2, case


def _cli_run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The `pytreeckpt` command; its output decoded escaping what is not UTF-8."""
    environ = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    script = Path(sys.executable).parent / "pytreeckpt"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "pytreeckpt"]
    done = subprocess.run([*cmd, *args], capture_output=True, timeout=HANG, env=environ)
    out, err = (b.decode("utf-8", "backslashreplace") for b in (done.stdout, done.stderr))
    return subprocess.CompletedProcess(done.args, done.returncode, out, err)


def test_the_command_line_ends_a_malformed_tree_with_a_message(tmp_path: Path) -> None:
    path = _hand_made(tmp_path / "c", *MALFORMED_TREES["deque maxlen 1 holding 3 leaves"][:2])
    for command in ("inspect", "verify"):
        done = _cli_run(command, str(path))
        assert done.returncode == 2, done
        assert "Traceback" not in done.stderr
        assert f"pytreeckpt {command}: tree structure at key path 'q': a deque of 3 leaves" in done.stderr


@pytest.mark.parametrize("encoding", ["", "utf-8:strict"])
def test_inspect_prints_lone_surrogates_in_keys_escaped(tmp_path: Path, encoding: str) -> None:
    """Whether the output stream escapes surrogates (C.UTF-8) or refuses them (strict), they are printed escaped."""
    path = _hand_made(tmp_path / "c", _dict(["bad\udc80key"], [0]), [7], keys=["bad\udc80key"])
    assert pytreeckpt.metadata(path).tree == {"bad\udc80key": 7}
    done = _cli_run("inspect", str(path), PYTHONIOENCODING=encoding)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "bad\\udc80key" in done.stdout
    done = _cli_run("inspect", "--json", str(path), PYTHONIOENCODING=encoding)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["values"] == {"bad\udc80key": 7}


# Names a document may give an enum or a node type: submodules a module's lazy __getattr__ imports (torch's
# _dynamo and _inductor, 821 modules each), a deprecated name torch's __getattr__ computes by a call, and the
# spy module's lazy names, its metaclass's lazy names and its own types, whose hooks record every call.
NAMED = [
    "torch:_dynamo",
    "torch:_inductor",
    "torch:_inductor.config",
    "torch:onnx",
    "torch:has_cuda",
    "numpy:fft",
    "concurrent.futures:process",
    "pytreeckpt_spy:lazy",
    "pytreeckpt_spy:Lazy",
    "pytreeckpt_spy:Lazy.inner",
    "pytreeckpt_spy:Rec",
    "pytreeckpt_spy:Config",
    "pytreeckpt_spy:Level",
    "torch.nn.utils.rnn:PackedSequence",
]

SPY = """
import collections, concurrent.futures, dataclasses, enum, types
import numpy, torch.nn.utils.rnn
calls = []
spy = types.ModuleType("pytreeckpt_spy")
def _module_getattr(name):
    calls.append(f"module __getattr__ {name}")
    raise AttributeError(name)
class _Meta(type):
    def __getattr__(cls, name):
        calls.append(f"metaclass __getattr__ {name}")
        raise AttributeError(name)
class Lazy(metaclass=_Meta):
    pass
class Rec(collections.namedtuple("Rec", "a b")):
    def __new__(cls, *args):
        calls.append("Rec.__new__")
        return super().__new__(cls, *args)
@dataclasses.dataclass
class Config:
    a: int
    def __post_init__(self):
        calls.append("Config.__post_init__")
class Level(enum.IntEnum):
    LOW = 1
    @classmethod
    def _missing_(cls, value):
        calls.append(f"Level._missing_ {value}")
for t in (Lazy, Rec, Config, Level):
    t.__module__ = spy.__name__
    setattr(spy, t.__name__, t)
spy.__getattr__ = _module_getattr
sys.modules[spy.__name__] = spy
from pytreeckpt import _cli
"""


def _naming_documents(root: Path) -> list[str]:
    """Hand-made documents that name each of NAMED as an enum, a namedtuple, a dataclass and a custom node."""
    paths = [
        _hand_made(root / "enums", _dict(NAMED, list(range(len(NAMED)))), [{"enum": n, "value": 5} for n in NAMED])
    ]
    special = {"pytreeckpt_spy:Rec": ["a", "b"], "pytreeckpt_spy:Config": ["a"]}
    special["torch.nn.utils.rnn:PackedSequence"] = ["data", "batch_sizes", "sorted_indices", "unsorted_indices"]
    for kind in ("namedtuple", "dataclass", "custom"):
        children: list[Any] = []
        leaves = 0
        for name in NAMED:
            keys = special.get(name, ["a"])
            children.append({"k": kind, "keys": keys, "type": name, "metadata_json": None})
            children[-1]["c"] = list(range(leaves, leaves + len(keys)))
            leaves += len(keys)
        paths.append(_hand_made(root / kind, _dict(NAMED, children), list(range(leaves))))
    return [str(p) for p in paths]


def test_names_in_a_document_import_nothing_and_call_nothing(tmp_path: Path) -> None:
    """load, metadata, verify and `pytreeckpt inspect` of documents naming lazy attributes, types with hooks."""
    warm = _hand_made(tmp_path / "warm", _dict(["a"], [0]), [1])
    _save(tmp_path / "warm-arrays")
    done = _run(
        SPY
        + f"""
for path in ({str(warm)!r}, {str(tmp_path / "warm-arrays")!r}):  # (what the first load imports of pytreeckpt's own)
    pytreeckpt.load(path), pytreeckpt.metadata(path), pytreeckpt.verify(path), _cli.main(["inspect", path])
before = set(sys.modules)
out = {{}}
for path in {_naming_documents(tmp_path)!r}:
    got = {{}}
    for name, op in [("load", pytreeckpt.load), ("metadata", lambda p: pytreeckpt.metadata(p).tree),
                     ("verify", lambda p: pytreeckpt.verify(p).ok), ("inspect", lambda p: _cli.main(["inspect", p]))]:
        try:
            got[name] = repr(op(path))
        except pytreeckpt.CheckpointError as e:
            got[name] = type(e).__name__ + ": " + str(e)
    doc = path.rsplit("/", 1)[-1]
    out[doc] = got
    tree = pytreeckpt.metadata(path).tree
    out[doc + " types"] = {{k: f"{{type(v).__module__}}:{{type(v).__qualname__}}" for k, v in tree.items()}}
print("RESULT", json.dumps({{"new modules": sorted(set(sys.modules) - before), "calls": calls, "out": out}}))
"""
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["new modules"] == []
    assert result["calls"] == []
    out = result["out"]
    # Enums: none of these names is an enum imported here, and 5 is no member of Level: load refuses, naming each.
    for i, name in enumerate(NAMED):
        if name != "pytreeckpt_spy:Level":
            assert (
                f"leaf 'v{i}': the checkpoint holds a member of enum {name}, which is not an enum imported here"
                in (out["enums"]["load"])
            )
    assert "the value 5, which is not a member of enum pytreeckpt_spy:Level" in out["enums"]["load"]
    assert set(out["enums types"].values()) == {"pytreeckpt.core._values:StoredEnum"}
    # Node types: only the spy's namedtuple and dataclass and PackedSequence are reused (made without calling their
    # __new__ or __init__); every other name gives a namedtuple of pytreeckpt's own or a dict.
    reused = {"pytreeckpt_spy:Rec", "torch.nn.utils.rnn:PackedSequence"}
    assert {k for k, v in out["namedtuple types"].items() if k == v} == reused
    assert {k for k, v in out["dataclass types"].items() if k == v} == {"pytreeckpt_spy:Config"}
    assert set(out["dataclass types"].values()) == {"pytreeckpt_spy:Config", "builtins:dict"}
    assert set(out["custom types"].values()) == {"builtins:dict"}
    for kind in ("enums", "namedtuple", "dataclass", "custom"):
        assert out[kind]["verify"] == "True"
        assert out[kind]["inspect"] == "0"
    for kind in ("namedtuple", "dataclass", "custom"):
        assert out[kind]["load"] == out[kind]["metadata"]
