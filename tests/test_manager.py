"""CheckpointManager: steps, retention, crashes, several ranks."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import dist_workers as w
import numpy as np
import pytest
import torch
from helpers import HANG, killed_after_step
from multiproc import run_world

import pytreeckpt
from pytreeckpt import CheckpointManager
from pytreeckpt.storage import Storage


def state(step: int) -> dict:
    return {"w": torch.full((4, 4), float(step)), "step": step}


@pytest.mark.parametrize("async_", [True, False])
def test_retention_keeps_the_newest_and_every_nth(tmp_path: Path, async_: bool) -> None:
    with CheckpointManager(tmp_path, max_to_keep=3, keep_every_n_steps=5, async_=async_) as m:
        for step in range(1, 21):
            assert m.save(step, state(step))
        m.wait()
        assert m.all_steps() == [5, 10, 15, 18, 19, 20]
        assert m.latest_step() == 20
        assert m.restore()["step"] == 20
        assert torch.equal(m.restore(10)["w"], torch.full((4, 4), 10.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"step_{s}" for s in (5, 10, 15, 18, 19, 20))


def test_save_interval_and_force(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path, save_interval_steps=4)
    saved = [step for step in range(1, 13) if m.save(step, state(step))]
    assert saved == [4, 8, 12]
    assert m.save(7, state(7), force=True)
    m.wait()
    assert m.all_steps() == [4, 7, 8, 12]
    with pytest.raises(pytreeckpt.CheckpointError, match="step 8 is already saved"):
        m.save(8, state(80))
    m.save(8, state(80), force=True)
    assert m.restore(8)["step"] == 80
    m.close()
    with pytest.raises(pytreeckpt.CheckpointError, match="closed"):
        m.save(16, state(16))


def test_restore_after_a_crash_skips_and_cleans_the_uncommitted_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        m.save(1, state(1))
        m.save(2, state(2))
    crashed = tmp_path / "step_3"  # a save killed before its commit
    (crashed / "arrays" / "w").mkdir(parents=True)
    (crashed / "arrays" / "w" / "zarr.json").write_text("{}")
    busy = tmp_path / "step_4"  # another process is writing this one right now
    busy.mkdir()
    lock = Storage(busy).lock()
    try:
        m = CheckpointManager(tmp_path)
        assert m.all_steps() == [1, 2]
        assert m.restore()["step"] == 2
        assert not crashed.exists()  # cleaned
        assert busy.exists()  # left to its writer
    finally:
        lock.release()
    m.delete(1)
    assert m.all_steps() == [2]
    with pytest.raises(pytreeckpt.NotCommittedError):
        m.restore(1)
    with pytest.raises(pytreeckpt.NotCommittedError):
        m.delete(1)


def run_without_write_access(directory: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (``sys.argv[1]``: ``directory``) in a process that can read ``directory`` but not write to it.

    Through a read-only bind mount of it; where mounting is not permitted, as user ``nobody`` over a
    copy it can read (root), or over the directory made read-only (another user).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = [sys.executable, "-c", code]
    view = directory.with_name(directory.name + "-read-only")
    view.mkdir()
    if subprocess.run(["mount", "--bind", str(directory), str(view)], capture_output=True).returncode == 0:
        try:
            ro = subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True, text=True)
            assert ro.returncode == 0, ro.stderr
            return subprocess.run([*run, str(view)], capture_output=True, text=True, env=env, timeout=HANG)
        finally:
            subprocess.run(["umount", str(view)], check=True)
    if os.geteuid() != 0:
        for d, _, files in os.walk(directory):
            for name in [d, *(os.path.join(d, f) for f in files)]:
                os.chmod(name, os.stat(name).st_mode & ~0o222)
        return subprocess.run([*run, str(directory)], capture_output=True, text=True, env=env, timeout=HANG)
    nobody = pwd.getpwnam("nobody")

    def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*run[:1], *args],
            capture_output=True,
            text=True,
            env={**env, "HOME": "/"},
            timeout=HANG,
            preexec_fn=lambda: (os.setgid(nobody.pw_gid), os.setuid(nobody.pw_uid)),
        )

    try:
        probe = as_nobody("-c", "import pytreeckpt")
    except PermissionError as e:
        pytest.skip(f"neither a read-only mount nor user nobody running {sys.executable} is possible here: {e}")
    if probe.returncode != 0:
        pytest.skip(f"neither a read-only mount nor user nobody importing pytreeckpt is possible here: {probe.stderr}")
    outside = Path(tempfile.mkdtemp())  # (under /tmp: nobody can reach it, unlike pytest's 0700 tmp_path)
    try:
        outside.chmod(0o755)
        shutil.copytree(directory, outside / "run")
        return as_nobody(*run[1:], str(outside / "run"))
    finally:
        shutil.rmtree(outside)


def test_a_restore_needs_no_write_access_even_beside_an_uncommitted_step(tmp_path: Path) -> None:
    """A manager made over a directory it may only read lists and restores; the crashed step stays for a save."""
    run = tmp_path / "run"
    with CheckpointManager(run, async_=False) as m:
        m.save(1, state(1))
        m.save(2, state(2))
    crashed = run / "step_3"  # a save killed before its commit
    (crashed / "arrays" / "w").mkdir(parents=True)
    (crashed / "arrays" / "w" / "zarr.json").write_text("{}")
    removing = run / ".pytreeckpt-removing-step_0-0123456789ab"  # a removal killed midway
    (removing / "arrays").mkdir(parents=True)
    code = (
        "import sys, pytreeckpt\n"
        "m = pytreeckpt.CheckpointManager(sys.argv[1])\n"
        "print(m.all_steps(), m.restore()['step'], m.restore(1)['step'], m.latest_step())\n"
    )
    done = run_without_write_access(run, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[1, 2] 2 1 2"
    assert crashed.exists()  # left for the next save to remove
    assert removing.exists()
    with CheckpointManager(run, async_=False) as m:
        m.save(4, state(4))
    assert not crashed.exists()
    assert not removing.exists()


def test_an_empty_directory_has_no_latest_step(tmp_path: Path) -> None:
    m = CheckpointManager(tmp_path / "new")
    assert m.latest_step() is None
    with pytest.raises(pytreeckpt.NotCommittedError, match="no committed checkpoint"):
        m.restore()


def test_two_ranks_agree_on_steps(tmp_path: Path) -> None:
    results = run_world(2, w.manager_steps, str(tmp_path))
    assert results[0] == results[1]
    assert results[0]["steps"] == [3, 4]
    assert results[0]["restored"] == 4.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]


def test_the_manager_example_killed_and_resumed_gives_identical_losses(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    example = Path(__file__).parent.parent / "examples" / "train_with_manager.py"

    def losses(text: str) -> dict[int, str]:
        return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+) loss (\S+)", text)}

    base = [sys.executable, str(example), "--steps", "30", "--every", "5"]
    reference = subprocess.run([*base, "--dir", str(tmp_path / "ref")], capture_output=True, text=True, timeout=HANG)
    assert reference.returncode == 0, reference.stderr
    want = losses(reference.stdout)
    assert sorted(want) == list(range(1, 31))

    run = tmp_path / "run"
    killed_after_step([*base, "--dir", str(run)], 18)  # killed mid-run, between checkpoints
    resumed = subprocess.run([*base, "--dir", str(run)], capture_output=True, text=True, timeout=HANG)
    assert resumed.returncode == 0, resumed.stderr
    restart = int(re.search(r"resumed from step (\d+)", resumed.stdout).group(1))  # type: ignore[union-attr]
    assert restart in (10, 15)
    got = losses(resumed.stdout)
    assert sorted(got) == list(range(restart + 1, 31))
    assert {s: want[s] for s in got} == got  # bit-identical losses after the resume


@pytest.mark.parametrize("step", [-1, True, "3", 2.0, None, np.int64(-2), torch.tensor(3)])
def test_a_step_that_is_not_a_non_negative_integer_is_refused(tmp_path: Path, step: object) -> None:
    with CheckpointManager(tmp_path, async_=False) as m:
        m.save(1, state(1))
        for call in (
            lambda: m.save(step, state(2)),  # type: ignore[arg-type]
            lambda: m.delete(step),  # type: ignore[arg-type]
            lambda: m.metadata_of(step),  # type: ignore[arg-type]
            lambda: m.step_path(step),  # type: ignore[arg-type]
        ):
            with pytest.raises(pytreeckpt.CheckpointError, match=r"a step is a non-negative integer, found"):
                call()
        if step is not None:  # restore(None) is the newest step
            with pytest.raises(pytreeckpt.CheckpointError, match=r"a step is a non-negative integer, found"):
                m.restore(step)  # type: ignore[arg-type]
        assert m.all_steps() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_numpy_integer_steps_are_steps(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_=False) as m:
        assert m.save(np.int64(3), state(3))
        assert m.all_steps() == [3]
        assert m.restore(np.int32(3))["step"] == 3
        m.delete(np.uint8(3))
        assert m.all_steps() == []


def test_a_two_tier_manager_refuses_such_steps_too(tmp_path: Path) -> None:
    with pytreeckpt.TwoTierManager(
        tmp_path / "fast", tmp_path / "durable", fast_interval_steps=1, durable_interval_steps=2
    ) as m:
        for step in (-1, "3"):
            with pytest.raises(pytreeckpt.CheckpointError, match=r"a step is a non-negative integer"):
                m.save(step, state(1))  # type: ignore[arg-type]
            with pytest.raises(pytreeckpt.CheckpointError, match=r"a step is a non-negative integer"):
                m.restore(step)  # type: ignore[arg-type]


@pytest.mark.parametrize("where", ["local", "memory"])
def test_loading_a_manager_directory_says_which_steps_it_holds(tmp_path: Path, where: str) -> None:
    directory = str(tmp_path / "ckpt") if where == "local" else f"memory://{tmp_path.name}/ckpt"
    with CheckpointManager(directory) as m:
        m.save(1, state(1))
        m.save(2, state(2))
    with pytest.raises(pytreeckpt.NotCommittedError) as raised:
        pytreeckpt.load(directory)
    message = str(raised.value)
    assert "is a CheckpointManager directory" in message
    assert "steps [1, 2]" in message
    assert f"pytreeckpt.load('{directory}/step_2')" in message
    assert f"pytreeckpt.CheckpointManager('{directory}').restore()" in message
    assert "interrupted" not in message
    with pytest.raises(pytreeckpt.NotCommittedError, match=r"CheckpointManager directory"):
        pytreeckpt.metadata(directory)
