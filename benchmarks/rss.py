"""Peak host memory of an async_save, in a process of its own.

    python -m benchmarks.rss --gib 4 [--pool-gib 1]

Prints one JSON object: the state's bytes, the pool bound, the resident memory before
the save (state and libraries) and the peak during it (``VmHWM``).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
from pathlib import Path

import pytreeckpt

from ._common import GiB, make_state, nbytes_of


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss() -> int:
    """This process's peak resident memory (``VmHWM``). Not ``ru_maxrss``: across ``exec`` Linux
    carries into it the peak of the process that started this one (the whole benchmark run)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--pool-gib", type=float, default=None)
    args = p.parse_args()
    state = make_state(int(args.gib * GiB), 8)
    before = _rss_now()
    pool = None if args.pool_gib is None else int(args.pool_gib * GiB)
    with tempfile.TemporaryDirectory(prefix="pytreeckpt-rss-") as d:
        h = pytreeckpt.async_save(Path(d) / "c", state, executor=pytreeckpt.ExecutorOptions(staging_bytes=pool))
        h.wait()
    peak = _peak_rss()
    state_bytes = nbytes_of(state)
    bound = state_bytes if pool is None else min(pool, state_bytes)
    print(
        json.dumps(
            {
                "state_bytes": state_bytes,
                "pool_bytes": bound,
                "rss_before": before,
                "peak_rss": peak,
                "ratio_to_state_plus_pool": peak / (before + bound),
            }
        )
    )


if __name__ == "__main__":
    main()
