"""``PytreeCheckpointIO`` and ``AsyncPytreeCheckpointIO``: Lightning's ``CheckpointIO`` on pytreeckpt."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optree
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

import pytreeckpt
from pytreeckpt import ChunkingOptions, ExecutorOptions, SaveHandle
from pytreeckpt.distributed._groups import own_group
from pytreeckpt.storage import Storage

from ._values import check_storable, registered, target_device

__all__ = ["AsyncPytreeCheckpointIO", "PytreeCheckpointIO"]

log = logging.getLogger(__name__)
_optree: Any = optree  # (its stubs type trees of the builtin containers only)

STORAGE_OPTIONS = ("compression", "chunking", "executor", "user_metadata")
"""The keys ``storage_options`` may have: the keyword arguments of :func:`pytreeckpt.save` they set."""


def _where(path: _PATH) -> str:
    return os.fspath(path)


def _local(where: str) -> Path | None:
    """The local path of ``where``, None for a URL of another scheme (``s3://``, ``memory://``)."""
    if "://" not in where:
        return Path(where)
    return Path(where.removeprefix("file://")) if where.startswith("file://") else None


class PytreeCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` writing each checkpoint as a pytreeckpt checkpoint directory.

    For ``Trainer(plugins=[PytreeCheckpointIO()])`` and ``Fabric(plugins=[PytreeCheckpointIO()])``.
    The path Lightning gives (``.../epoch=0-step=10.ckpt``, ``.../last.ckpt``, a URL) becomes
    the checkpoint's directory, so ``ModelCheckpoint`` lists, removes and resumes from
    (``ckpt_path="last"``) them as it does files. A checkpoint already at the path is
    replaced, as Lightning replaces its files. Which values are stored and how is said in
    :mod:`pytreeckpt.integrations.lightning._values`; ``LightningModule.load_from_checkpoint``
    reads files with torch's ``load``: load a directory with :meth:`load_checkpoint` or
    ``trainer.fit(..., ckpt_path=...)``.

    In a distributed job Lightning saves from global rank 0 alone, which writes the whole
    checkpoint by itself; every rank loads it (each rank reading its part once, the parts
    sent on to the others).

    Args:
      compression: what :func:`pytreeckpt.save` takes (``"zstd"``, a :class:`Compression`, None).
      chunking: how stored arrays are chunked.
      executor: concurrency of the I/O and staging memory.

    Per save, ``storage_options`` (``trainer.save_checkpoint(path, storage_options={...})``,
    ``fabric.save(path, state, storage_options=...)`` where the strategy passes them) is a
    dict with any of the keys ``compression``, ``chunking``, ``executor`` and
    ``user_metadata``, overriding those given here.
    """

    def __init__(
        self,
        *,
        compression: Any = None,
        chunking: ChunkingOptions | None = None,
        executor: ExecutorOptions | None = None,
    ) -> None:
        self._options: dict[str, Any] = {"compression": compression, "chunking": chunking, "executor": executor}

    def _save_kwargs(self, checkpoint: dict[str, Any], storage_options: Any) -> dict[str, Any]:
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(
                f"{type(self).__name__}: storage_options must be a dict of some of {list(STORAGE_OPTIONS)}, found "
                f"{type(storage_options).__qualname__}"
            )
        unknown = sorted(str(k) for k in storage_options or {} if k not in STORAGE_OPTIONS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: storage_options has {unknown}, which it does not take; it takes "
                f"{list(STORAGE_OPTIONS)} (the keyword arguments of pytreeckpt.save)"
            )
        check_storable(checkpoint)
        group = own_group()  # in a distributed job this rank saves alone, as Lightning has it
        options = {**self._options, **(storage_options or {})}
        return {**options, "overwrite": True, "namespace": registered(), "process_group": group}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Save Lightning's checkpoint dict as a checkpoint directory at ``path``, returning once it is committed.

        Args:
          checkpoint: the dict of the model's and the trainer's state Lightning made.
          path: the checkpoint's directory (Lightning's ``.ckpt`` name), or a URL.
          storage_options: None, or a dict of some of ``compression``, ``chunking``,
            ``executor``, ``user_metadata``.

        Raises:
          CheckpointError: naming the key, for a value it does not store (an
            ``nn.Module`` among the hyperparameters, a set, an arbitrary object); nothing
            is written.
          TypeError: ``storage_options`` is not such a dict.
        """
        pytreeckpt.save(_where(path), checkpoint, **self._save_kwargs(checkpoint, storage_options))
        log.debug(f"Saved checkpoint: {path}")

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path`` as the dict Lightning saved.

        Args:
          path: a checkpoint directory (or URL) this plugin wrote.
          map_location: where tensors go, as torch's ``load`` takes it (a device, its name,
            a dict from ``"cpu"``, a function of ``(storage, location)``); None leaves them
            in host memory, where they are read.
          weights_only: accepted for Lightning's sake and never needed: pytreeckpt stores
            no pickles, so a load runs no code whatever it says.

        Raises:
          FileNotFoundError: nothing is at ``path``.
          CheckpointError: ``path`` is a file (a ``torch.save`` checkpoint: load it with
            Lightning's ``TorchCheckpointIO``), or no committed checkpoint.
        """
        where = _where(path)
        local = _local(where)
        if local is not None and not local.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if local is not None and not local.is_dir():
            raise pytreeckpt.CheckpointError(
                f"{path} is a file, not a pytreeckpt checkpoint directory: it was written by another CheckpointIO "
                f"(Lightning's TorchCheckpointIO writes torch.save files); load it with that plugin"
            )
        checkpoint: dict[str, Any] = pytreeckpt.load(where, namespace=registered())
        device = target_device(map_location)
        if device is not None and device != torch.device("cpu"):
            checkpoint = _optree.tree_map(
                lambda x: x.to(device) if isinstance(x, torch.Tensor) else x,
                checkpoint,
                none_is_leaf=True,
                namespace=registered(),
            )
        return checkpoint

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the checkpoint at ``path``: its commit first, so no half checkpoint is left to resume from.

        A link (``ModelCheckpoint(save_last="link")``) or a file is removed itself, not
        what it points to; nothing at ``path`` is no error.
        """
        where = _where(path)
        local = _local(where)
        if local is not None and (local.is_symlink() or local.is_file()):
            local.unlink()
        elif local is None or local.is_dir():
            Storage(where).remove()
        else:
            return
        log.debug(f"Removed checkpoint: {path}")


class AsyncPytreeCheckpointIO(PytreeCheckpointIO):
    """:class:`PytreeCheckpointIO` with the writing behind the training loop (:func:`pytreeckpt.async_save`).

    ``save_checkpoint`` returns once the checkpoint's tensors are copied into staging
    memory (Lightning's ``AsyncCheckpointIO`` clones them on the caller's thread too);
    writing and the commit run on pytreeckpt's writer thread. At most one save is in
    flight: the next save, a load, the removal of the checkpoint being written, and
    ``teardown`` (at the end of ``fit``, ``validate``, ...) wait for it, and raise its error
    if it failed, as Lightning's ``AsyncCheckpointIO`` does.

    Args: those of :class:`PytreeCheckpointIO`.
    """

    _in_flight: tuple[str, SaveHandle] | None = None
    """The save being written, and its path (set on the instance by each save)."""

    def wait(self) -> None:
        """Wait for the save in flight, if any.

        Raises:
          CheckpointError: the save failed (nothing of it was committed).
        """
        if self._in_flight is not None:
            where, handle = self._in_flight
            self._in_flight = None
            handle.wait()
            log.debug(f"Saved checkpoint: {where}")

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Start saving ``checkpoint`` at ``path``, after the save in flight; returns once its tensors are copied.

        Raises:
          CheckpointError: the previous save failed, or (naming the key) a value it does
            not store; nothing of this one is written then.
          TypeError: ``storage_options`` is not a dict of the keys it takes.
        """
        self.wait()
        where = _where(path)
        kwargs = self._save_kwargs(checkpoint, storage_options)
        self._in_flight = (where, pytreeckpt.async_save(where, checkpoint, **kwargs))

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        return super().load_checkpoint(path, map_location, weights_only)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        if self._in_flight is not None and os.path.abspath(self._in_flight[0]) == os.path.abspath(_where(path)):
            self.wait()
        super().remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        """Wait for the save in flight (Lightning calls this at the end of each ``fit``, ``validate``, ...)."""
        self.wait()
