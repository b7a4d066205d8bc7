"""Run a function in several real processes joined by a gloo process group, or a script under torchrun.

Workers are module-level functions (the processes import them by name); each
returns a picklable result or raises. ``run_world`` returns the results by rank, or
raises with every failed rank's traceback. The processes fork from a server that
imported torch and pytreeckpt once, instead of importing them anew for every rank.
Each rank's stderr goes to a file of its own (with Python's fault handler on, so a
crash prints every thread's stack there); when
anything fails (a rank raises, dies, exits non-zero after answering, or does not answer)
the assertion message shows every rank's own stderr, labelled. ``run_torchrun`` does the
same for a script launched by torchrun.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import HANG

from benchmarks._common import free_port

STDERR_SHOWN = 20_000  # the last characters of each rank's stderr shown in a failure


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    args: tuple[Any, ...],
    out: Any,
    stderr: str,
    pg_timeout: float | None = None,
) -> None:
    fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)  # this rank's own stderr, native code's included
    os.close(fd)
    faulthandler.enable(all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        limit = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", **limit)
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        out.put((rank, True, _portable(result)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def _portable(x: Any) -> Any:
    """Tensors as numpy arrays: torch's queue pickling shares memory that dies with the child."""
    import torch

    if isinstance(x, torch.Tensor):
        return ("__tensor__", x.detach().cpu().clone().numpy())
    if isinstance(x, dict):
        return {k: _portable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_portable(v) for v in x)
    return x


def _restore(x: Any) -> Any:
    import torch

    if isinstance(x, tuple) and len(x) == 2 and x[0] == "__tensor__":
        return torch.from_numpy(x[1])
    if isinstance(x, dict):
        return {k: _restore(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_restore(v) for v in x)
    return x


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running (killed)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def rank_stderr(rank: int, path: Path, status: str = "") -> str:
    """One rank's stderr, labelled: the last ``STDERR_SHOWN`` characters of the file at ``path``."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        text = "(no stderr file)"
    if len(text) > STDERR_SHOWN:
        text = f"[... {len(text) - STDERR_SHOWN} characters before these; whole file: {path}]\n" + text[-STDERR_SHOWN:]
    label = f"rank {rank} ({status})" if status else f"rank {rank}"
    return f"===== {label}: its stderr =====\n{text.rstrip() or '(empty)'}"


def run_world(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = HANG,
    silent: tuple[int, ...] = (),
    pg_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; the results by rank.

    Every rank must answer within ``timeout`` seconds (a hang guard, helpers.HANG: never a measure of
    speed) and then exit with status 0; but the ranks ``silent``, which the test stops or kills on purpose:
    once every other rank has answered they are killed, and their result is None. ``pg_timeout``: the
    timeout of the process group the ranks make (torch's default if None).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "pytreeckpt"])
    out = ctx.Queue()
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="run_world-"))
    paths = [logs / f"rank{r}.stderr" for r in range(world)]
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, args, out, str(paths[r]), pg_timeout), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    dead_since: float | None = None
    try:
        while len(results) + len(failures) < world - len(silent) and time.monotonic() < deadline:
            try:
                rank, ok, value = out.get(timeout=0.2)
            except queue.Empty:
                # A rank that died without answering leaves the others waiting for it
                # (in a collective) until gloo's timeout: stop a few seconds after it died.
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode is not None and r not in results | failures and r not in silent
                ]
                if dead:
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > 5:
                        break
                continue
            (results if ok else failures)[rank] = value
        if len(results) + len(failures) == world - len(silent):  # every rank answered: each must now exit well
            for r in silent:
                if procs[r].exitcode is None:  # (stopped: a killed rank is gone already)
                    procs[r].kill()
            for p in procs:
                p.join(timeout=HANG)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]
    bad_exit = [r for r, c in enumerate(codes) if c != 0 and r not in silent]
    if failures or bad_exit or len(results) != world - len(silent):
        missing = sorted(set(range(world)) - set(results) - set(failures))
        tracebacks = "\n".join(f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(failures.items()))
        said = ["answered" if r in results else "raised" if r in failures else "no answer" for r in range(world)]
        stderrs = "\n".join(rank_stderr(r, paths[r], f"{said[r]}, {_exit_status(codes[r])}") for r in range(world))
        raise AssertionError(
            f"ranks failed: {sorted(failures)}; no answer from {missing}; exited badly: {bad_exit}; "
            f"stderr files in {logs}\n{tracebacks}\n{stderrs}"
        )
    shutil.rmtree(logs, ignore_errors=True)
    return [_restore(results[r]) if r in results else None for r in range(world)]


def run_torchrun(script: Path, nproc: int, *args: str, logs: Path, timeout: float = HANG) -> list[str]:
    """Run ``script *args`` under torchrun on ``nproc`` local ranks; each rank's stdout, by rank.

    Each rank's stdout and stderr go to files of their own under ``logs`` (torchrun's
    ``--log-dir`` with ``--redirects 3``), with Python's fault handler on. If torchrun
    fails or times out, the assertion message has the end of torchrun's stderr (its
    summary) and every rank's own stderr, labelled.
    """
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1", f"--master-port={free_port()}"),
        *(f"--nproc-per-node={nproc}", "--log-dir", str(logs), "--redirects", "3", str(script), *args),
    ]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            _, err = proc.communicate(timeout=timeout)
            status = _exit_status(proc.returncode)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its ranks (each in a session of its own) on SIGTERM
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            status = f"no exit within {timeout} s (terminated)"
    runs = sorted(logs.glob("*/attempt_*"))
    where = runs[-1] if runs else logs
    if proc.returncode != 0 or status.startswith("no exit"):
        stderrs = "\n".join(rank_stderr(r, where / str(r) / "stderr.log") for r in range(nproc))
        raise AssertionError(
            f"torchrun {script.name} {' '.join(args)} on {nproc} ranks: {status}; logs in {where}\n"
            f"--- torchrun's stderr (last 3000 characters) ---\n{err[-3000:]}\n{stderrs}"
        )
    return [(where / str(r) / "stdout.log").read_text() for r in range(nproc)]
