"""Programs that end with a save in flight, for tests/test_exit.py.

``python exit_workers.py fork DIR ROUNDS`` imports torch and pytreeckpt once, then forks
one child per (round, way of ending): each child starts an ``async_save`` and ends at
once (its script ends, ``sys.exit``, ``sys.exit`` in a thread, an uncaught exception, or
with ``exit_timeout=0``), or ends right after a load that failed on a damaged chunk
while other chunk reads were queued, going through the interpreter's whole
finalisation. The parent prints, as JSON, each child's exit status and its output. A child's last line of output
(from an ``atexit`` hook registered before pytreeckpt's own, so run after them) lists the
threads still alive while the interpreter finalises.

``torchrun ... exit_workers.py rank DIR WAY`` is one rank of a distributed program that
saves a DTensor state and ends (WAY: ``wait-destroy``, as examples/fsdp2_resume.py does,
or ``in-flight``: the save still running), with the same report.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from helpers import HANG

import pytreeckpt

WAYS = ["end", "sys.exit", "sys.exit in a thread", "exception", "exit_timeout=0", "load fails"]
STATUS = {"exception": 1}  # the exit status each way asks for; 0 otherwise


def state(seed: int, big: bool = False) -> dict[str, Any]:
    """Chunk files written by the I/O threads, small leaves packed and a compressed leaf (TensorStore), values."""
    g = torch.Generator().manual_seed(seed)
    rows = 8 * 1024 if big else 1024  # 32 MiB (32 chunk files, fsynced: still being written at exit) or 4 MiB
    return {
        "big": torch.randn(rows, 1024, generator=g),
        "small": {f"b{i}": torch.randn(16, generator=g) for i in range(8)},
        "z": torch.randn(256, 256, generator=g),
        "step": seed,
    }


COMPRESSION = {"big": None, "small": None, "z": "zstd", "step": None}
CHUNKING = pytreeckpt.ChunkingOptions(max_chunk_bytes=1 << 20)  # several chunk files, several I/O threads


def gloo_threads() -> list[str]:
    """The native threads of gloo process groups in this process (two workers and an event loop each)."""
    gc.collect()  # groups only a reference cycle keeps (DTensors, meshes) go first
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # ended meanwhile
            continue
    return sorted(n for n in names if n.startswith(("pt_gloo", "gloo_tcp")))


def report_threads_at_exit(gloo_before: list[str] | None = None) -> None:
    """Register a hook printing the threads alive once every later-registered hook (pytreeckpt's) has run.

    ``gloo_before``: the gloo threads before pytreeckpt made any process group.
    """

    def report() -> None:
        python = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        said = {"python": python, "gloo": gloo_threads(), "gloo_before": gloo_before or []}
        print("AT EXIT " + json.dumps(said), flush=True)

    atexit.register(report)


def _failed_load(path: Path, seed: int) -> None:
    """A load that fails on its first chunk while the reads of the others are queued behind it."""
    small = pytreeckpt.ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=1, max_chunk_bytes=1 << 16)
    pytreeckpt.save(path, {"w": state(seed)["big"]}, chunking=small)  # 64 chunk files
    for chunk in path.glob("arrays/*/c/*/*"):
        with chunk.open("r+b") as f:  # a bad checksum in every chunk
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    try:
        pytreeckpt.load(path, executor=pytreeckpt.ExecutorOptions(max_inflight_bytes=1 << 16))
    except pytreeckpt.CheckpointError as e:
        print(f"load failed: {e}", flush=True)


class _Told(logging.Filter):
    """Sets ``cancelled`` when the exit hook logs that it cancelled the save in flight (and lets the record by)."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = threading.Event()

    def filter(self, record: logging.LogRecord) -> bool:
        if "cancelled, nothing is committed" in record.getMessage():
            self.cancelled.set()
        return True


def _written_once_cancelled() -> None:
    """Each chunk file is written only once the exit hook has cancelled the save: the save is still running when
    the program ends, however fast the machine writes (a hang guard aside)."""
    from pytreeckpt.storage import _arrays

    told = _Told()
    logging.getLogger("pytreeckpt").addFilter(told)
    write_chunk = _arrays.write_chunk

    def held(*args: Any, **kwargs: Any) -> Any:
        told.cancelled.wait(HANG)
        return write_chunk(*args, **kwargs)

    _arrays.write_chunk = held


def _child(way: str, path: Path, seed: int) -> None:
    report_threads_at_exit()
    if way == "load fails":
        _failed_load(path, seed)
        return
    if way == "exit_timeout=0":
        _written_once_cancelled()
        opts = pytreeckpt.ExecutorOptions(exit_timeout=0.0)
        pytreeckpt.async_save(path, state(seed, big=True), executor=opts, chunking=CHUNKING)
        return
    pytreeckpt.async_save(path, state(seed), compression=COMPRESSION, chunking=CHUNKING)
    print("async_save returned", flush=True)
    if way == "sys.exit":
        sys.exit(0)
    if way == "sys.exit in a thread":
        t = threading.Thread(target=sys.exit, args=(0,))
        t.start()
        t.join()
    if way == "exception":
        raise RuntimeError("the training loop failed")


def fork_all(directory: Path, rounds: int) -> None:
    results = []
    for r in range(rounds):
        for k, way in enumerate(WAYS):
            path = directory / f"r{r}-{k}"
            log = directory / f"r{r}-{k}.log"
            seed = r * len(WAYS) + k
            pid = os.fork()
            if pid == 0:  # the child: its output to its log, then the save, then the end it was asked for
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                _child(way, path, seed)
                sys.exit(0)
            _, status = os.waitpid(pid, 0)
            results.append(
                {
                    "way": way,
                    "path": str(path),
                    "seed": seed,
                    "status": os.waitstatus_to_exitcode(status),
                    "output": log.read_text(),
                }
            )
    print(json.dumps(results))


def rank(directory: Path, way: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = state(7)
    tree = {
        "big": distribute_tensor(full["big"], mesh, [Shard(0)]),
        "small": {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in full["small"].items()},
        "z": distribute_tensor(full["z"], mesh, [Shard(1)]),
        "step": 7,
    }
    report_threads_at_exit(gloo_threads())  # torch's own groups, kept or not at exit as torch sees fit
    h = pytreeckpt.async_save(directory / "ckpt", tree, compression=COMPRESSION, chunking=CHUNKING)
    if way == "wait-destroy":
        h.wait()
        del tree, mesh
        dist.destroy_process_group()
    print("returned", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "fork":
        fork_all(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        rank(Path(sys.argv[2]), sys.argv[3])
