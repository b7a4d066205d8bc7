"""The command line's wall time per call: ``pytreeckpt ls``, ``inspect`` and ``verify`` on a small checkpoint.

    python -m benchmarks.cli_latency [--before 2ef134c] [--repeat 5] [--json]

Issue 43 asks these to answer at once: at most 0.5 s per call (they took 4.8-6 s, almost
all of it importing torch, which none of them needs); issue 64 at most 0.3 s, whatever the
versions of the dependencies (ml_dtypes 0.7, which TensorStore imports, takes about 2 s to
import). Each call is a new process, ``python -m pytreeckpt <command> <path>``, timed from
its start to its exit, as a user waits for it: with Python's bytecode caches written
(``PYTHONDONTWRITEBYTECODE`` is dropped from its environment; the untimed first call of
each writes them), as an installed package has them. This tree's ``src/`` runs beside
``--before``'s (its ``src/`` taken with ``git archive``, nothing checked out), in turns,
``--repeat`` rounds in an order shuffled (seeded) each round; the figures are medians.
``--before ''`` times this tree alone.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "2ef134c"
"""The last commit before issue 43's CLI work (its ls, inspect and verify imported torch)."""
BOUND = 0.3
"""Issue 64's bound on one call's wall time, in seconds (issue 43's was 0.5)."""
COMMANDS = ("ls", "inspect", "verify")


def _checkpoints(where: Path) -> None:
    """A small run directory: two checkpoints of a few arrays (packed, and in chunk files) and values."""
    import torch

    import pytreeckpt

    state = {
        "model": {f"layer{i}": {"w": torch.randn(64, 64), "b": torch.zeros(64)} for i in range(4)},
        "step": 100,
        "lr": 3e-4,
    }
    pytreeckpt.save(where / "step_100", state)
    files = pytreeckpt.Location(where / "step_200", pytreeckpt.StorageOptions(pack_small_leaves=False))
    pytreeckpt.save(files, {**state, "step": 200})


def _source_of(rev: str, into: Path) -> Path:
    """``rev``'s ``src/`` under ``into`` (RuntimeError, with git's words, where there is none)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"], capture_output=True)
    except OSError as e:  # (no git)
        raise RuntimeError(f"cannot read {rev}: {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"cannot read {rev} of {ROOT}: {out.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # (Python 3.10.12, 3.11.4 and later)
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)  # (git's own archive of this repository)
    return into / "src"


def _call(src: Path, command: str, path: Path) -> float:
    """One call's wall time: a new process running ``src``'s command line."""
    env = dict(os.environ, PYTHONPATH=str(src))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytreeckpt", command, str(path)], env=env, capture_output=True)
    took = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"pytreeckpt {command} {path} ({src}) failed:\n{out.stderr.decode(errors='replace')}")
    return took


def run(before: str | None = BEFORE, repeat: int = 5) -> dict[str, Any]:
    """Each version's seconds per call of each command (every round's, and their median)."""
    tmp = Path(tempfile.mkdtemp(prefix="pytreeckpt-cli-"))
    try:
        _checkpoints(tmp / "run")
        versions = {"now": ROOT / "src"}
        if before:
            versions["before"] = _source_of(before, tmp / "before")
        args = {"ls": tmp / "run", "inspect": tmp / "run" / "step_100", "verify": tmp / "run" / "step_200"}
        calls = [(name, command) for name in versions for command in COMMANDS]
        times: dict[str, dict[str, list[float]]] = {name: {c: [] for c in COMMANDS} for name in versions}
        for name, command in calls:  # (a first call of each, untimed: the files in the page cache)
            _call(versions[name], command, args[command])
        for r in range(repeat):
            random.Random(r).shuffle(calls)
            for name, command in calls:
                times[name][command].append(_call(versions[name], command, args[command]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "before": before,
        "repeat": repeat,
        "rounds": times,
        "seconds": {name: {c: statistics.median(t) for c, t in ts.items()} for name, ts in times.items()},
    }


def targets(r: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """Issue 64's bound: each command's median seconds per call, this tree's."""
    return [
        (f"pytreeckpt {c} on a small checkpoint, seconds per call (median of {r['repeat']})", s, "<=", BOUND)
        for c, s in r["seconds"]["now"].items()
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--before", default=BEFORE, help="the earlier revision ('' for none)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    r = run(args.before or None, args.repeat)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    before = r["seconds"].get("before", {})
    print(f"| command | now, s | before ({args.before}), s |" if before else "| command | now, s |")
    print("| --- | ---: | ---: |" if before else "| --- | ---: |")
    for c, s in r["seconds"]["now"].items():
        print(f"| {c} | {s:.3f} | {before[c]:.3f} |" if before else f"| {c} | {s:.3f} |")
    for name, value, op, bound in targets(r):
        print(f"{name}: {value:.3f} ({op} {bound}: {'met' if value <= bound else 'MISSED'})")


if __name__ == "__main__":
    main()
