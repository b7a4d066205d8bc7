"""Hypothesis strategies and a resharding check, to verify your own layouts.

These are the strategies pytreeckpt's own property tests use: meshes, placements,
shapes (zero-size and indivisible ones included), every kind of layout (mesh specs,
flat ranges, explicit boxes, with replication and, for load targets, gaps), every
stored dtype, tensors full of special values, and nested sharded trees.
:func:`check_reshard` saves a tree in one layout, loads it in another and checks
every element bit for bit. :class:`SimComm` is one rank of a simulated world, to see
the plan any rank of a job of any size would run, in one process.

They need the ``hypothesis`` package (the ``test`` extra, ``pip install
'pytreeckpt[test]'``); ``import pytreeckpt`` does not import it.

>>> import torch
>>> from pytreeckpt import FlatRanges, Mesh, Shard, ShardingSpec
>>> from pytreeckpt.testing import check_reshard
>>> state = {"w": torch.arange(12.0).reshape(4, 3), "step": 3}
>>> out = check_reshard(state, ShardingSpec(Mesh(2), [Shard(0)]), {"w": FlatRanges([(0, 5), (5, 12)]), "step": None})
>>> out["w"].shards[1]
tensor([ 5.,  6.,  7.,  8.,  9., 10., 11.])
>>> out["step"]
3

With hypothesis, the same check runs on random layouts:

>>> from hypothesis import given, settings, strategies as st
>>> from pytreeckpt.testing import specs
>>> @settings(max_examples=3, deadline=None, derandomize=True)
... @given(st.data())
... def test_reshard(data):
...     t = torch.arange(10, dtype=torch.int16)
...     check_reshard({"t": t}, data.draw(specs((10,))), data.draw(specs((10,), complete=False)))
>>> test_reshard()
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401  (the strategies' modules import it)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("pytreeckpt.testing needs hypothesis; install it with `pip install 'pytreeckpt[test]'`") from e

from pytreeckpt.testing._layouts import chunking_options, meshes, placements, shapes, specs
from pytreeckpt.testing._reshard import check_reshard
from pytreeckpt.testing._sim import SimComm
from pytreeckpt.testing._tensors import dtypes, tensors
from pytreeckpt.testing._trees import sharded_trees, target_specs

__all__ = [
    "SimComm",
    "check_reshard",
    "chunking_options",
    "dtypes",
    "meshes",
    "placements",
    "shapes",
    "sharded_trees",
    "specs",
    "target_specs",
    "tensors",
]
