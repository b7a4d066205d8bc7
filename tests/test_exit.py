"""Programs that end while a save (or chunk I/O) is in flight: they finish it or commit nothing, and never abort.

The children are real interpreters ending every way a training script does (see
tests/exit_workers.py); each reports the threads still alive while it finalises: no
pytreeckpt thread (I/O, fsync, writer) and no gloo thread of pytreeckpt's process
groups may be left then, where the interpreter's teardown would race them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import exit_workers as w
import pytest
import torch
from helpers import HANG
from multiproc import run_torchrun

import pytreeckpt

WORKERS = Path(__file__).parent / "exit_workers.py"
ROUNDS = 3


def _at_exit(output: str) -> dict[str, Any]:
    lines = [line for line in output.splitlines() if line.startswith("AT EXIT ")]
    assert len(lines) == 1, output
    return dict(json.loads(lines[0].removeprefix("AT EXIT ")))


def _assert_committed_whole(path: Path, seed: int) -> None:
    got = pytreeckpt.load(path)
    want = w.state(seed)
    assert got["step"] == want["step"]
    for key in ("big", "z"):
        assert torch.equal(got[key], want[key]), key
    for key, v in want["small"].items():
        assert torch.equal(got["small"][key], v), key


def test_a_program_ending_with_a_save_in_flight_finishes_it_or_commits_nothing_and_exits_cleanly(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, str(WORKERS), "fork", str(tmp_path), str(ROUNDS)],
        capture_output=True,
        text=True,
        timeout=HANG,  # about 10 s of CPU: the children share one import of torch
    )
    assert done.returncode == 0, done.stderr
    children = json.loads(done.stdout)
    assert len(children) == ROUNDS * len(w.WAYS)
    cancelled = 0
    for child in children:
        way, output, path = child["way"], child["output"], Path(child["path"])
        where = f"{way!r} ({path.name}):\n{output}"
        assert child["status"] == w.STATUS.get(way, 0), where  # never a signal (SIGABRT is -6)
        assert "Fatal Python error" not in output, where
        left = _at_exit(output)
        assert not [t for t in left["python"] if t.startswith("pytreeckpt")], where
        if way == "load fails":  # the reads queued behind the failed one did not outlive it
            assert "load failed: " in output, where
            assert "is damaged" in output, where
            assert "Traceback" not in output, where
        elif way != "exit_timeout=0":  # the save finished before the interpreter finalised
            _assert_committed_whole(path, child["seed"])
        else:  # its chunk files are written only once the exit hook has given up on it (exit_workers)
            assert "cancelled, nothing is committed" in output, where
            cancelled += 1
            with pytest.raises(pytreeckpt.NotCommittedError):
                pytreeckpt.metadata(path)
    assert cancelled == ROUNDS  # the cancellation was exercised


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("way", ["wait-destroy", "in-flight"])
def test_ranks_ending_after_a_distributed_save_leave_no_checkpoint_group_behind(tmp_path: Path, way: str) -> None:
    outputs = run_torchrun(WORKERS, 2, "rank", str(tmp_path), way, logs=tmp_path / "logs")
    for r, out in enumerate(outputs):
        left = _at_exit(out)
        assert not [t for t in left["python"] if t.startswith("pytreeckpt")], (r, out)
        # pytreeckpt's two gloo groups are gone: only threads of torch's own groups may be left
        assert len(left["gloo"]) <= len(left["gloo_before"]), (r, out)
    _assert_committed_whole(tmp_path / "ckpt", 7)
