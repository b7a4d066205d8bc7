"""A rank's own view of a tree, as the peer tier stores it, and a restored view put back into a target.

The peer tier stores on each node what the node's ranks hold, each rank's copy its own
(``PER_RANK``): a DTensor as its local shard, an object with ``state_dict()`` as that
state dict (its DTensors as their shards), everything else as it is. A restore reads a
rank's view back and gives each DTensor of the target its shard again (the target's
mesh and placements) and each object its state through ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from pytreeckpt.core._errors import TargetMismatchError
from pytreeckpt.distributed._peers import as_shard_of, is_dtensor

__all__ = ["local_view", "put_back"]


def _is_object(x: Any) -> bool:
    return (
        not isinstance(x, torch.Tensor)
        and callable(getattr(x, "state_dict", None))
        and callable(getattr(x, "load_state_dict", None))
    )


def _special(x: Any) -> bool:
    return is_dtensor(x) or _is_object(x)


def _local(x: Any) -> Any:
    if is_dtensor(x):
        return x.to_local()
    if _is_object(x):
        return local_view(x.state_dict())
    return x


def local_view(tree: Any) -> Any:
    """``tree`` as this rank holds it: DTensors as their local shards, objects as their state dicts."""
    return optree.tree_map(_local, tree, is_leaf=_special, none_is_leaf=True)


def _shard_of(t: Any, local: Any) -> Any:
    return as_shard_of(t, local) if isinstance(local, torch.Tensor) else local


def _one(t: Any, loaded: Any) -> Any:
    if is_dtensor(t):
        return _shard_of(t, loaded)
    if _is_object(t):
        try:  # the DTensors of its current state say where its shards go
            state = optree.tree_map(
                lambda c, v: _shard_of(c, v) if is_dtensor(c) else v,
                t.state_dict(),
                loaded,
                is_leaf=is_dtensor,
                none_is_leaf=True,
            )
        except ValueError:  # (an optimizer that has not stepped yet holds no state to match)
            state = loaded
        t.load_state_dict(state)
        return t
    if isinstance(t, torch.Tensor) and isinstance(loaded, torch.Tensor):
        return loaded.to(t.device)
    return loaded


def put_back(target: Any, loaded: Any) -> Any:
    """``loaded`` (a rank's view, read back) in the form of ``target``: its DTensors and objects given their state.

    Raises:
      TargetMismatchError: ``loaded`` does not have the structure of ``target``'s view.
    """
    if target is None:
        return loaded
    try:
        return optree.tree_map(_one, target, loaded, is_leaf=_special, none_is_leaf=True)
    except ValueError as e:
        raise TargetMismatchError(f"the target does not have the structure of the saved state: {e}") from e
