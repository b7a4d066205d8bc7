"""Packed arrays in zip archives (``StorageOptions(pack_format="zip")``): stored form, readers, damage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
import torch
from helpers import HANG, document

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
    return document(path)


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

    monkeypatch.setattr(_archive, "MAX_ENTRIES", 7)  # a new archive every 7 keys, or for an array of more
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
            names = z.namelist()
            assert len(names) <= 7 or len({n.split("/")[1] for n in names}) == 1, names
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


def _flip_value_byte(archive: Path, key: str, at: int, mask: int) -> tuple[bytes, zipfile.ZipInfo]:
    """Flip ``mask``'s bits of byte ``at`` of entry ``key``'s value in ``archive``; returns the archive's bytes as
    they were, and the entry's directory record."""
    good = archive.read_bytes()
    with zipfile.ZipFile(archive) as z:
        info = z.getinfo(key)
    k = info.header_offset + 30 + len(info.filename) + at
    archive.write_bytes(good[:k] + bytes([good[k] ^ mask]) + good[k + 1 :])
    return good, info


def test_damaged_archives_are_refused_naming_the_leaf_or_the_archive(tmp_path: Path) -> None:
    path = tmp_path / "c"
    tree = {"a": torch.arange(8.0), "b": torch.ones(8)}
    pytreeckpt.save(Location(path, ZIP), tree)
    archive = path / "packed" / "0" / "0.zip"
    # A chunk's byte changed: its checksum says so, naming the leaf.
    good, _ = _flip_value_byte(archive, "arrays/b/c/0", 2, 0xFF)
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


def test_small_whole_arrays_are_read_without_a_plan_into_memory_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lean read of small one-chunk arrays (Storage.read_small) gives what the planned read gives."""
    from pytreeckpt.storage import Storage

    path = tmp_path / "c"
    g = torch.Generator().manual_seed(9)
    weight = torch.nn.Parameter(torch.randn(4, 4, generator=g))
    frozen = torch.nn.Parameter(torch.randn(3, generator=g), requires_grad=False)
    tree = {
        **_tree(),
        "c": torch.randn(3, dtype=torch.complex64, generator=g),
        "e": torch.ones(0, 3),  # zero size: nothing to read
        "p": weight,
        "q": frozen,
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
    }
    pytreeckpt.save(Location(path, ZIP), tree)
    leaned: list[str] = []
    original = Storage.read_small

    def read_small(self: Storage, metas: Any) -> list[bytes]:
        leaned.extend(m.key for m in metas)
        return original(self, metas)

    monkeypatch.setattr(Storage, "read_small", read_small)
    small = {"w", "h", "s", "b", "n", "c", "p", "q", "f8"}
    out = pytreeckpt.load(path)
    assert set(leaned) == small
    for k, v in tree.items():
        assert _equal(out[k], v.detach() if isinstance(v, torch.Tensor) else v), k
        assert type(out[k]) is (torch.Tensor if isinstance(v, torch.Tensor) else type(v)), k
    # Into a target of tensors: new tensors, a Parameter stays one (and keeps requires_grad).
    # A target of another dtype or shape is refused as before.
    leaned.clear()
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in tree.items()}
    target["p"], target["q"] = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(3), False)
    again = pytreeckpt.load(path, target)
    assert set(leaned) == small - {"n"}  # (a numpy target takes the planned read)
    assert type(again["p"]) is torch.nn.Parameter
    assert again["p"].requires_grad
    assert not again["q"].requires_grad
    assert torch.equal(again["p"].detach(), weight.detach())
    assert torch.equal(again["f8"].view(torch.uint8), tree["f8"].view(torch.uint8))
    assert again["w"] is not target["w"]
    assert not torch.equal(target["w"], tree["w"])
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"leaf 'w': the checkpoint has dtype float32"):
        pytreeckpt.load(path, {**target, "w": target["w"].double()})
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"leaf 'w': the checkpoint has shape \(37, 11\)"):
        pytreeckpt.load(path, {**target, "w": torch.zeros(11, 37)})
    # Each result owns its memory: growing one touches no other, and nothing holds the archive's map.
    pointers = {out[k].untyped_storage().data_ptr() for k in small if isinstance(out[k], torch.Tensor)}
    assert len(pointers) == len(small) - 1
    out["w"].resize_(1000)
    assert torch.equal(out["h"], tree["h"])
    # In place, through a device-less view, or resharded: the planned read, as before.
    leaned.clear()
    view_target = {"w": torch.zeros(11, 37).t()}
    assert torch.equal(pytreeckpt.load(path, view_target, inplace=True, strict=False)["w"], tree["w"])
    assert leaned == []


def test_a_damaged_small_array_read_without_a_plan_is_refused_naming_the_leaf(tmp_path: Path) -> None:
    path = tmp_path / "c"
    tree = {"a": torch.arange(8.0), "b": torch.ones(8)}
    pytreeckpt.save(Location(path, ZIP), tree)
    doc = _doc(path)
    good = json.dumps(doc)
    # The metadata's checksum of the chunk is not valid base64, or is another chunk's.
    for text, match in (("!!!!!!==", r"leaf 'b': chunk_crc32c is not valid base64"), (None, r"leaf 'b'.*metadata")):
        doc = json.loads(good)
        leaves = {leaf["key"]: leaf for leaf in doc["leaves"]}
        leaves["b"]["chunk_crc32c"] = text if text is not None else leaves["a"]["chunk_crc32c"]
        (path / "pytreeckpt.json").write_text(json.dumps(doc))
        for target in (None, {"a": torch.zeros(8), "b": torch.zeros(8)}):
            with pytest.raises((pytreeckpt.CheckpointError, pytreeckpt.MetadataError), match=match):
                pytreeckpt.load(path, target)
    (path / "pytreeckpt.json").write_text(good)
    assert torch.equal(pytreeckpt.load(path)["b"], tree["b"])


SRC = Path(pytreeckpt.__file__).parent.parent


def _child(code: str, timeout: float = HANG) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter; a process killed by a signal (SIGBUS) fails the test with its stderr."""
    environ = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=environ
    )
    assert done.returncode == 0, f"the child ended with {done.returncode} (a negative code is a signal):\n{done.stderr}"
    return done


def test_an_archive_cut_or_rewritten_while_loads_read_it_is_an_error_not_a_signal(tmp_path: Path) -> None:
    """``cp`` of a checkpoint over itself (the file cut to nothing, written again in part, then whole) between two
    reads of a load, a verify and a load_slice: each either gives the saved values or raises a CheckpointError
    (verify: reports damage); the process lives.

    Each step of the copy is made at a chosen read of the archive (before its Nth ``pread`` or change check,
    from the first to the last of them): every operation meets every step, whatever the machine's speed.
    """
    path = tmp_path / "c"
    g = torch.Generator().manual_seed(1)
    tree = {f"w{i}": torch.randn(50, generator=g) for i in range(300)}
    pytreeckpt.save(Location(path, ZIP), tree)
    torch.save(tree, tmp_path / "tree.pt")
    done = _child(f"""
        import json, os, torch, pytreeckpt
        from pytreeckpt.storage import _archive

        path, archive = {str(path)!r}, {str(path / "packed" / "0" / "0.zip")!r}
        tree = torch.load({str(tmp_path / "tree.pt")!r})
        good = open(archive, "rb").read()

        def copy(upto):  # as cp does: the file cut to nothing, then written again in place, up to byte `upto`
            fd = os.open(archive, os.O_WRONLY | os.O_TRUNC)
            for at in range(0, upto, 1 << 16):
                os.write(fd, good[at : min(at + (1 << 16), upto)])
            os.close(fd)

        steps = {{"cut": 0, "part": len(good) // 2, "whole": len(good)}}
        count, plan, met = [0], {{}}, []

        def hooked(real):  # a read of the archive that first makes the copy's step planned for it
            def read(self, *args):
                count[0] += 1
                step = plan.pop(count[0], None)
                if step is not None:
                    copy(steps[step])
                    met.append(step)
                return real(self, *args)
            return read

        for name in ("_pread", "check_unchanged"):
            setattr(_archive.ArchiveReader, name, hooked(getattr(_archive.ArchiveReader, name)))
        ops = {{
            "load": lambda: all(torch.equal(v, tree[k]) for k, v in pytreeckpt.load(path).items()),
            "load_slice": lambda: torch.equal(pytreeckpt.load_slice(path, "w7", slice(3, 9)), tree["w7"][3:9]),
            "verify": lambda: pytreeckpt.verify(path).ok or None,
        }}
        outcomes = {{}}
        for name, op in ops.items():
            copy(len(good))
            count[0] = 0
            assert op() is True, name  # the archive unchanged: the saved values
            reads = count[0]
            for at in sorted({{1, 2, 3, 4, reads // 3, reads // 2, reads - 1, reads}} - {{0}}):
                for step in steps:
                    copy(len(good))
                    count[0], plan[at], met[:] = 0, step, []
                    try:
                        got = op()
                    except pytreeckpt.CheckpointError:
                        got = "error"
                    else:
                        assert got in (True, None), got  # never other values
                        got = "values" if got else "error"
                    assert met == [step], (name, at, step, met)  # the copy's step was made between two reads
                    outcomes.setdefault(f"{{name}} {{step}}", {{}}).setdefault(got, 0)
                    outcomes[f"{{name}} {{step}}"][got] += 1
        print(json.dumps(outcomes))
    """)
    outcomes = json.loads(done.stdout)
    ops, steps = ("load", "load_slice", "verify"), ("cut", "part", "whole")
    assert sorted(outcomes) == sorted(f"{op} {step}" for op in ops for step in steps)
    for key, seen in outcomes.items():
        if key.endswith("whole"):  # the same bytes again: the saved values, or the change noticed
            assert set(seen) <= {"values", "error"}, (key, seen)
        else:  # read from an archive cut short: never values
            assert set(seen) == {"error"}, (key, seen)


@pytest.mark.parametrize("how", ["save", "async_save"])
def test_every_entry_of_a_leaf_is_in_the_archive_that_holds_its_zarr_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Leaves of one chunk (2 entries) and of two chunks (3 entries) across many full archives: TensorStore's
    zip kvstore, given the archive holding a leaf's zarr.json, reads the saved values (not zeros)."""
    from pytreeckpt.storage import _archive

    monkeypatch.setattr(_archive, "MAX_ENTRIES", 7)  # (the rollover of 65,000 entries, sooner)
    g = torch.Generator().manual_seed(4)
    tree = {f"a{i}": torch.randn(8, generator=g) for i in range(40)}  # 32 bytes: one chunk
    tree |= {f"b{i}": torch.randn(2, 8, generator=g) for i in range(40)}  # 64 bytes: two chunks of 32
    tree |= {f"c{i}": torch.randn(8, generator=g) + 1 for i in range(40)}
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=32, min_chunk_bytes=32, max_chunk_bytes=32)
    path = tmp_path / "c"
    if how == "save":
        pytreeckpt.save(Location(path, ZIP), tree, chunking=chunking)
    else:
        pytreeckpt.async_save(Location(path, ZIP), tree, chunking=chunking).wait()
    leaves = {leaf["key"]: leaf for leaf in _doc(path)["leaves"]}
    assert leaves["b0"]["chunk_shape"] == [1, 8]
    folder = path / "packed" / "0"
    holder: dict[str, str] = {}
    entries: dict[str, set[str]] = {}
    for name in sorted(os.listdir(folder)):
        with zipfile.ZipFile(folder / name) as z:
            for entry in z.namelist():
                array = entry.split("/")[1]
                entries.setdefault(array, set()).add(name)
                if entry.endswith("/zarr.json"):
                    holder[array] = name
    assert len(holder) == len(tree)
    assert {k: v for k, v in entries.items() if len(v) > 1} == {}  # no leaf split across archives
    for key, value in tree.items():
        kv = {"driver": "zip", "base": f"file://{folder / holder[key]}"}
        stored = ts.open({"driver": "zarr3", "kvstore": kv, "path": leaves[key]["path"] + "/"}).result()
        assert np.array_equal(stored.read().result(), value.numpy()), key
    got = pytreeckpt.load(path)
    assert all(torch.equal(got[k], v) for k, v in tree.items())


class _CountingIndex(dict):  # type: ignore[type-arg]
    """An archive reader's index that counts the passes made over it."""

    passes = 0

    def __iter__(self) -> Any:
        type(self).passes += 1
        return super().__iter__()


@pytest.mark.parametrize("arrays", [3, 30])
def test_the_chunks_of_every_packed_array_are_counted_in_one_pass_over_the_archives(
    tmp_path: Path, arrays: int
) -> None:
    """Checking each multi-chunk packed array's chunk count looked at every entry of the archives once per array
    (a load of N such arrays cost N x entries); now one pass serves them all, and arrays named ``c`` count right."""
    from pytreeckpt.storage._archive import ArchiveReader, ArchiveWriter

    writer = ArchiveWriter(tmp_path, "packed/0")
    names = ["c", "c~g1", *(f"w{i}" for i in range(arrays - 2))]
    for k, name in enumerate(names):
        entries = [(f"arrays/{name}/zarr.json", b"{}")]
        entries += [(f"arrays/{name}/c/{i}", bytes(8)) for i in range(k % 4 + 1)]
        writer.write_many(entries)
    writer.finish()
    reader = ArchiveReader(tmp_path / "packed" / "0", "packed/0")
    reader.chunk_entries("arrays/none")  # (the archives are read)
    _CountingIndex.passes = 0
    reader._index = _CountingIndex(reader._index)
    reader._chunks = None
    got = [reader.chunk_entries(f"arrays/{name}") for name in names]
    assert got == [k % 4 + 1 for k in range(len(names))]
    assert _CountingIndex.passes == 1


def test_an_array_of_several_packed_chunks_is_read_in_one_read_each_chunk_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 44 item 6: a load of many multi-chunk packed arrays read each chunk entry on its own (a read and an
    fstat per chunk); an array's chunks follow one another in its archive and are read together, and each one is
    still checked: a damaged chunk and an entry whose header names another are refused naming the leaf."""
    from pytreeckpt.storage._archive import ArchiveReader

    g = torch.Generator().manual_seed(11)
    tree = {f"w{i}": torch.randn(96, generator=g) for i in range(40)}  # 384 bytes: 3 chunks of 128
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=128, min_chunk_bytes=128, max_chunk_bytes=128)
    path = tmp_path / "c"
    pytreeckpt.save(Location(path, ZIP), tree, chunking=chunking)
    assert _doc(path)["leaves"][0]["chunk_shape"] == [32]
    reads = []
    real = ArchiveReader._pread

    def counted(self: ArchiveReader, at: int, size: int, offset: int) -> bytes:
        reads.append(size)
        return real(self, at, size, offset)

    monkeypatch.setattr(ArchiveReader, "_pread", counted)
    got = pytreeckpt.load(path)
    assert all(torch.equal(got[k], v) for k, v in tree.items())
    chunks = [r for r in reads if 3 * 132 < r < 3 * 200]  # (a chunk: 128 bytes, its crc, its header)
    assert len(chunks) == len(tree), reads  # (the rest: each array's zarr.json, the archives' directories)
    archive = path / "packed" / "0" / "0.zip"
    good, info = _flip_value_byte(archive, "arrays/w7/c/1", 5, 0x10)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w7': chunk \[1\].*damaged"):
        pytreeckpt.load(path)
    # The second chunk's header names the third (the directory still says the second is there).
    name = info.header_offset + 30
    archive.write_bytes(good[:name] + b"arrays/w7/c/2" + good[name + len(info.filename) :])
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w7'.*'arrays/w7/c/1'.*header does not name it"):
        pytreeckpt.load(path)
    archive.write_bytes(good)
    assert torch.equal(pytreeckpt.load(path)["w7"], tree["w7"])
