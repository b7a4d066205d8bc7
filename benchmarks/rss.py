"""Peak host memory of an async_save, or of resuming a model's state, in a process of its own.

    python -m benchmarks.rss --gib 4 [--pool-gib 1]
    python -m benchmarks.rss --gib 4 --load {inplace,copy} --checkpoint DIR

Prints one JSON object: the state's bytes, the pool bound, the resident memory before
the save (state and libraries) and the peak during it (``VmHWM``). With ``--load`` the
state in ``DIR`` (saved by ``--save-to DIR``) is loaded into a model's state of the same
shapes: ``inplace`` by ``load(..., inplace=True)``, ``copy`` as resuming is done without it
(``load`` then ``load_state_dict``, which copies every tensor into the model's own).
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


def _load(args: argparse.Namespace) -> None:
    import torch

    shapes = {k: (tuple(v.shape), v.dtype) for k, v in make_state(int(args.gib * GiB), 8).items()}
    module = torch.nn.Module()  # a model whose parameters are the state's tensors
    for k, (shape, dtype) in shapes.items():
        module.register_parameter(k.replace(".", "_"), torch.nn.Parameter(torch.ones(shape, dtype=dtype)))
    target = {k: getattr(module, k.replace(".", "_")) for k in shapes}
    # Making the shapes' random state above peaked higher than the model holds now: start
    # the peak afresh (Linux: writing 5 to clear_refs resets VmHWM to the current RSS).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss_now()
    if args.load == "inplace":
        pytreeckpt.load(args.checkpoint, target, inplace=True)
    else:
        out = pytreeckpt.load(args.checkpoint, target)
        module.load_state_dict({k.replace(".", "_"): v for k, v in out.items()})
        del out
    peak = _peak_rss()
    ok = all(torch.equal(target[k], v) for k, v in make_state(int(args.gib * GiB), 8).items())
    state_bytes = sum(p.numel() * p.element_size() for p in target.values())
    print(
        json.dumps(
            {
                "state_bytes": state_bytes,
                "rss_before": before,
                "peak_rss": peak,
                "ratio_to_state": peak / before,
                "loaded_equal": ok,
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--pool-gib", type=float, default=None)
    p.add_argument("--save-to", type=Path, help="only save the state there (for --load)")
    p.add_argument("--load", choices=["inplace", "copy"])
    p.add_argument("--checkpoint", type=Path)
    args = p.parse_args()
    if args.load:
        _load(args)
        return
    state = make_state(int(args.gib * GiB), 8)
    if args.save_to:
        pytreeckpt.save(args.save_to, state, overwrite=True)
        return
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
