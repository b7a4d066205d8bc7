"""A training loop checkpointing with CheckpointManager; kill it at any time and rerun it.

    python examples/train_with_manager.py --dir /tmp/run --steps 60 --every 10
    # kill it (Ctrl-C, SIGKILL, a crash), then run the same command again: it resumes

With `--fast-dir /dev/shm/run --fast-every 2` it also checkpoints every 2 steps to memory
(TwoTierManager), and a rerun resumes from whichever tier holds the newer step.

Every run prints one line per step: `step N loss L`. A resumed run restores the newest
committed checkpoint (model, optimizer, RNG state, data position) and its losses are
identical to those an uninterrupted run prints for the same steps.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import torch
from torch import nn

import pytreeckpt

TEXT = torch.tensor(list(inspect.getsource(json.encoder).encode()), dtype=torch.long)
SEQ, BATCH = 32, 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(256, 64), nn.Flatten(), nn.Linear(SEQ * 64, 256), nn.ReLU(), nn.Linear(256, 256))


def batch(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(position)
    starts = torch.randint(0, len(TEXT) - SEQ - 1, (BATCH,), generator=g)
    x = torch.stack([TEXT[s : s + SEQ] for s in starts.tolist()])
    return x, TEXT[starts + SEQ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60, help="train until this step")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--fast-dir", type=Path, help="a fast tier in memory (e.g. /dev/shm/run): two tiers")
    parser.add_argument("--fast-every", type=int, default=2, help="with --fast-dir: save there every N steps")
    args = parser.parse_args()

    # Identical losses need identical arithmetic. torch's CPU matmul rounds differently with
    # another number of threads, and MKL may pick fewer threads for a call while the machine
    # is busy (a checkpoint being written behind the loop, other programs): one intra-op
    # thread makes every run's arithmetic the same, so a difference can only be the checkpoint's.
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dropout = nn.Dropout(0.1)  # uses the RNG: its state is part of the checkpoint
    start = 0
    manager: pytreeckpt.CheckpointManager | pytreeckpt.TwoTierManager
    if args.fast_dir is None:
        manager = pytreeckpt.CheckpointManager(args.dir, max_to_keep=args.keep, save_interval_steps=args.every)
    else:  # frequent checkpoints in memory, every --every steps to --dir
        manager = pytreeckpt.TwoTierManager(
            args.fast_dir,
            args.dir,
            fast_interval_steps=args.fast_every,
            durable_interval_steps=args.every,
            durable_max_to_keep=args.keep,
        )
    with manager:
        if manager.latest_step() is not None:
            state = manager.restore()  # the newest committed step (of either tier), as plain tensors
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            torch.set_rng_state(state["rng"])
            start = state["step"]
            print(f"resumed from step {start}", flush=True)
        for step in range(start, args.steps):
            x, y = batch(step)
            loss = nn.functional.cross_entropy(dropout(model(x)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step + 1} loss {loss.item():.6f}", flush=True)
            state = {
                "model": model.state_dict(),
                "optim": opt.state_dict(),
                "rng": torch.get_rng_state(),
                "step": step + 1,
            }
            manager.save(step + 1, state)  # async: returns after the snapshot; skips steps off the interval


if __name__ == "__main__":
    main()
