"""Rank functions of the torchtitan tests: torchtitan's llama3 debug model (2 layers) trained on CPU gloo ranks
(the job as ``benchmarks/_titan.py`` builds it)."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks._titan import BATCH, SEQ, Job

__all__ = ["BATCH", "SEQ", "STEPS", "STOP", "resume_at_two", "save_and_resume"]

STEPS = 6
STOP = 4


def save_and_resume(rank: int, world: int, base: str) -> dict[str, Any]:
    """An uninterrupted run; the same run stopped at step 4 (saving every step, keeping the latest 2, copying
    behind the next step); a job of another initialisation resuming it to the end, saving the model in bfloat16
    at the last."""
    full = Job(rank, world, base + "/full", STEPS, seed=0, interval=100)
    full_losses = full.train()
    full.close()

    ckpt = {"interval": 1, "keep_latest_k": 2, "async_mode": "async_with_pinned_mem", "export_dtype": "bfloat16"}
    first = Job(rank, world, base, STEPS, seed=0, **ckpt)
    first_losses = first.train(until=STOP)
    first.close()
    del first

    resumed = Job(rank, world, base, STEPS, seed=1, **ckpt)
    resumed_losses = resumed.train()
    resumed.close()
    return {
        "full": full_losses,
        "first": first_losses,
        "resumed": resumed_losses,
        "last_model": resumed.param_sums(torch.bfloat16),
        "ntokens_seen": resumed.train_state.ntokens_seen,
    }


def resume_at_two(rank: int, world: int, base: str, fresh: str) -> dict[str, Any]:
    """Ranks of another world size: the model saved at the last step as an initial load (model only, in
    bfloat16); then step 4 resumed, the LR scheduler excluded, and training continued without saving."""
    initial = Job(
        rank, world, fresh, STEPS, seed=2, hf=True, initial_load_path=base + "/checkpoint/step-6",
        last_save_in_hf=True, export_dtype="bfloat16",
    )  # fmt: skip
    loaded_initial = initial.checkpointer.load()
    initial_model = initial.param_sums(torch.float32)
    initial_step = initial.train_state.step
    initial.checkpointer.save(STEPS, last_step=True)  # as Hugging Face safetensors, in bfloat16
    initial.close()
    hf = {}
    if rank == 0:
        from safetensors.torch import load_file

        exported = load_file(fresh + "/checkpoint/step-6/model.safetensors")
        hf = {k: (str(v.dtype), float(v.double().sum())) for k, v in exported.items()}

    job = Job(rank, world, base, STEPS, seed=2, load_step=STOP, load_only=True, exclude_from_loading=["lr_scheduler"])
    job.checkpointer.load(step=STOP)
    step, last_epoch, ntokens = (
        job.train_state.step,
        job.lr_schedulers.schedulers[0].last_epoch,
        job.train_state.ntokens_seen,
    )
    losses = job.train(load=False)
    job.close()
    return {
        "loaded_initial": loaded_initial,
        "initial_model": initial_model,
        "initial_step": initial_step,
        "hf": hf,
        "step": step,
        "last_epoch": last_epoch,
        "ntokens_seen": ntokens,
        "losses": losses,
    }
