"""Resume an FSDP2 job exactly: the whole training state saved as it is, per-rank state per rank.

    torchrun --nproc-per-node 4 examples/resume_exact.py --dir /tmp/exact --steps 8 --save-at 4
    torchrun --nproc-per-node 4 examples/resume_exact.py --dir /tmp/exact --steps 8 --resume
    torchrun --nproc-per-node 2 examples/resume_exact.py --dir /tmp/exact --steps 8 --resume --per-rank keep

The state is the objects themselves: an FSDP2 model, its AdamW optimizer, an LR
scheduler and a data loader (each saved through its state dict and restored into in
place), each rank's RNG (its dropout masks) and the step. The data loader and the RNG
differ on every rank, so the spec tree marks them ``PER_RANK``: each rank's own is stored,
and a resume at the same world size gives every rank back its own. The first run trains
``--steps`` steps and saves at ``--save-at``; the second resumes from that checkpoint and
trains to ``--steps``. Each run writes, per rank, the loss of every step it trained (as
exact float hex) and the next draws of its RNG and its data loader to
``DIR/run-<name>-rank<r>.json``: those of the resumed run equal the uninterrupted run's,
bit for bit. At another world size the per-rank parts follow ``--per-rank``: the default
(``own``) refuses, naming them; ``keep`` resumes the model, optimizer and scheduler
(resharded) and keeps each rank's fresh loader and RNG.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import pytreeckpt
from pytreeckpt import PER_RANK

DIM, BATCH, SAMPLES = 32, 4, 256


class Loader:
    """A data loader that shuffles the dataset for its rank, with a generator of its own; its position and
    generator are its state (a stateful loader, as torchdata's StatefulDataLoader is)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.generator = torch.Generator().manual_seed(100 + rank)
        self.epoch, self.position = 0, 0
        self.order = self._shuffle()

    def _shuffle(self) -> torch.Tensor:
        return torch.randperm(SAMPLES, generator=self.generator)[self.rank :: self.world]

    def next_batch(self) -> torch.Tensor:
        if self.position + BATCH > len(self.order):
            self.epoch, self.position = self.epoch + 1, 0
            self.order = self._shuffle()
        idx = self.order[self.position : self.position + BATCH]
        self.position += BATCH
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "order": self.order, "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.order = state["order"].clone()
        self.generator.set_state(state["rng"])


class GlobalRNG:
    """The process's CPU random number generator (dropout draws from it) as an object with a state dict."""

    def state_dict(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, DIM, generator=g)
    return x, x.roll(1, dims=1).tanh()


def model_of(mesh: Any) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Dropout(0.2), nn.Linear(4 * DIM, DIM), nn.Dropout(0.1))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8, help="train up to this step")
    parser.add_argument("--save-at", type=int, default=4, help="save the state after this step")
    parser.add_argument("--resume", action="store_true", help="resume from the checkpoint of --save-at")
    parser.add_argument("--per-rank", default="own", choices=("own", "keep", "all"), help="load's per_rank policy")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = model_of(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loader, rng = Loader(rank, world), GlobalRNG()
    torch.manual_seed(1000 + rank)  # each rank's own dropout masks
    x, y = dataset()
    ckpt = args.dir / f"step_{args.save_at}"

    state = {"model": model, "optim": opt, "sched": sched, "data": loader, "rng": rng, "step": 0}
    spec = {"data": PER_RANK, "rng": PER_RANK}  # what each rank holds for itself
    start, name = 0, f"{world}ranks"
    if args.resume:
        try:
            loaded = pytreeckpt.load(ckpt, state, per_rank=args.per_rank)
        except pytreeckpt.CheckpointError as e:
            dist.destroy_process_group()
            raise SystemExit(f"rank {rank}: resume refused: {e}") from None
        start, name = loaded["step"], f"resumed-{world}ranks-{args.per_rank}"
        if rank == 0:
            print(f"resumed step {start} saved by {pytreeckpt.metadata(ckpt).per_rank['data']} ranks on {world}")

    losses = {}
    for step in range(start, args.steps):
        idx = loader.next_batch()
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses[step + 1] = loss.item().hex()
        if step + 1 == args.save_at and not args.resume:
            state["step"] = step + 1
            pytreeckpt.save(ckpt, state, spec, overwrite=True)
            if rank == 0:
                print(f"saved step {step + 1}")
    out = {"losses": losses, "rng": torch.rand(4).tolist(), "data": loader.next_batch().tolist()}
    (args.dir / f"run-{name}-rank{rank}.json").write_text(json.dumps(out))
    if rank == 0:
        print(f"trained to step {args.steps}: last loss {losses.get(args.steps)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
