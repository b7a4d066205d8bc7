"""Every file and directory of a committed checkpoint has been fsynced before the call returns.

TensorStore's own per-file fsync is off (``file_io_sync``); the Storage syncs what it
wrote once the writes are done. These tests record every fsync and walk the checkpoint.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import pytreeckpt
from pytreeckpt.format import LOCK_FILE


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> set[tuple[int, int]]:
    """The (device, inode) of everything fsynced (a file synced under a temporary name is renamed)."""
    seen: set[tuple[int, int]] = set()
    lock = threading.Lock()
    real = os.fsync

    def recording(fd: int) -> None:
        real(fd)
        st = os.fstat(fd)
        with lock:
            seen.add((st.st_dev, st.st_ino))

    monkeypatch.setattr(os, "fsync", recording)
    return seen


def _unsynced(root: Path, fsynced: set[tuple[int, int]]) -> list[str]:
    paths = [str(root)]
    for dirpath, dirs, files in os.walk(root):
        paths += [os.path.join(dirpath, d) for d in dirs]
        paths += [os.path.join(dirpath, f) for f in files if f != LOCK_FILE]
    missing = []
    for p in paths:
        st = os.stat(p)
        if (st.st_dev, st.st_ino) not in fsynced:
            missing.append(p)
    return sorted(missing)


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(1024, 1024, generator=g),  # several chunks
        "matrix": torch.randn(300, 70, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),  # a 0-d array
        "small": [torch.randn(16, generator=g) for _ in range(20)],  # packed into the OCDBT database
        "step": 12,
    }


@pytest.mark.parametrize("how", ["save", "async_save", "compressed"])
def test_every_file_and_directory_is_fsynced_before_the_save_returns(
    tmp_path: Path, fsynced: set[tuple[int, int]], how: str
) -> None:
    path = tmp_path / "ckpt"
    big_chunks = pytreeckpt.ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=1 << 20)
    if how == "save":
        pytreeckpt.save(path, _state(), chunking=big_chunks)
    elif how == "async_save":
        pytreeckpt.async_save(path, _state(), chunking=big_chunks).wait()
    else:  # (compressed small arrays are packed in OCDBT, not in zip archives)
        ocdbt = pytreeckpt.Location(path, pytreeckpt.StorageOptions(pack_format="ocdbt"))
        pytreeckpt.save(ocdbt, _state(), chunking=big_chunks, compression="zstd")
    assert (path / ("ocdbt" if how == "compressed" else "packed")).is_dir()  # the packed leaves are covered too
    assert len([p for p in path.rglob("*") if p.parent.name.isdigit() and p.parent.parent.name == "c"]) >= 4
    missing = _unsynced(path, fsynced)
    assert not missing, missing


def test_hard_linked_chunks_of_an_incremental_save_are_durable(tmp_path: Path, fsynced: set[tuple[int, int]]) -> None:
    state = _state()
    pytreeckpt.save(tmp_path / "base", state, chunk_hashes=True)
    fsynced.clear()
    state["step"] = 13
    pytreeckpt.save(tmp_path / "next", state, base=tmp_path / "base")
    missing = _unsynced(tmp_path / "next", fsynced)
    assert not missing, missing
