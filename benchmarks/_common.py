"""What every benchmark shares: states, timing, the page cache, and the physical limits."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import pytreeckpt

GiB = 1 << 30
MiB = 1 << 20


def make_state(nbytes: int, leaves: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 and bfloat16 matrices (alternating) of ``nbytes`` in all: random, since this
    machine's storage is faster on zeros than on real data."""
    g = torch.Generator().manual_seed(seed)
    per = nbytes // leaves
    out = {}
    for i in range(leaves):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        cols = 1024
        rows = per // (cols * (4 if dtype == torch.float32 else 2))
        out[f"layer{i}.weight"] = torch.randn(rows, cols, generator=g).to(dtype)
    return out


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


_PORTS_FROM = 10_000
_next_port: list[int] = []


def _ephemeral_start() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default range starts at 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous or a test's server.

    Not one the kernel picks (``bind`` to port 0): the kernel hands ports of that range to
    every outgoing connection too (a gloo rank opens dozens), so with tests running side by
    side (pytest-xdist) another test's connection could take the port before this test's
    ranks bind it. Ports come instead from below that range, from this pytest-xdist
    worker's own share of it (a worker's child processes inherit its name), each tried
    before it is handed out.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    lo, hi = _PORTS_FROM, min(_ephemeral_start(), 65536)
    share = (hi - lo) // max(workers, 1)
    first = lo + share * (int(worker) if worker.isdigit() else 0)
    if not _next_port:  # (a process starts at a place of its own in the share: a test's child allocates too)
        _next_port.append(random.Random(os.getpid()).randrange(share))
    for _ in range(share):
        port = first + _next_port[0] % share
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or lingering after a test before
        return port
    raise OSError(f"no free TCP port in {first}-{first + share - 1}")


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[Any]:
    """This process as rank ``rank`` of a gloo group of ``world`` ranks meeting at 127.0.0.1:``port``
    (the tools' warnings silenced), yielding a 1-D CPU device mesh over the group; the group is
    destroyed on the way out."""
    warnings.filterwarnings("ignore")
    # (every rank on this machine, as torchrun says with LOCAL_WORLD_SIZE: they share its disk)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


_DROP = Path("/proc/sys/vm/drop_caches")


def drop_caches() -> bool:
    """Empty the page cache (needs root); False where the machine does not allow it."""
    subprocess.run(["sync"], check=False)
    try:
        _DROP.write_text("3\n")
        return True
    except OSError:
        return False


def can_drop_caches() -> bool:
    return drop_caches()


def timed(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, ``setup`` run untimed before each."""
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


Timer = Callable[[Callable[[], Any], int, Callable[[], Any] | None], float]


def alternating(
    runs: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]], repeat: int, timer: Timer = timed
) -> dict[str, float]:
    """Median seconds of each ``(fn, setup)``, every one taking its turn in every round.

    This machine's speed drifts (up to 2x between minutes) and its virtual disk caches
    what was written lately; measured in turns, each of those weighs on every
    contender alike instead of favouring whichever ran at the better moment.
    """
    return {name: statistics.median(t) for name, t in rounds(runs, repeat, timer).items()}


def rounds(
    runs: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]], repeat: int, timer: Timer = timed
) -> dict[str, list[float]]:
    """The seconds of each ``(fn, setup)`` in each of ``repeat`` rounds, every one taking its turn in every round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeat):
        # In a new order each round (seeded): what one tool leaves behind, such as the
        # virtual disk still flushing its writes, does not always fall on the same next one.
        # (A rotation would not do: every tool would still follow the same one.)
        names = list(runs)
        random.Random(r).shuffle(names)
        for name in names:
            fn, setup = runs[name]
            times[name].append(timer(fn, 1, setup))
    return times


def spawn_ranks(worker: Callable[..., None], ranks: int, workdir: Path, args: dict[str, Any]) -> Any:
    """Run ``worker(rank, ranks, port, args)`` on ``ranks`` spawned processes; what rank 0 wrote to
    ``workdir/times.json`` (``args["out"]`` names it), and ``workdir`` removed."""
    import torch.multiprocessing as mp

    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "times.json"
    try:
        mp.start_processes(
            worker, args=(ranks, free_port(), {**args, "out": str(out)}), nprocs=ranks, start_method="spawn"
        )
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def round_ratios(top: list[float], bottom: list[float]) -> list[float]:
    """Each round's ``top / bottom``, for two timings taken in the same rounds: each ratio compares
    times taken at one machine speed (their median is what a target takes; the ratio of the
    medians would pair a fast moment's time with a slow one's)."""
    return [t / b for t, b in zip(top, bottom, strict=True)]


def growth_rounds(paths: dict[str, Path], save: Callable[[str], Any], repeat: int, cold: bool) -> dict[str, Any]:
    """pytreeckpt's saves (``save(name)`` writes to ``paths[name]``) and loads of two states, ``"small"`` and
    ``"big"``, alternated in the same rounds: how its time grows with the state, without the machine's drift
    between two runs (minutes apart, this machine's speed can differ by 2x). Each state's first save in the
    process is untimed (a job's later saves are timed); the loads are cold where ``cold``. The last saves stay
    in ``paths`` for the caller to look at and remove. The growth is the median of each round's big over its
    small (timed a second apart)."""
    for name in paths:
        fresh(paths[name])()
        save(name)
    times = rounds({f"{name} save": (lambda name=name: save(name), fresh(paths[name])) for name in paths}, repeat)
    for name in paths:
        fresh(paths[name])()
        save(name)
    setup = drop_caches if cold else None
    loads = {f"{name} load": (lambda name=name: pytreeckpt.load(paths[name]), setup) for name in paths}
    times.update(rounds(loads, repeat))
    ratios = {op: round_ratios(times[f"big {op}"], times[f"small {op}"]) for op in ("save", "load")}
    return {
        "seconds": {name: statistics.median(t) for name, t in times.items()},
        "growth": {op: statistics.median(r) for op, r in ratios.items()},
        "ratios": ratios,
        "rounds": times,
    }


def alternating_loads(
    runs: dict[str, Callable[[], Any]], repeat: int, cold: bool, drop: Callable[[], Any], timer: Timer = timed
) -> dict[str, float]:
    """Each load's median seconds, in turns: from a cold page cache (``drop`` before each,
    when ``cold``) as ``"<name> cold"``, then warm as ``"<name> warm"``."""
    out = {}
    if cold:
        got = alternating({name: (fn, drop) for name, fn in runs.items()}, repeat, timer)
        out.update({f"{name} cold": t for name, t in got.items()})
    for fn in runs.values():
        fn()
    got = alternating({name: (fn, None) for name, fn in runs.items()}, repeat, timer)
    out.update({f"{name} warm": t for name, t in got.items()})
    return out


def remove(path: Path) -> None:
    """Remove ``path``, a directory or a file, if it exists."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        path.unlink()


def fresh(path: Path) -> Callable[[], None]:
    """A setup that removes ``path`` (every tool writes to a new place each time), then ``sync``:
    no save starts with the writeback of an earlier one still in flight."""

    def setup() -> None:
        remove(path)
        os.sync()

    return setup


def memcpy_into_preallocated(state: dict[str, torch.Tensor]) -> Callable[[], None]:
    """A bare copy of the state into memory allocated and touched beforehand: the stall's limit."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for v in dst.values():
        v.zero_()  # map every page

    def run() -> None:
        for k, v in state.items():
            dst[k].copy_(v)

    return run


def raw_write(state: dict[str, torch.Tensor], d: Path) -> None:
    """Each tensor's bytes with ``numpy.ndarray.tofile``, then fsync of each file and the directory."""
    d.mkdir(parents=True, exist_ok=True)
    for k, v in state.items():
        with open(d / k, "wb") as f:
            v.contiguous().view(torch.uint8).numpy().tofile(f)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(d)


def raw_read(state: dict[str, torch.Tensor], d: Path) -> None:
    """Each file read whole into fresh memory with one ``readinto`` (faster here than ``numpy.fromfile``)."""
    for k, v in state.items():
        buf = np.empty(v.numel() * v.element_size(), dtype=np.uint8)
        with open(d / k, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file below ``path``, and the directories (for tools that do not sync themselves)."""
    if path.is_file():
        fsync_file(path)
        fsync_dir(path.parent)
        return
    for root, _dirs, files in os.walk(path):
        for f in files:
            fsync_file(Path(root) / f)
        fsync_dir(Path(root))


def count_files(path: Path) -> int:
    if path.is_file():
        return 1
    return sum(len(files) for _, _, files in os.walk(path))


def save_load_targets(s: dict[str, float], cold: bool, reshard: str) -> list[tuple[str, float, str, float]]:
    """Issue 4's targets as (name, measured ratio, comparison, bound), from one run's seconds."""
    mode = "cold" if cold else "warm"
    stall = s["pytreeckpt.async_save stall"]
    load = s[f"pytreeckpt.load {mode}"]
    return [
        ("async_save stall / memcpy", stall / s["memcpy"], "<=", 1.5),
        ("async_save stall / DCP async_save stall", stall / s["dcp.async_save stall"], "<=", 0.5),
        ("save throughput / raw write", s["raw write+fsync"] / s["pytreeckpt.save"], ">=", 0.7),
        ("save throughput / DCP save", s["dcp.save"] / s["pytreeckpt.save"], ">=", 2.0),
        (f"{mode} load throughput / raw read", s[f"raw read {mode}"] / load, ">=", 0.7),
        (f"{mode} load throughput / DCP load", s[f"dcp.load {mode}"] / load, ">=", 1.2),
        (f"{mode} {reshard}", s[f"pytreeckpt.load resharded {mode}"] / load, "<=", 1.25),
    ]
