"""The commit protocol: replacing a checkpoint beside the old one, file modes, loads that lose a race."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from crash_workers import replace_distributed
from helpers import document, unpacked
from multiproc import run_world

import pytreeckpt
from pytreeckpt import Location, StorageOptions
from pytreeckpt.format import parse_document
from pytreeckpt.loading import _run as _load
from pytreeckpt.saving import _job as _save
from pytreeckpt.storage import Storage


def doc(path: Path) -> dict:
    return json.loads((path / "pytreeckpt.json").read_bytes())


def stored(path: Path) -> list[str]:
    tops = ("arrays", "ocdbt", "packed")
    return sorted(f"{top}/{p.name}" for top in tops if (path / top).is_dir() for p in (path / top).iterdir())


def tree(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "W": torch.randn(8, generator=g), "step": seed}


def test_a_replacement_is_written_beside_the_old_checkpoint_under_new_names(tmp_path: Path) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), tree(1))
    assert stored(path) == ["arrays/W~1", "arrays/w"]  # the first save keeps plain names
    seen_during_write: list[list[str]] = []
    real_write = _save.write_arrays

    def write(self: Storage, *args: object, **kwargs: object) -> int:
        n = real_write(self, *args, **kwargs)  # type: ignore[arg-type]
        seen_during_write.append(stored(path))
        assert pytreeckpt.load(path)["step"] == 1  # the old checkpoint, still whole, until the commit
        return n

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_save, "write_arrays", write)
        pytreeckpt.save(unpacked(path), tree(2), overwrite=True)
    assert seen_during_write == [["arrays/W~1", "arrays/W~1~g1", "arrays/w", "arrays/w~g1"]]
    assert stored(path) == ["arrays/W~1~g1", "arrays/w~g1"]  # the old arrays went after the commit
    assert [leaf.get("path") for leaf in doc(path)["leaves"]] == ["arrays/w~g1", "arrays/W~1~g1", None]
    got = pytreeckpt.load(path)
    assert got["step"] == 2
    assert torch.equal(got["w"], tree(2)["w"])
    pytreeckpt.async_save(unpacked(path), tree(3), overwrite=True).wait()
    assert stored(path) == ["arrays/W~1~g2", "arrays/w~g2"]
    assert pytreeckpt.verify(path).ok


def test_packed_arrays_are_replaced_with_their_database(tmp_path: Path) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(path, tree(1))
    assert stored(path) == ["packed/0"]
    pytreeckpt.save(path, tree(2), overwrite=True)
    assert stored(path) == ["packed/0~g1"]
    assert {leaf.get("database") for leaf in doc(path)["leaves"]} == {"packed/0~g1", None}
    assert {leaf.get("path") for leaf in doc(path)["leaves"]} == {"arrays/w", "arrays/W~1", None}  # inside it
    assert torch.equal(pytreeckpt.load(path)["W"], tree(2)["W"])
    assert pytreeckpt.verify(path).ok
    ocdbt = Location(path, StorageOptions(pack_format="ocdbt"))  # OCDBT databases replace and are replaced alike
    pytreeckpt.save(ocdbt, tree(3), overwrite=True)
    assert stored(path) == ["ocdbt/0~g2"]
    pytreeckpt.save(path, tree(4), overwrite=True)
    assert stored(path) == ["packed/0~g3"]
    assert torch.equal(pytreeckpt.load(path)["W"], tree(4)["W"])
    assert pytreeckpt.verify(path).ok


def test_a_replacement_can_link_the_chunks_of_the_checkpoint_it_replaces(tmp_path: Path) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), tree(1), chunk_hashes=True)
    pytreeckpt.save(unpacked(path), tree(1), overwrite=True, base=path)  # it was deleted first, before
    assert stored(path) == ["arrays/W~1~g1", "arrays/w~g1"]
    assert torch.equal(pytreeckpt.load(path)["w"], tree(1)["w"])


def test_generation_names_pass_the_path_checks_and_others_do_not() -> None:
    def leaf(**kw: object) -> bytes:
        array = {"kind": "array", "key": "w", "container": "torch", "dtype": "float32", "storage_dtype": "float32"}
        array |= {"shape": [2], "chunk_shape": [2], "path": "arrays/w", "layout": None, **kw}
        return json.dumps({"format": "pytreeckpt", "version": 2, "tree": 0, "leaves": [array]}).encode()

    assert parse_document(leaf(path="arrays/w~1~g12")).leaves[0].path == "arrays/w~1~g12"  # type: ignore[union-attr]
    assert parse_document(leaf(database="ocdbt/3~g2")).leaves[0].database == "ocdbt/3~g2"  # type: ignore[union-attr]
    for database in ("ocdbt/3~g0", "ocdbt/3~g", "ocdbt/3~x1", "ocdbt/3/~g1", "ocdbt/~g1"):
        with pytest.raises(pytreeckpt.MetadataError, match="database must be"):
            parse_document(leaf(database=database))


def test_a_save_that_fails_removes_what_it_wrote_and_keeps_what_it_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(self: object, *args: object, **kwargs: object) -> int:
        raise pytreeckpt.CheckpointError("the disk is on fire")

    path = tmp_path / "c"
    new = {"w": torch.ones(64, 32), "W": torch.ones(8), "step": 2}
    pytreeckpt.save(unpacked(path), tree(1))
    real = Storage.sync
    monkeypatch.setattr(Storage, "sync", fail)  # after every array is written, before the commit
    for call in (pytreeckpt.save, lambda *a, **k: pytreeckpt.async_save(*a, **k).wait()):
        with pytest.raises(pytreeckpt.CheckpointError, match="on fire"):
            call(unpacked(path), new, overwrite=True)
        assert stored(path) == ["arrays/W~1", "arrays/w"]
        assert pytreeckpt.load(path)["step"] == 1
        with pytest.raises(pytreeckpt.CheckpointError, match="on fire"):
            call(unpacked(tmp_path / "fresh"), new)
        assert not (tmp_path / "fresh").exists()  # a directory the save made goes with it
    monkeypatch.setattr(Storage, "sync", real)
    (tmp_path / "mine").mkdir()  # a directory the user made stays, empty
    monkeypatch.setattr(Storage, "sync", fail)
    with pytest.raises(pytreeckpt.CheckpointError, match="on fire"):
        pytreeckpt.save(unpacked(tmp_path / "mine"), new)
    assert os.listdir(tmp_path / "mine") == []


# --------------------------------------------------------------------------- file modes


@pytest.fixture(params=[0o022, 0o027, 0o002], ids=lambda u: f"umask{u:03o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_files_and_directories_get_the_modes_the_umask_gives(tmp_path: Path, umask: int) -> None:
    """Like any file the user makes, so that others may load a checkpoint on a shared file system."""
    big = pytreeckpt.ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=1 << 16)
    state = {"big": torch.randn(256, 256), "small": torch.ones(3), "z": torch.zeros(64, 64), "step": 1}
    pytreeckpt.save(
        tmp_path / "c", state, chunking=big, compression={"big": None, "small": None, "z": "zstd", "step": None}
    )
    pytreeckpt.async_save(tmp_path / "c", state, overwrite=True).wait()
    with pytreeckpt.CheckpointManager(tmp_path / "run") as m:
        m.save(1, state)
    modes: dict[str, set[str]] = {}
    for dirpath, dirs, files in os.walk(tmp_path):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            modes.setdefault(oct(stat.S_IMODE(os.lstat(p).st_mode)), set()).add(os.path.relpath(p, tmp_path))
    want = {oct(0o777 & ~umask), oct(0o666 & ~umask)}
    assert set(modes) == want, {m: sorted(ps)[:5] for m, ps in modes.items() if m not in want}
    assert "c/pytreeckpt.json" in modes[oct(0o666 & ~umask)]
    assert "run/step_1/packed" in modes[oct(0o777 & ~umask)]
    assert "run/step_1/packed/0/0.zip" in modes[oct(0o666 & ~umask)]


# --------------------------------------------------------------------------- loads losing a race


def _replace_during_the_first_read(monkeypatch: pytest.MonkeyPatch, replace: object) -> list[int]:
    """Run ``replace()`` (another process, as it were) when the load starts reading arrays; the reads counted."""
    real = _load.read_arrays
    calls: list[int] = []

    def read(self: Storage, *args: object, **kwargs: object) -> int:
        calls.append(1)
        if len(calls) == 1:
            replace()  # type: ignore[operator]
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_load, "read_arrays", read)
    return calls


def test_a_load_whose_checkpoint_is_replaced_meanwhile_loads_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), tree(1))
    calls = _replace_during_the_first_read(
        monkeypatch, lambda: pytreeckpt.save(unpacked(path), tree(2), overwrite=True)
    )
    got = pytreeckpt.load(path)
    assert len(calls) == 2  # the first load found the old arrays gone, and started again
    assert got["step"] == 2
    assert torch.equal(got["w"], tree(2)["w"])


def test_a_load_whose_checkpoint_is_removed_meanwhile_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), tree(1))
    _replace_during_the_first_read(monkeypatch, lambda: Storage(path).remove())
    with pytest.raises(pytreeckpt.NotCommittedError, match="removed while it was being loaded"):
        pytreeckpt.load(path)


def test_a_load_replaced_again_and_again_gives_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), tree(1))
    real = _load.read_arrays
    seed = [1]

    def read(self: Storage, *args: object, **kwargs: object) -> int:
        seed[0] = 3 - seed[0]
        pytreeckpt.save(unpacked(path), tree(seed[0]), overwrite=True)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_load, "read_arrays", read)
    with pytest.raises(pytreeckpt.NotCommittedError, match="was replaced 4 times while it was being loaded"):
        pytreeckpt.load(path)


def test_a_damaged_checkpoint_is_not_taken_for_a_replaced_one(tmp_path: Path) -> None:
    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), tree(1))
    (path / "arrays" / "w" / "c" / "0" / "0").unlink()
    with pytest.raises(pytreeckpt.CheckpointError, match="holds only 0 bytes") as raised:
        pytreeckpt.load(path)
    assert not isinstance(raised.value, pytreeckpt.NotCommittedError)


# --------------------------------------------------------------------------- the writer's lock


def test_a_lock_whose_directory_its_holder_removed_is_taken_anew(tmp_path: Path) -> None:
    path = tmp_path / "c"
    held = Storage(path).lock()
    assert Storage(path).try_lock() is None  # held
    os.rename(path, tmp_path / "gone")  # as a CheckpointManager removing it does, under the lock
    held.release()
    assert Storage(path).try_lock() is None  # no directory: nothing to lock
    again = Storage(path).lock()  # makes the directory anew
    assert (path / ".pytreeckpt.lock").is_file()
    again.release()


def test_a_distributed_save_replaces_a_checkpoint_beside_it(tmp_path: Path) -> None:
    results = run_world(2, replace_distributed, str(tmp_path / "c"))
    assert results[0] == results[1]
    got = results[0]
    assert got["first"] == ["arrays/big", "packed/0", "packed/1"]
    assert got["second"] == ["arrays/big~g1", "packed/0~g1", "packed/1~g1"]
    assert got["step"] == 2
    assert got["whole"]


def test_a_distributed_save_writes_and_replaces_its_checksums_file(tmp_path: Path) -> None:
    """Rank 0 writes the file of every rank's chunk checksums at the commit; the next save's replaces it."""
    results = run_world(2, replace_distributed, str(tmp_path / "c"), True)
    assert results[0] == results[1]
    got = results[0]
    assert got["first"] == ["arrays/big", "checksums/crc32c", "packed/0", "packed/1"]
    assert got["second"] == ["arrays/big~g1", "checksums/crc32c~g1", "packed/0~g1", "packed/1~g1"]
    assert got["step"] == 2
    assert got["whole"]


# --------------------------------------------------------------------------- leftovers of a crash


def test_a_leftover_temporary_directory_is_removed_not_a_block(tmp_path: Path) -> None:
    """A ``.tmp-*`` name is the commit's own (a half-written document a killed save left); whatever is
    there, a directory tree or a link, goes as such, and nothing a link leads to is touched."""
    path, outside = tmp_path / "c", tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("my notes")
    pytreeckpt.save(unpacked(path), tree(1))
    (path / ".tmp-123-dir" / "sub").mkdir(parents=True)
    (path / ".tmp-123-dir" / "sub" / "half").write_bytes(b"{")
    os.symlink(outside, path / ".tmp-123-dir" / "link")
    os.symlink(outside, path / ".tmp-456-link")
    pytreeckpt.save(unpacked(path), tree(2), overwrite=True)
    assert sorted(p.name for p in path.iterdir()) == [".pytreeckpt.lock", "arrays", "pytreeckpt.json"]
    assert pytreeckpt.load(path)["step"] == 2
    assert [p.name for p in outside.iterdir()] == ["notes.txt"]
    assert (outside / "notes.txt").read_text() == "my notes"
    pytreeckpt.save(unpacked(tmp_path / "d"), tree(3))
    (tmp_path / "d" / ".tmp-1").mkdir()
    pytreeckpt.save(unpacked(tmp_path / "d"), tree(4), overwrite=True)
    assert pytreeckpt.load(tmp_path / "d")["step"] == 4


# --------------------------------------------------------------------------- generations


LAST = 999_999_999  # the largest generation a stored name may have (9 digits)


def _at_generation(path: Path, generation: int) -> None:
    """Rename a committed checkpoint's arrays, databases and checksums file to ``generation``'s names, by hand,
    and its document with them."""
    d = document(path)  # (without its own checksum, which the renaming makes stale)
    renamed: dict[str, str] = {}
    for leaf in d["leaves"]:
        for field in ("path", "database") if leaf.get("database") is None else ("database",):
            if isinstance(leaf.get(field), str):
                renamed[leaf[field]] = leaf[field] = f"{leaf[field]}~g{generation}"
    if "checksums" in d:
        renamed[d["checksums"]["path"]] = d["checksums"]["path"] = f"{d['checksums']['path']}~g{generation}"
    for old, new in renamed.items():
        os.rename(path / old, path / new)
    (path / "pytreeckpt.json").write_text(json.dumps(d))


@pytest.mark.parametrize("pack_format", ["zip", "ocdbt"])
def test_a_checkpoint_at_the_last_generation_is_replaced_by_one_its_reader_accepts(
    tmp_path: Path, pack_format: str
) -> None:
    path = tmp_path / "c"
    where = Location(path, StorageOptions(pack_format=pack_format, pack_max_bytes=64, max_inline_checksum_bytes=0))
    pytreeckpt.save(where, tree(1))
    _at_generation(path, LAST)
    top = "packed" if pack_format == "zip" else "ocdbt"
    assert stored(path) == [f"arrays/w~g{LAST}", f"{top}/0~g{LAST}"]
    assert pytreeckpt.load(path)["step"] == 1  # the renamed checkpoint is whole
    pytreeckpt.save(where, tree(2), overwrite=True)
    got = pytreeckpt.load(path)
    assert stored(path) == ["arrays/w~g1", f"{top}/0~g1"]  # back to the smallest generation free
    assert sorted(os.listdir(path / "checksums")) == ["crc32c~g1"]
    assert got["step"] == 2
    assert torch.equal(got["w"], tree(2)["w"])
    assert torch.equal(got["W"], tree(2)["W"])
    assert pytreeckpt.verify(path).ok
    pytreeckpt.save(where, tree(3), overwrite=True)  # and on from there
    assert stored(path) == ["arrays/w~g2", f"{top}/0~g2"]
    assert pytreeckpt.load(path)["step"] == 3


def test_a_listing_that_lags_behind_the_store_never_names_new_arrays_as_the_committed_ones(tmp_path, monkeypatch):
    """An object store's listing may not show yet what was just written (SeaweedFS under load): a save that
    replaces a checkpoint names its arrays after the committed document's too, never writing over them, so the
    checkpoint before stays whole if the new one never commits."""
    import pytreeckpt
    from pytreeckpt.storage._objects import ObjectPrefix

    loc = "memory://lagging/run"
    pytreeckpt.save(loc, {"w": torch.full((64, 64), 1.0)})
    monkeypatch.setattr(ObjectPrefix, "stored_names", lambda self, refuse_links: set())  # (it lags: sees nothing)
    writes: list[str] = []
    document = ObjectPrefix.write_document

    def failing_commit(self, body, tail):
        writes.append("commit")
        raise OSError("the commit never lands")

    monkeypatch.setattr(ObjectPrefix, "write_document", failing_commit)
    with pytest.raises((OSError, pytreeckpt.CheckpointError)):
        pytreeckpt.save(loc, {"w": torch.full((64, 64), 2.0)}, overwrite=True)
    monkeypatch.setattr(ObjectPrefix, "write_document", document)
    assert writes == ["commit"]
    assert torch.equal(pytreeckpt.load(loc)["w"], torch.full((64, 64), 1.0))
