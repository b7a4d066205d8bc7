"""Leaf kinds: one handler per kind of leaf, behind the one registry every dispatch on a leaf's kind uses.

A kind (:class:`LeafKind`) says how a save describes such a leaf (``describe``: its
layout and the getters of its pieces, or an inline value's entry), where a load's reads
for such a target land (``destination``) and what ``metadata`` shows for a stored leaf it
loads as (``abstract``). :data:`KINDS` holds the library's kinds, asked in this order:

=============  ==============================================  ===============
kind           leaves                                          module
=============  ==============================================  ===============
``dtensor``    torch.distributed DTensors                      ``_dtensor``
``sharded``    :class:`ShardedLeaf`                            ``_sharded``
``abstract``   :class:`Abstract`                               ``_sharded``
``tensor``     torch tensors and Parameters                    ``_whole``
``as_stored``  ``AS_STORED``: a target leaf loaded as stored   ``_object``
``module``     ``nn.Module`` (a subtree: its state dict)       ``_object``
``optimizer``  ``torch.optim.Optimizer`` (likewise)             ``_object``
``stateful``   other objects with ``state_dict()`` and         ``_object``
               ``load_state_dict()`` (likewise)
``numpy``      numpy arrays and scalars (and any other leaf)   ``_whole``
``value``      bool, int, float, str, None, their enums        ``_value``
=============  ==============================================  ===============

Objects (the ``module``, ``optimizer`` and ``stateful`` kinds) are leaves of a tree as the
user gives it; a save and a load put their state dicts in their place before describing
or matching (:func:`expand_save`, :func:`expand_target`) and restore them after a load
(:meth:`Objects.restore`).

A new kind of leaf is a new :class:`LeafKind` registered here; nothing else dispatches
on a leaf's type. Building a kind's result is this package's; talking to other ranks,
reading and writing are the layers' below.
"""

from typing import Any

from ._dests import small_result
from ._dtensor import DTensorKind
from ._kind import KINDS, SINGLE, ArrayIn, Buffers, Describing, Dest, LeafKind, Matching, Registry, span
from ._object import (
    AS_STORED,
    AsStoredKind,
    ModuleKind,
    ObjectKind,
    Objects,
    OptimizerKind,
    StatefulKind,
    expand_save,
    expand_target,
)
from ._sharded import AbstractKind, ShardedKind
from ._sources import plain_data
from ._value import ValueKind, value_entry
from ._whole import PLAIN, NumpyKind, TensorKind, plain_in

KINDS.register(DTensorKind())  # (a torch.Tensor subclass: before the tensor kind)
KINDS.register(ShardedKind())
KINDS.register(AbstractKind())
KINDS.register(TensorKind())
KINDS.register(AsStoredKind())
KINDS.register(ModuleKind())
KINDS.register(OptimizerKind())
KINDS.register(StatefulKind())  # (after the modules and optimizers, which have state_dict too)
KINDS.register(NumpyKind(), fallback=True)  # (numpy scalars subclass float: before the values)
KINDS.register(ValueKind(), value=True)


is_leaf = KINDS.is_leaf  # whether x is a leaf of some kind (what flattening a tree stops at)


def is_value(x: Any) -> bool:
    """Whether ``x`` is a plain Python leaf, stored inline."""
    return isinstance(KINDS.of(x), ValueKind)


__all__ = [
    "AS_STORED",
    "KINDS",
    "PLAIN",
    "SINGLE",
    "ArrayIn",
    "Buffers",
    "Describing",
    "Dest",
    "LeafKind",
    "Matching",
    "ObjectKind",
    "Objects",
    "Registry",
    "expand_save",
    "expand_target",
    "is_leaf",
    "is_value",
    "plain_data",
    "plain_in",
    "small_result",
    "span",
    "value_entry",
]
