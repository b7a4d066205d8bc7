"""torch's distributed state-dict helpers, for the models and optimizers of a tree (``leaves/_object.py``).

A model whose parameters are DTensors (FSDP2, TP), or any model once torch.distributed is
initialised, gives and takes its state, and its optimizer's, through
``torch.distributed.checkpoint.state_dict``: the state is then this rank's shards as
DTensors (an optimizer's keyed by parameter FQN), and a state of another layout is
resharded into them on load. Nothing here is imported until a model meets it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["model_state", "optimizer_state", "set_model_state", "set_optimizer_state", "uses_helpers"]


def uses_helpers(params: Iterable[Any]) -> bool:
    """Whether the state of a model (or optimizer) of these parameters goes through torch's distributed
    state-dict helpers: torch.distributed is initialised, or a parameter is a DTensor (a mesh of this rank alone)."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if dist.is_initialized():
        return True
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=True)


def model_state(model: nn.Module) -> dict[str, Any]:
    """``model``'s state dict as the helpers give it (this rank's shards, as DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``optimizer``'s state dict as the helpers give it: keyed by ``model``'s parameter FQNs (an optimizer
    that has not stepped yet is given its state first, by a step with zero gradients and learning rate)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(model, optimizer, options=_options()))


def set_model_state(model: nn.Module, state: Any) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options())


def set_optimizer_state(model: nn.Module, optimizer: Any, state: Any) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options())
