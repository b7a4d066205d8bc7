"""CheckpointManager: only the names it writes are steps; anything else in its directory is left alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import pytreeckpt
from pytreeckpt import CheckpointManager
from pytreeckpt.manager import _manager
from pytreeckpt.storage import Storage


def state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


FOREIGN = [
    "step_0999",  # a leading zero: 999 to `\d+`, a newer step than any saved here
    "step_007",
    "step_05",
    "step_00",
    "step_\u0663",  # an Arabic-Indic three: 3 to `\d+`
    "step_\uff15",  # a fullwidth five
    "step_5\n",  # `$` matches before a final newline
    "step_-1",
    "step_+5",
    "step_1.tmp",
    "step_5 ",
    "Step_5",
    "step_",
]


@pytest.mark.parametrize("name", FOREIGN)
def test_a_foreign_name_is_no_step_of_the_manager_and_stays_untouched(tmp_path: Path, name: str) -> None:
    foreign = tmp_path / name
    pytreeckpt.save(foreign, {"mine": torch.arange(3.0)})  # someone else's committed checkpoint, beside the steps
    before = sorted(os.listdir(foreign))
    with CheckpointManager(tmp_path, max_to_keep=1) as m:
        for step in (1, 3, 5):
            m.save(step, state(step))
        m.wait()
        assert m.all_steps() == [5]
        assert m.restore()["step"] == 5
        assert m.last_restored_step == 5
    assert sorted(os.listdir(tmp_path)) == sorted([name, "step_5"])
    assert torch.equal(pytreeckpt.load(foreign)["mine"], torch.arange(3.0))
    assert sorted(os.listdir(foreign)) == before


@pytest.mark.parametrize("name", ["step_0999", "step_\u0663", "step_5\n"])
def test_on_an_object_store_too_a_foreign_prefix_is_no_step(tmp_path: Path, name: str) -> None:
    directory = f"memory://{tmp_path.name}/run"
    pytreeckpt.save(f"{directory}/{name}", {"mine": torch.arange(3.0)})
    with CheckpointManager(directory, max_to_keep=1) as m:
        for step in (1, 3, 5):
            m.save(step, state(step))
        m.wait()
        assert m.all_steps() == [5]
        assert m.restore()["step"] == 5
    assert torch.equal(pytreeckpt.load(f"{directory}/{name}")["mine"], torch.arange(3.0))


def test_only_the_name_the_manager_writes_reads_as_its_step() -> None:
    assert [_manager.step_of(f"step_{n}") for n in (0, 1, 10, 999, 10**30)] == [0, 1, 10, 999, 10**30]
    assert [_manager.step_of(name) for name in FOREIGN] == [None] * len(FOREIGN)
    assert _manager.step_of("step_" + "1" * 5000) is None  # (more digits than int() takes: no step, no error)


def test_an_uncommitted_directory_of_a_step_name_holding_other_files_is_left_alone(tmp_path: Path) -> None:
    foreign = tmp_path / "step_7"  # not a crashed save's: it holds a file no save writes
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    crashed = tmp_path / "step_2"  # a crashed save's leftovers: removed as before
    (crashed / "arrays" / "w").mkdir(parents=True)
    with CheckpointManager(tmp_path, max_to_keep=1) as m:
        assert not crashed.exists()
        for step in (1, 3, 9):
            m.save(step, state(step))
        m.wait()
        assert m.all_steps() == [9]
        with pytest.raises(pytreeckpt.CheckpointError, match=r"step_7 is not empty and is not a pytreeckpt"):
            m.save(7, state(7))
    assert sorted(os.listdir(tmp_path)) == ["step_7", "step_9"]
    assert os.listdir(foreign) == ["notes.txt"]
    assert (foreign / "notes.txt").read_text() == "mine"


def test_on_an_object_store_an_uncommitted_prefix_holding_other_keys_is_left_alone(tmp_path: Path) -> None:
    directory = f"memory://{tmp_path.name}/run"
    kv = Storage(directory).kv
    assert kv is not None
    kv.write("step_2/notes.txt", b"mine")  # older than the newest commit, but not a crashed save's
    kv.write("step_3/arrays/w/zarr.json", b"{}")  # a crashed save's: removed as before
    with CheckpointManager(directory, max_to_keep=1) as m:
        for step in (4, 5):
            m.save(step, state(step))
        m.wait()
        assert m.all_steps() == [5]
    assert kv.read("step_2/notes.txt") == b"mine"
    assert kv.list("step_3/") == []


def test_a_file_of_a_step_name_is_no_step_and_that_step_is_refused_with_it_kept(tmp_path: Path) -> None:
    (tmp_path / "step_8").write_text("mine")
    with CheckpointManager(tmp_path, max_to_keep=1) as m:
        for step in (1, 3):
            m.save(step, state(step))
        with pytest.raises(pytreeckpt.CheckpointError, match=r"step_8 is not a directory, not a step this manager"):
            m.save(8, state(8), force=True)
        m.wait()
        assert m.all_steps() == [3]
    assert (tmp_path / "step_8").read_text() == "mine"


@pytest.mark.parametrize("committed", [True, False])
def test_a_link_of_a_step_name_is_no_step_and_nothing_is_written_or_deleted_through_it(
    tmp_path: Path, committed: bool
) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    if committed:
        pytreeckpt.save(elsewhere, {"mine": torch.arange(3.0)})
    else:
        elsewhere.mkdir()  # an empty directory: what a crashed save may look like
    before = sorted(os.listdir(elsewhere))
    run.mkdir()
    (run / "step_5").symlink_to(elsewhere, target_is_directory=True)
    with CheckpointManager(run, max_to_keep=1) as m:
        for step in (1, 3):
            m.save(step, state(step))
        m.wait()
        assert m.all_steps() == [3]
        assert m.restore()["step"] == 3
        with pytest.raises(pytreeckpt.CheckpointError, match=r"step_5 is a symbolic link, not a step this manager"):
            m.save(5, state(5), force=True)
        with pytest.raises(pytreeckpt.NotCommittedError, match=r"step_5 is a symbolic link, .* not restored from it"):
            m.restore(5)
    with CheckpointManager(run, max_to_keep=1) as m:  # (a new manager cleans up nothing through it either)
        m.save(6, state(6))
    assert (run / "step_5").is_symlink()
    assert sorted(os.listdir(elsewhere)) == before  # no lock, no array, nothing removed
    if committed:
        assert torch.equal(pytreeckpt.load(elsewhere)["mine"], torch.arange(3.0))
