"""Peak host memory and time of exporting a checkpoint to torch.distributed.checkpoint's format.

    python -m benchmarks.dcp_export [--mib 400] [--leaves 8] [--max-file-size 64MB] [--repeat 2] [--json]

A checkpoint of ``--mib`` MiB (random float32 and bfloat16 matrices, ``--leaves`` of them)
is saved once; then, each in a process of its own, in turns for ``--repeat`` rounds:

- ``export_dcp``: ``pytreeckpt.export_dcp(ckpt, out, max_file_size=...)``;
- ``load + dcp.save``: what one does without it, ``pytreeckpt.load(ckpt)`` then
  ``torch.distributed.checkpoint.save`` of the loaded tree (one process, no group).

Each process reports its resident memory once torch, pytreeckpt and the checkpoint's
metadata are in (``before``), and its peak during the export (``VmHWM``, reset to the
current RSS just before: Linux's ``clear_refs``). The figures are the largest peak and
the median time of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROUTES = ("export_dcp", "load + dcp.save")
MiB = 1024 * 1024


def _child(route: str, ckpt: str, out: str, max_file_size: str) -> dict[str, Any]:
    import warnings

    import torch.distributed.checkpoint as dcp

    import pytreeckpt

    from .rss import _peak_rss, _rss_now

    pytreeckpt.metadata(ckpt)  # the libraries and the metadata in, before the reset
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_now()
    t0 = time.perf_counter()
    if route == "export_dcp":
        pytreeckpt.export_dcp(ckpt, out, max_file_size=max_file_size)
    else:
        state = pytreeckpt.load(ckpt)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save(state, checkpoint_id=out)
        del state
    seconds = time.perf_counter() - t0
    return {"before": before, "peak": _peak_rss(), "seconds": seconds}


def run(mib: float, leaves: int, max_file_size: str, repeat: int, where: Path) -> dict[str, Any]:
    """Every route ``repeat`` times, alternated; the checkpoint and outputs under ``where``."""
    import pytreeckpt

    from ._common import make_state, nbytes_of

    ckpt = where / "ckpt"
    state = make_state(int(mib * MiB), leaves)
    nbytes = nbytes_of(state)
    pytreeckpt.save(ckpt, state)
    del state
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in ROUTES}
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    for i in range(repeat):
        for route in ROUTES if i % 2 == 0 else ROUTES[::-1]:
            out = where / "out"
            shutil.rmtree(out, ignore_errors=True)
            code = (
                "import json, sys; from benchmarks.dcp_export import _child; print(json.dumps(_child(*sys.argv[1:])))"
            )
            done = subprocess.run(
                [sys.executable, "-c", code, route, str(ckpt), str(out), max_file_size],
                capture_output=True,
                text=True,
                env=env,
                cwd=root,
            )
            if done.returncode:
                raise RuntimeError(f"{route} failed:\n{done.stderr}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            got["files"] = len(list(out.glob("*.distcp")))
            runs[route].append(got)
    result: dict[str, Any] = {"bytes": nbytes, "leaves": leaves, "max_file_size": max_file_size, "routes": {}}
    for route, rs in runs.items():
        result["routes"][route] = {
            "before": max(r["before"] for r in rs),
            "peak": max(r["peak"] for r in rs),
            "above_before": max(r["peak"] - r["before"] for r in rs),
            "seconds": statistics.median(r["seconds"] for r in rs),
            "files": rs[-1]["files"],
        }
    return result


def _report(r: dict[str, Any]) -> str:
    lines = [
        f"checkpoint {r['bytes'] / MiB:.0f} MiB in {r['leaves']} tensors; max_file_size {r['max_file_size']}",
        "| route | RSS before (MiB) | peak (MiB) | peak above before (MiB) | seconds | .distcp files |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for route, x in r["routes"].items():
        lines.append(
            f"| {route} | {x['before'] / MiB:.0f} | {x['peak'] / MiB:.0f} | {x['above_before'] / MiB:.0f} | "
            f"{x['seconds']:.2f} | {x['files']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=400)
    p.add_argument("--leaves", type=int, default=8)
    p.add_argument("--max-file-size", default="64MB")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        r = run(args.mib, args.leaves, args.max_file_size, args.repeat, Path(d))
    print(json.dumps(r, indent=2) if args.json else _report(r))


if __name__ == "__main__":
    main()
