"""CheckpointManager(save_on_signals=...): the step a preemption signal arrives at is saved on every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import manager_workers as mw
import pytest
import torch
from helpers import HANG
from multiproc import run_world

from pytreeckpt import CheckpointManager, TwoTierManager


def test_a_signal_saves_the_step_it_arrives_at_and_the_loop_stops(tmp_path: Path) -> None:
    chained: list[int] = []

    def mine(signum: int, frame: object) -> None:
        chained.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with CheckpointManager(tmp_path, save_interval_steps=10, save_on_signals=(signal.SIGTERM,)) as m:
            assert signal.getsignal(signal.SIGTERM) != mine
            stopped = None
            for step in range(1, 100):
                if step == 13:
                    os.kill(os.getpid(), signal.SIGTERM)  # the preemption notice, between steps
                m.save(step, {"w": torch.full((4,), float(step)), "step": step})
                if m.reached_preemption(step):
                    stopped = step
                    break
            assert stopped == 13
            assert m.preemption_step == 13
            assert m.all_steps() == [10, 13]  # committed when save returned: no wait needed
            assert m.restore()["step"] == 13
        assert chained == [signal.SIGTERM]  # the handler before it ran too
        assert signal.getsignal(signal.SIGTERM) == mine  # close put it back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_between_save_and_reached_preemption_saves_the_next_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, save_interval_steps=10, save_on_signals=(signal.SIGUSR1,)) as m:
        assert m.save(10, {"step": 10})
        assert not m.reached_preemption(10)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not m.reached_preemption(10)  # no step saved for it yet: the next save is
        assert m.save(11, {"step": 11})
        assert m.reached_preemption(11)
        assert m.all_steps() == [10, 11]
        assert not m.save(12, {"step": 12})  # the signal is spent: the intervals again
        assert m.reached_preemption(12)


def test_the_default_sigterm_action_does_not_kill_the_process_before_its_save(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, signal, sys, torch, pytreeckpt
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        with pytreeckpt.CheckpointManager(sys.argv[1], save_interval_steps=100, save_on_signals=(signal.SIGTERM,)) as m:
            for step in range(1, 50):
                if step == 7:
                    os.kill(os.getpid(), signal.SIGTERM)
                m.save(step, {"step": step})
                if m.reached_preemption(step):
                    print("stopped at", step, m.all_steps())
                    break
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=HANG
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "stopped at 7 [7]"


def test_without_signal_handling_a_manager_never_reaches_preemption(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as m:
        assert not m.reached_preemption(5)


def test_a_two_tier_manager_saves_the_preempted_step_to_the_durable_tier(tmp_path: Path) -> None:
    with TwoTierManager(
        tmp_path / "fast",
        tmp_path / "durable",
        fast_interval_steps=2,
        durable_interval_steps=100,
        save_on_signals=(signal.SIGUSR1,),
    ) as m:
        for step in range(1, 20):
            if step == 7:
                os.kill(os.getpid(), signal.SIGUSR1)
            m.save(step, {"step": step})
            if m.reached_preemption(step):
                break
        assert step == 7
        assert m.all_steps() == {"fast": [4, 6], "durable": [7]}
        assert m.restore()["step"] == 7


@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_a_signal_to_one_rank_saves_the_same_step_on_every_rank(tmp_path: Path, signalled_rank: int) -> None:
    results = run_world(2, mw.preempted_loop, str(tmp_path), signalled_rank, 17)
    for rank, r in enumerate(results):
        assert r["stopped"] == 17, results
        assert r["steps"] == [17], results
        assert r["chained"] == ([signal.SIGTERM] if rank == signalled_rank else []), results
        assert r["handler_restored"], results
    with CheckpointManager(tmp_path) as m:
        restored = m.restore()
    assert restored["step"] == 17
    assert torch.equal(restored["w"], torch.full((64,), 17.0))


def test_signals_need_the_main_thread(tmp_path: Path) -> None:
    import threading

    raised: list[BaseException] = []

    def make() -> None:
        try:
            CheckpointManager(tmp_path, save_on_signals=(signal.SIGTERM,))
        except ValueError as e:
            raised.append(e)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert raised
    assert "save_on_signals" in str(raised[0])
    assert isinstance(raised[0], ValueError)


def test_a_signal_sent_by_another_process_to_one_rank_stops_every_rank_at_the_same_saved_step(tmp_path: Path) -> None:
    results = run_world(2, mw.preempted_from_outside, str(tmp_path))
    stopped = results[0]["stopped"]
    assert stopped in (10, 11), results  # where rank 1's handler ran: at step 10's save, or just after it
    assert [r["stopped"] for r in results] == [stopped, stopped], results
    assert [r["steps"] for r in results] == [[stopped], [stopped]], results
    assert [r["signal"] for r in results] == [None, signal.SIGTERM], results
    with CheckpointManager(tmp_path) as m:
        assert torch.equal(m.restore()["w"], torch.full((64,), float(stopped)))
