"""The commit protocol: file modes."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pytreeckpt

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
    assert "run/step_1/ocdbt" in modes[oct(0o777 & ~umask)]
