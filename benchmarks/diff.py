"""``pytreeckpt.diff`` of two checkpoints differing in one leaf: its peak memory against the largest chunk, its
time against loading both.

    python -m benchmarks.diff [--gib 1] [--leaves 8] [--repeat 3] [--dir DIR] [--out docs/benchmarks]

Saves two states of ``--gib`` each (:func:`~benchmarks._common.make_state`: float32 and
bfloat16 matrices), the second with one leaf changed, then, in the same rounds (warm page
cache): ``pytreeckpt.diff`` of the two, each in a process of its own that reports its
peak resident memory (``VmHWM``, counted from the resident memory before the call), and
``pytreeckpt.load`` of each checkpoint. Prints one JSON object: the chunk bytes, the
diff's peak memory over the largest chunk, and its time over the two loads'; with
``--out``, writes it as ``diff.json`` and the table as ``diff.md`` there.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytreeckpt

from ._common import GiB, make_state, nbytes_of, round_ratios, rounds
from .rss import _peak_rss, _rss_now

__all__ = ["measure", "run", "table", "targets"]

ROOT = Path(__file__).resolve().parents[1]


def measure(a: str, b: str) -> dict[str, Any]:
    """One ``pytreeckpt.diff(a, b)`` in this process: its seconds, the resident memory before, its peak, its result."""
    from pytreeckpt.loading import _chunks, _diff  # (imported first: the libraries are not the diff's memory or time)

    del _chunks, _diff
    diff = pytreeckpt.diff
    with open("/proc/self/clear_refs", "w") as f:  # the peak started afresh (Linux: 5 resets VmHWM to the RSS)
        f.write("5")
    before = _rss_now()
    t0 = time.perf_counter()
    report = diff(a, b)
    seconds = time.perf_counter() - t0
    peak = _peak_rss()
    return {
        "seconds": seconds,
        "rss_before": before,
        "peak_rss": peak,
        "peak_bytes": report.peak_bytes,
        "chunks": report.chunks,
        "differences": [d.key for d in report.differences],
    }


def _diff_in_a_process(a: Path, b: Path, out: list[dict[str, Any]]) -> None:
    cmd = [sys.executable, "-m", "benchmarks.diff", "--measure", str(a), str(b)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    out.append(json.loads(done.stdout.splitlines()[-1]))


def run(gib: float, leaves: int, repeat: int, directory: Path) -> dict[str, Any]:
    state = make_state(int(gib * GiB), leaves)
    a, b = directory / "a", directory / "b"
    pytreeckpt.save(a, state, overwrite=True)
    changed = next(iter(state))
    state[changed] = state[changed].clone()
    state[changed][0, 0] += 1
    pytreeckpt.save(b, state, overwrite=True)
    meta = pytreeckpt.metadata(a)
    chunk = max(math.prod(m.chunk_shape) * m.dtype.itemsize for m in meta.arrays.values())
    state_bytes = nbytes_of(state)
    del state
    measured: list[dict[str, Any]] = []
    times = rounds(
        {
            "diff": (lambda: _diff_in_a_process(a, b, measured), None),
            "load a": (lambda: pytreeckpt.load(a), None),
            "load b": (lambda: pytreeckpt.load(b), None),
        },
        repeat,
    )
    inside = [m["seconds"] for m in measured]  # (the diff's own time, without starting its process)
    loads = [x + y for x, y in zip(times["load a"], times["load b"], strict=True)]
    extra = [m["peak_rss"] - m["rss_before"] for m in measured]
    return {
        "state_bytes": state_bytes,
        "largest_chunk_bytes": chunk,
        "diff_seconds": inside,
        "load_both_seconds": loads,
        "time_ratios": round_ratios(inside, loads),
        "diff_extra_rss": extra,
        "memory_ratios": [e / chunk for e in extra],
        "diff_peak_bytes": measured[0]["peak_bytes"],
        "chunks": measured[0]["chunks"],
        "differences": measured[0]["differences"],
        "changed": changed,
    }


def targets(r: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """The figures as rows (name, measured, comparison, bound): reported, the bounds what the design allows."""
    import statistics

    return [
        ("diff peak memory / largest chunk", max(r["memory_ratios"]), "<=", 8.0),
        ("diff time / load of both", statistics.median(r["time_ratios"]), "<=", 2.0),
    ]


def table(r: dict[str, Any]) -> list[str]:
    """The figures as a markdown table (medians over the rounds, and each round's ratio)."""
    import statistics

    mib = 1 << 20
    rounds_ = ", ".join(f"{t:.2f}" for t in r["time_ratios"])
    return [
        f"`pytreeckpt.diff` of two checkpoints of {r['state_bytes'] / GiB:.1f} GiB ({r['chunks']} chunks of at most "
        f"{r['largest_chunk_bytes'] / mib:.0f} MiB each), differing in one element of `{r['changed']}` "
        "(warm page cache).",
        "",
        "| figure | measured |",
        "| --- | ---: |",
        f"| diff peak memory (VmHWM over the RSS before) | {max(r['diff_extra_rss']) / mib:.1f} MiB |",
        f"| the same / largest chunk | {max(r['memory_ratios']):.2f} |",
        f"| arrays held at once (both sides of a batch) | {r['diff_peak_bytes'] / mib:.1f} MiB |",
        f"| diff seconds (median) | {statistics.median(r['diff_seconds']):.2f} |",
        f"| load of both seconds (median) | {statistics.median(r['load_both_seconds']):.2f} |",
        f"| diff / load of both (median of rounds: {rounds_}) | {statistics.median(r['time_ratios']):.2f} |",
        "",
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--leaves", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="write diff.json and diff.md here")
    p.add_argument("--measure", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    with tempfile.TemporaryDirectory(prefix="pytreeckpt-diff-", dir=args.dir) as d:
        r = run(args.gib, args.leaves, args.repeat, Path(d))
    r["targets"] = targets(r)
    print(json.dumps(r, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "diff.json").write_text(json.dumps(r, indent=2) + "\n")
        (args.out / "diff.md").write_text("\n".join(table(r)))


if __name__ == "__main__":
    main()
