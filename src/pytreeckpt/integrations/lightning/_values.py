"""What the values of a Lightning checkpoint become, and how loaded tensors are placed.

A checkpoint dict from Lightning holds the model's state dict, the optimizers' and LR
schedulers' state dicts, the loops' progress, the callbacks' states (``ModelCheckpoint``'s
paths and scores, ``EarlyStopping``'s counters), the precision plugin's state, the
hyperparameters of ``save_hyperparameters()`` and whatever ``on_save_checkpoint`` adds.

- Tensors and numpy arrays are stored as arrays, bit for bit.
- int, float (NaN and infinities too), bool, str, None and enum members are stored inline.
- dicts (any of those keys: the optimizers' int keys, ``ModelCheckpoint``'s file paths),
  ``OrderedDict``, lists, tuples, namedtuples and dataclasses keep their structure and type.
- Lightning's ``AttributeDict``, ``argparse.Namespace``, ``pathlib`` paths and ``torch.dtype``
  values (often found in hyperparameters) come back as themselves: they are stored as the
  nodes of :data:`NAMESPACE`, their contents as plain values.
- Anything else (an ``nn.Module`` or a function passed to ``__init__``, a set, bytes, an
  object of the user's) is refused before anything is written, naming its key: pytreeckpt
  stores no pickles, so loading a checkpoint runs no code. Leave it out of the
  hyperparameters (``self.save_hyperparameters(ignore=[...])``: a module's weights are in the
  checkpoint's ``state_dict`` already), or store it as plain values.
"""

from __future__ import annotations

import argparse
import enum
import functools
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import optree
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.utilities.parsing import AttributeDict as PLAttributeDict

from pytreeckpt import CheckpointError

__all__ = ["NAMESPACE", "check_storable", "registered", "target_device"]

NAMESPACE = "pytreeckpt.integrations.lightning"
"""The optree namespace of a Lightning checkpoint's nodes beyond the builtin containers."""

_optree: Any = optree  # (its stubs type nodes as collections only: a path or a dtype is a node here)

_PLAIN = (torch.Tensor, np.ndarray, bool, int, float, str, enum.Enum)
_PATHS = (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath)


def _mapping_node(make: Callable[[dict[Any, Any]], Any], items: Callable[[Any], dict[Any, Any]]) -> tuple[Any, Any]:
    def flatten(m: Any) -> tuple[list[Any], list[Any], list[Any]]:
        d = items(m)
        return list(d.values()), list(d), list(d)

    def unflatten(keys: list[Any], values: Any) -> Any:
        return make(dict(zip(keys, values, strict=True)))

    return flatten, unflatten


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    return {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _dtype_of(name: str) -> torch.dtype:
    try:
        return _dtypes()[name]
    except KeyError:
        raise CheckpointError(f"the checkpoint holds a torch.dtype named {name!r}, which this torch has not") from None


@functools.cache
def registered() -> str:
    """Register the nodes of :data:`NAMESPACE` with optree (once per process) and return it."""
    for cls in (AttributeDict, PLAttributeDict):
        flatten, unflatten = _mapping_node(cls, dict)
        _optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)
    flatten, unflatten = _mapping_node(lambda d: argparse.Namespace(**d), vars)
    _optree.register_pytree_node(argparse.Namespace, flatten, unflatten, namespace=NAMESPACE)
    for path in _PATHS:
        _optree.register_pytree_node(
            path, lambda p: ((str(p),), None, ("path",)), functools.partial(_path, path), namespace=NAMESPACE
        )
    _optree.register_pytree_node(
        torch.dtype, lambda d: ((str(d),), None, ("dtype",)), lambda _, c: _dtype_of(c[0]), namespace=NAMESPACE
    )
    return NAMESPACE


def _path(cls: type[pathlib.PurePath], _meta: None, children: Any) -> pathlib.PurePath:
    return cls(*children)


def _hint(top: Any) -> str:
    if top in ("hyper_parameters", "datamodule_hyper_parameters"):
        return (
            "it is an argument saved by save_hyperparameters(): leave it out with "
            "self.save_hyperparameters(ignore=[...]) (a module's weights are in the checkpoint's 'state_dict' "
            "already), or pass it as plain values"
        )
    if top == "callbacks":
        return "a callback's state_dict() returned it: return plain values (tensors, numbers, strings, containers)"
    return "store it as tensors or plain values (numbers, strings, None, lists, tuples, dicts)"


def check_storable(checkpoint: Mapping[str, Any]) -> None:
    """Refuse, naming the key, any value of ``checkpoint`` that would not come back as it is.

    Raises:
      CheckpointError: a value of a type that is neither a tensor, a numpy array, a plain
        Python value nor a container (see the module's docstring); the error names its
        key path (``hyper_parameters.loss_fn``), its type and what to do.
    """
    paths, leaves, _ = _optree.tree_flatten_with_path(checkpoint, none_is_leaf=True, namespace=registered())
    for path, leaf in zip(paths, leaves, strict=True):
        if leaf is None or isinstance(leaf, _PLAIN):
            continue
        t = type(leaf)
        key = ".".join(str(k) for k in path)
        what = " (an object with state_dict(): it would come back as its state dict)" * hasattr(leaf, "state_dict")
        raise CheckpointError(
            f"the Lightning checkpoint's key {key!r} holds a {t.__module__}.{t.__qualname__}{what},"
            f" which PytreeCheckpointIO does not store: it stores tensors, numpy arrays, int, float, bool, str, None, "
            f"enum members, containers of those, AttributeDict, Namespace, paths and dtypes, and no pickles; "
            f"{_hint(path[0] if path else None)}"
        )


def target_device(map_location: Any) -> torch.device | None:
    """The device ``map_location`` puts a checkpoint's tensors on (stored from the host), None to leave them there.

    As torch's ``load`` takes it: a device or its name, a dict from the saved location
    (``"cpu"``) to another, or a function of ``(storage, location)`` that returns the
    storage to use (or None: the default).
    """
    if map_location is None:
        return None
    if isinstance(map_location, str | torch.device):
        return torch.device(map_location)
    if isinstance(map_location, Mapping):
        to = map_location.get("cpu")
        return None if to is None else torch.device(to)
    if callable(map_location):
        out = map_location(torch.empty(0).untyped_storage(), "cpu")
        return None if out is None else torch.device(out.device)
    raise TypeError(
        f"map_location must be a device, a device's name, a dict or a function, as torch's load takes it; found "
        f"{type(map_location).__qualname__}"
    )
