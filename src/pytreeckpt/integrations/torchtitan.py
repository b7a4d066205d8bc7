"""A torchtitan checkpoint backend that saves and loads through pytreeckpt.

torchtitan (0.3.0) builds its checkpointer from ``Trainer.Config.checkpoint``: whichever
``BaseCheckpointManager.Config`` subclass is there is built by ``config.checkpoint.build(...)``,
as its DCP backend is by default. Putting this module's :class:`CheckpointManager.Config`
there (in a ``config_registry`` function, or with :func:`checkpoint_config` from an existing
config) chooses pytreeckpt, with the same options and the same ``step-<N>`` folders::

    from pytreeckpt.integrations.torchtitan import CheckpointManager

    config = llama3_debugmodel()
    config.checkpoint = CheckpointManager.Config(enable=True, interval=500, async_mode="async")

What is saved: ``{"model": ModelWrapper, "optimizer": ..., "lr_scheduler": ...,
"dataloader": ..., "train_state": ...}``, each a torchtitan ``Stateful`` saved as its own
``state_dict()`` (the model's and optimizer's DTensors as sharded arrays, written once and
loadable at another world size), the dataloader's state per rank (``PER_RANK``: torchtitan
keys it ``dp_rank_<r>``). At another world size every state but the dataloader's loads
(torchtitan's dataloaders cannot be resharded: theirs restarts, with a warning).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
    purge_thread,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger

from pytreeckpt.api import LoadReport, SaveHandle, async_save, load, metadata, save
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._per_rank import PER_RANK, PerRank
from pytreeckpt.distributed._comm import DistComm, distributed_comm
from pytreeckpt.format import METADATA_FILE
from pytreeckpt.interop._safetensors import export_safetensors

if TYPE_CHECKING:
    from torch import nn
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

__all__ = ["CheckpointManager", "checkpoint_config"]

AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
_STEP = re.compile(r"step-(0|[1-9][0-9]*)")
"""A step's folder, exactly as :meth:`CheckpointManager._create_checkpoint_id` names it (fullmatch): ASCII
digits, no leading zero; another name (``step-0999``, other digits) is no step, never loaded nor purged."""


class _Own:
    """A torchtitan ``Stateful`` as a pytreeckpt leaf saved through its own ``state_dict()``.

    torchtitan's optimizers container is a ``torch.optim.Optimizer`` whose state dict is
    already flat and keyed by parameter name (pytreeckpt would otherwise pair it with a
    model and ask torch's helpers for it), and a dataloader's state holds pickled bytes,
    which pytreeckpt stores as uint8 arrays and gives back as bytes.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> Any:
        return _bytes_as_arrays(self.obj.state_dict())

    def load_state_dict(self, state: Any) -> None:
        try:
            self.obj.load_state_dict(_arrays_as_bytes(state, self.obj.state_dict()))
        except Exception as e:  # (pytreeckpt's error names the leaf, this the object)
            raise RuntimeError(f"{type(self.obj).__name__}.load_state_dict: {type(e).__name__}: {e}") from e


def _bytes_as_arrays(x: Any) -> Any:
    if isinstance(x, bytes):
        return np.frombuffer(x, dtype=np.uint8).copy()
    if isinstance(x, dict):
        return {k: _bytes_as_arrays(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_bytes_as_arrays(v) for v in x)
    return x


def _arrays_as_bytes(loaded: Any, own: Any) -> Any:
    """``loaded`` with the arrays back as bytes where the object's own state (``own``) holds bytes."""
    if isinstance(own, bytes):
        if isinstance(loaded, torch.Tensor):
            return loaded.numpy().tobytes()
        return loaded.tobytes() if isinstance(loaded, np.ndarray) else loaded
    if isinstance(own, dict) and isinstance(loaded, dict):
        return {k: _arrays_as_bytes(v, own.get(k)) for k, v in loaded.items()}
    if isinstance(own, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(own) == len(loaded):
        return type(loaded)(_arrays_as_bytes(v, o) for v, o in zip(loaded, own, strict=True))
    return loaded


class CheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # (torchtitan has no type hints)
    """torchtitan's checkpointer, saving and loading through pytreeckpt.

    Chosen as torchtitan chooses any backend: put its :class:`Config` in
    ``Trainer.Config.checkpoint``; the trainer builds it with the same arguments as its
    DCP ``CheckpointManager``. Checkpoints are ``<dump_folder>/<folder>/step-<N>``, saved
    every ``interval`` steps and at the last step, the latest ``keep_latest_k`` kept.

    Args:
      config: the checkpoint options (:class:`CheckpointManager.Config`).
      dataloader: the trainer's dataloader (its state is saved per rank).
      model_parts: the model, or its pipeline stages.
      optimizers: torchtitan's optimizers container.
      lr_schedulers: torchtitan's LR schedulers container.
      states: other ``Stateful`` objects to save, by name (the trainer gives ``{"train_state": trainer}``);
        the four above are added to it, as torchtitan's DCP backend does.
      sd_adapter: the model's state-dict adapter to Hugging Face names (needed by ``last_save_in_hf``).
      base_folder: the folder ``config.folder`` is in (the trainer's ``dump_folder``).

    Raises:
      ValueError: ``last_save_in_hf`` without ``sd_adapter``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's shared checkpoint options, and the save mode of its DCP backend's ``async_mode``.

        ``async_mode``: ``"disabled"`` saves before training goes on; ``"async"`` returns once the
        state is copied to host memory, written and committed behind; ``"async_with_pinned_mem"``
        returns at once and copies while the next step's forward and backward run
        (``maybe_wait_for_staging``, which the trainer calls before the optimizer steps, waits for the copy).
        """

        async_mode: AsyncMode = "disabled"
        """Save mode: synchronous, asynchronous after a copy, or copying behind the next step."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {self.async_mode}")
            if self.initial_load_in_hf:
                raise ValueError(
                    "initial_load_in_hf is not supported by the pytreeckpt backend: import the Hugging Face "
                    "weights once with pytreeckpt.import_safetensors and give that checkpoint as initial_load_path"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: BaseDataLoader | None,
        model_parts: list[nn.Module],
        optimizers: OptimizersContainer,
        lr_schedulers: LRSchedulersContainer,
        states: dict[str, Any],
        sd_adapter: BaseStateDictAdapter | None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        if self.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided.")
        self.async_mode: AsyncMode = config.async_mode
        self.save_future: SaveHandle | None = None  # type: ignore[assignment]
        self.staging_future: SaveHandle | None = None
        # (its own collectives, on groups apart from its saves', as a manager's: never interleaved with an
        # async save's writer; its waits are not recorded, nothing grows step by step)
        self._comm = distributed_comm(op="manager")
        if isinstance(self._comm, DistComm):
            self._comm.monitor = None
        self.keep_latest_k = config.keep_latest_k
        self.purge_thread: threading.Thread | None = None
        if self.keep_latest_k > 0:
            self.purge_queue: queue.Queue[str | None] = queue.Queue()
            self.purge_thread = threading.Thread(
                target=purge_thread, args=(self.purge_queue, filesystem.rmtree), daemon=True
            )
            self.purge_thread.start()
        logger.info(f"Checkpointing active (pytreeckpt). Checkpoints will be loaded from and saved to {self.folder}")

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ the state as a tree
    def _tree(self, states: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tree saved or loaded for ``states`` (each a leaf saved through its own state dict), and its spec."""
        tree = {k: _Own(v) for k, v in states.items() if v is not None}
        spec = {DATALOADER: PER_RANK} if DATALOADER in tree else {}
        return tree, spec

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return {MODEL: self.states[MODEL]}
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(f"{key} not found in state_dict.")
        return {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}

    # ------------------------------------------------------------------ saving
    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        begin = time.monotonic()
        phase = "saving" if self.async_mode == "disabled" else "staging"
        logger.info(f"{phase.capitalize()} the checkpoint.")
        if last_step:
            self._save_last_step(curr_step)
            logger.info(f"Last step checkpoint completed in {time.monotonic() - begin:.2f}s")
            return True
        path = self._create_checkpoint_id(curr_step)
        tree, spec = self._tree(self.states)
        if self.async_mode == "disabled":
            save(path, tree, spec, overwrite=True)
        else:
            lazy = self.async_mode == "async_with_pinned_mem"
            handle = async_save(path, tree, spec, overwrite=True, snapshot="lazy" if lazy else "eager")
            self.save_future = handle
            self.staging_future = handle if lazy else None
        self._purge_stale_checkpoints(curr_step)
        logger.info(f"Finished {phase} the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _save_last_step(self, curr_step: int) -> None:
        path = self._create_checkpoint_id(curr_step)
        if not self.last_save_model_only:
            logger.info(f"Saving a full checkpoint at last step, step {curr_step}.")
            tree, spec = self._tree(self.states)
            save(path, tree, spec, overwrite=True)
            return
        model = {
            k: v.to(self.export_dtype)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != self.export_dtype
            else v
            for k, v in self.states[MODEL].state_dict().items()
        }
        logger.info(f"Saving a model only checkpoint in {self.export_dtype} at last step, step {curr_step}.")
        if not self.last_save_in_hf:
            save(path, {MODEL: model}, overwrite=True)
            return
        assert self.sd_adapter is not None  # (checked in __init__)
        self._save_hf(self.sd_adapter.to_hf(model), path)

    def _save_hf(self, hf_state: dict[str, Any], path: str) -> None:
        """Hugging Face safetensors (and their index) in ``path``, from every rank's shards: saved as a
        pytreeckpt checkpoint beside it, which every rank exports its share of, and rank 0 removes."""
        staged = path + ".pytreeckpt"
        save(staged, hf_state, overwrite=True)
        export_safetensors(staged, path)  # (every rank together: each writes its own files)
        error: BaseException | None = None
        if self._rank == 0:
            try:
                filesystem.rmtree(staged)
            except Exception as e:
                error = e
        if self._comm is not None:
            self._comm.agree(error, f"exporting {path} as safetensors")
        elif error is not None:
            raise error

    @property
    def _rank(self) -> int:
        return 0 if self._comm is None else self._comm.rank

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _purge_stale_checkpoints(self, saving: int) -> None:
        """Have the purge thread delete all but the latest ``keep_latest_k`` steps, counting step ``saving``
        (an asynchronous save may not have made its folder yet)."""
        if self.keep_latest_k <= 0 or self._rank != 0 or not filesystem.isdir(self.folder):
            return
        found = {saving: self._create_checkpoint_id(saving)}
        for name in filesystem.listdir(self.folder):
            if m := _STEP.fullmatch(name):
                found[int(m.group(1))] = filesystem.join(self.folder, name)
        for step in sorted(found)[: -self.keep_latest_k]:
            self.purge_queue.put(found[step])

    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is None:
            return
        self.staging_future.wait_snapshot()
        self.staging_future = None

    def _wait_for_saving(self) -> None:
        assert self.save_future is not None
        self.save_future.wait()
        self.save_future = None
        self.staging_future = None

    # ------------------------------------------------------------------ loading
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        has_folder = filesystem.exists(self.folder)
        if step != -1 and not has_folder:
            raise FileNotFoundError(
                f"--checkpoint.load_step={step} not found because checkpoint.folder {self.folder} does not exist"
            )
        load_step = (self._find_load_step() if step == -1 else step) if has_folder else -1
        if load_step == -1:
            if not self.initial_load_path:
                logger.info("No checkpoint was provided, this is a fresh start.")
                return False
            checkpoint_id = self.initial_load_path
            if not filesystem.isdir(checkpoint_id):
                raise ValueError(f"Checkpoint.initial_load_path is invalid: {checkpoint_id}")
            model_only = self.initial_load_model_only
        else:
            checkpoint_id = self._create_checkpoint_id(load_step)
            if not filesystem.isfile(filesystem.join(checkpoint_id, METADATA_FILE)):
                raise FileNotFoundError(f"--checkpoint.load_step={load_step} not found at {checkpoint_id}")
            model_only = load_step == 0
        logger.info(f"Loading the checkpoint from {checkpoint_id}.")
        begin = time.monotonic()
        self._load_from(checkpoint_id, self._states_to_load(model_only), model_only)
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def _load_from(self, checkpoint_id: str, states: dict[str, Any], model_only: bool) -> None:
        tree, _ = self._tree(states)
        if DATALOADER in tree:
            saved = metadata(checkpoint_id).tree
            part = saved.get(DATALOADER) if isinstance(saved, dict) else None
            world = 1 if self._comm is None else self._comm.world
            if isinstance(part, PerRank) and part.world != world:
                logger.warning(
                    f"The checkpoint was saved by {part.world} data-parallel ranks, this job has {world}: "
                    "the dataloader's state is not loaded (torchtitan's dataloaders cannot be resharded), "
                    "it starts afresh."
                )
        report = LoadReport()
        if model_only:
            # A model-only checkpoint may be in another dtype (export_dtype): its tensors are cast to the model's
            # own (an object's state would take the stored dtype), then given to the model.
            model = self.states[MODEL]
            loaded = load(checkpoint_id, {MODEL: model.state_dict()}, strict=False, cast=True, report=report)
            model.load_state_dict(loaded[MODEL])
        else:
            load(checkpoint_id, tree, per_rank="keep", strict=not self.exclude_from_loading, report=report)
        if report.missing:
            raise CheckpointError(
                f"the checkpoint {checkpoint_id} lacks state the job loads: {', '.join(report.missing[:10])}"
                + (f" and {len(report.missing) - 10} more" if len(report.missing) > 10 else "")
                + " (exclude it with checkpoint.exclude_from_loading)"
            )

    # ------------------------------------------------------------------ steps on disk
    def _find_load_step(self, folder: str = "") -> int:
        """The highest step of ``folder`` (by default the checkpoint folder) with a committed checkpoint, else -1."""
        folder = folder or self.folder
        if not filesystem.isdir(folder):
            return -1
        steps = [
            int(m.group(1))
            for name in filesystem.listdir(folder)
            if (m := _STEP.fullmatch(name))
            and filesystem.isfile(filesystem.join(filesystem.join(folder, name), METADATA_FILE))
        ]
        return max(steps, default=-1)

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return str(filesystem.join(folder or self.folder, f"step-{step}"))

    def _close(self) -> None:
        if getattr(self, "save_future", None) is not None:
            self._wait_for_saving()
        thread = getattr(self, "purge_thread", None)
        if thread is not None and thread.is_alive():
            self.purge_queue.put(None)
            thread.join()


def checkpoint_config(config: BaseCheckpointManager.Config, **changes: Any) -> CheckpointManager.Config:
    """A :class:`CheckpointManager.Config` with the shared options of ``config`` (a trainer's
    ``checkpoint``, e.g. DCP's), changed by ``changes``.

    >>> from torchtitan.components.checkpointer import CheckpointManager as DCPManager
    >>> checkpoint_config(DCPManager.Config(interval=10, async_mode="async"), enable=True).async_mode
    'async'

    Raises:
      ValueError: the options are invalid (torchtitan's own checks, and ``initial_load_in_hf``).
    """
    shared = {f.name for f in fields(CheckpointManager.Config) if not f.name.startswith("_")}
    values = {f.name: getattr(config, f.name) for f in fields(config) if f.name in shared}
    return CheckpointManager.Config(**{**values, **changes})
