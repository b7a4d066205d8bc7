"""CheckpointManager.restore falls back past damaged steps; restore(step=N) stays strict."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import manager_workers as mw
import pytest
import torch
from multiproc import run_world

import pytreeckpt
from pytreeckpt import CheckpointDamageWarning, CheckpointManager, TwoTierManager


def state(step: int) -> dict:
    return {"w": torch.full((1024, 512), float(step)), "b": torch.arange(8) + step, "step": step}


def flip_a_chunk(step_dir: Path) -> None:
    chunk = next(p for p in sorted((step_dir / "arrays").rglob("*")) if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))


def delete_a_chunk(step_dir: Path) -> None:
    next(p for p in sorted((step_dir / "arrays").rglob("*")) if p.is_file() and p.name != "zarr.json").unlink()


def truncate_metadata(step_dir: Path) -> None:
    meta = step_dir / "pytreeckpt.json"
    meta.write_bytes(meta.read_bytes()[:100])


def garble_an_array_document(step_dir: Path) -> None:
    next((step_dir / "arrays").rglob("zarr.json")).write_text('{"zarr_format": 3, "node_')


def damage_the_packed_archive(step_dir: Path) -> None:
    archive = next((step_dir / "packed").rglob("*.zip"))
    data = bytearray(archive.read_bytes())
    data[100] ^= 0xFF
    archive.write_bytes(bytes(data))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "checksum": flip_a_chunk,
    "missing chunk": delete_a_chunk,
    "truncated metadata": truncate_metadata,
    "unreadable array document": garble_an_array_document,
    "damaged archive": damage_the_packed_archive,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_restore_falls_back_to_the_newest_step_that_loads(tmp_path: Path, damage: str) -> None:
    with CheckpointManager(tmp_path, async_=False) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
    DAMAGE[damage](tmp_path / "step_3")
    with CheckpointManager(tmp_path) as m:
        assert m.latest_step() == 3  # newest committed, damaged or not
        with pytest.warns(CheckpointDamageWarning, match=r"step 3 of .* does not load; falling back") as caught:
            restored = m.restore()
        assert len(caught) == 1
        assert caught[0].filename == __file__  # the warning points at the restore() call
        assert restored["step"] == 2
        assert torch.equal(restored["w"], torch.full((1024, 512), 2.0))
        assert m.last_restored_step == 2
        with pytest.raises(pytreeckpt.CheckpointError):
            m.restore(3)  # strict
        assert m.last_restored_step == 2
        assert m.restore(1)["step"] == 1
        assert m.last_restored_step == 1


def test_the_warning_names_the_damage_and_every_step_damaged_is_skipped(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_=False) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
    flip_a_chunk(tmp_path / "step_3")
    delete_a_chunk(tmp_path / "step_2")
    with CheckpointManager(tmp_path) as m, pytest.warns(CheckpointDamageWarning) as caught:
        assert m.restore()["step"] == 1
    messages = [str(w.message) for w in caught]
    assert "step 3" in messages[0]
    assert "fails its checksum" in messages[0]
    assert "step 2" in messages[1]
    assert "holds only 0 bytes of chunks" in messages[1]
    flip_a_chunk(tmp_path / "step_1")
    with (
        CheckpointManager(tmp_path) as m,
        pytest.warns(CheckpointDamageWarning),
        pytest.raises(pytreeckpt.NotCommittedError, match=r"steps that did not load: step 3 .*step 2 .*step 1 "),
    ):
        m.restore()


def test_a_target_mismatch_is_the_callers_and_raises(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_=False) as m:
        for step in (1, 2):
            m.save(step, state(step))
        wrong = {"w": torch.zeros(3, 3), "b": torch.zeros(8, dtype=torch.int64), "step": 0}
        with pytest.raises(pytreeckpt.TargetMismatchError):
            m.restore(target=wrong)  # no fall back to step 1: it would mismatch as well


@pytest.fixture
def shm() -> Iterator[Path]:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    path = root / f"pytreeckpt-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_two_tier_restore_falls_back_through_the_fast_tier_to_the_durable_one(tmp_path: Path, shm: Path) -> None:
    opts = {"fast_interval_steps": 2, "durable_interval_steps": 5, "async_": False}
    with TwoTierManager(shm, tmp_path, **opts) as m:
        for step in range(1, 9):
            m.save(step, state(step))
        assert m.all_steps() == {"fast": [6, 8], "durable": [5]}
    flip_a_chunk(shm / "step_8")
    with TwoTierManager(shm, tmp_path, **opts) as m:
        with pytest.warns(CheckpointDamageWarning, match="step 8"):
            assert m.restore()["step"] == 6
        assert (m.last_restored_step, m.last_restored_tier) == (6, "fast")
    truncate_metadata(shm / "step_6")
    with TwoTierManager(shm, tmp_path, **opts) as m:
        with pytest.warns(CheckpointDamageWarning) as caught:
            assert m.restore()["step"] == 5
        assert [str(w.message).split(" of ")[0] for w in caught] == ["step 8", "step 6"]
        assert (m.last_restored_step, m.last_restored_tier) == (5, "durable")
        with pytest.raises(pytreeckpt.CheckpointError):
            m.restore(8)


def test_every_rank_falls_back_to_the_same_step(tmp_path: Path) -> None:
    """Two gloo ranks; the newest step's chunk, read by one rank only, is damaged: both restore step 2."""
    run_world(2, mw.save_steps, str(tmp_path), 3)
    flip_a_chunk(tmp_path / "step_3")
    results = run_world(2, mw.restore_newest, str(tmp_path))
    for r in results:
        assert r["step"] == 2, results
        assert r["last_restored_step"] == 2, results
        assert r["w"] == 2.0
        assert len(r["warnings"]) == 1, results
        assert "step 3" in r["warnings"][0], results
