"""A torchtitan training job on CPU gloo ranks: torchtitan's llama3 debug model, its components, a checkpointer.

The trainer's own loop (``torchtitan.trainer.Trainer``) runs on an accelerator only (its device is
``cuda`` when none is found), so these functions do what it does with torchtitan's components: the
llama3 ``debugmodel`` (2 of its 6 layers, torch's SDPA in place of FlexAttention, which needs
torch.compile), FSDP2 applied by torchtitan's ``apply_fsdp_to_decoder`` on a CPU mesh, its AdamW
optimizers container and warmup/decay LR schedulers, a ``ParallelAwareDataloader`` of synthetic
tokens, and the checkpointer built from its config with the trainer's arguments, called where the
trainer calls it (``load`` before training, ``maybe_wait_for_staging`` before the optimizer steps,
``save`` after each step). Shared by ``tests/torchtitan_workers.py`` and ``benchmarks/torchtitan.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import IterableDataset

SEQ = 32
BATCH = 2
VOCAB = 2048


class Tokens(IterableDataset[tuple[dict[str, torch.Tensor], torch.Tensor]], Stateful):
    """Synthetic token sequences, a different stream per data-parallel rank, resumable."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.i = 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            g = torch.Generator().manual_seed(100_003 * self.rank + self.i)
            t = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            self.i += 1
            yield {"input": t[:-1]}, t[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]


class TrainState(Stateful):
    """What the trainer saves of itself (``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.ntokens_seen = state["ntokens_seen"]


def model_config(layers: int) -> Any:
    """The llama3 ``debugmodel``'s config, its first ``layers`` layers (of 6), attention by SDPA."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    config = model_registry("debugmodel").model
    config.layers = config.layers[:layers]
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


class Job:
    """One training job's objects, built as torchtitan's trainer builds them."""

    def __init__(
        self,
        rank: int,
        world: int,
        base: str,
        steps: int,
        seed: int,
        hf: bool = False,
        backend: str = "pytreeckpt",
        layers: int = 2,
        **checkpoint: Any,
    ) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.components.checkpointer import CheckpointManager as DCPManager
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        from pytreeckpt.integrations.torchtitan import CheckpointManager

        manager = {"pytreeckpt": CheckpointManager, "dcp": DCPManager}[backend]

        self.steps = steps
        self.world = world
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        torch.manual_seed(seed)
        config = model_config(layers)
        with torch.device("meta"):
            model = config.build()
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
        for m in model.modules():  # gloo has no PREMUL_SUM (torchtitan sums gradients, dividing by 1)
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model = model
        self.optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ).build(optimizers=self.optimizers, training_steps=steps)
        self.dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
        self.train_state = TrainState()
        self.config = manager.Config(enable=True, **checkpoint)
        self.checkpointer = self.config.build(
            dataloader=self.dataloader,
            model_parts=[model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=Llama3StateDictAdapter(config, None) if hf else None,
            base_folder=base,
        )

    def train(self, until: int | None = None, load: bool = True) -> list[float]:
        """Load (unless not ``load``), then train to step ``until`` (the job's last step by default); the global
        losses."""
        if load:
            self.checkpointer.load(step=self.config.load_step)
        losses = []
        batches = iter(self.dataloader)
        while self.train_state.step < (until or self.steps):
            losses.append(self.step(batches))
            self.checkpointer.save(self.train_state.step, last_step=self.train_state.step == self.steps)
        return losses

    def step(self, batches: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> float:
        """One training step, as the trainer's ``train_step``; the global loss."""
        self.train_state.step += 1
        self.optimizers.zero_grad()
        inputs, labels = next(batches)
        self.train_state.ntokens_seen += labels.numel()
        pred = self.model(inputs["input"])
        # as torchtitan's loss: the sum over this rank's tokens over the global token count
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        loss = loss / (labels.numel() * self.world)
        loss.backward()
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        return loss.item()

    def param_sums(self, dtype: torch.dtype) -> dict[str, float]:
        """Each parameter, whole and rounded to ``dtype``, summed in float64."""
        return {n: float(p.full_tensor().to(dtype).double().sum()) for n, p in self.model.named_parameters()}

    def close(self) -> None:
        self.checkpointer.close()
