"""Hypothesis strategies of nested sharded trees and of load layouts for a tree."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from pytreeckpt.core._leaf import ShardedLeaf
from pytreeckpt.core._tree import flatten
from pytreeckpt.leaves import KINDS
from pytreeckpt.leaves import is_leaf as _is_leaf
from pytreeckpt.testing._layouts import shapes, specs
from pytreeckpt.testing._tensors import dtypes, tensors

_KEYS = st.one_of(
    st.text(alphabet="abcxyz_.0/ ", min_size=0, max_size=4),
    st.integers(-3, 12),
)
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN, infinities and -0.0 included
    st.text(max_size=8),
)


def sharded_trees(
    max_leaves: int = 5,
    *,
    max_side: int = 6,
    leaf_dtypes: st.SearchStrategy[torch.dtype] | None = None,
) -> st.SearchStrategy[Any]:
    """Nested trees of dicts, lists and tuples holding sharded leaves, tensors and Python values.

    Tensor leaves have random shapes and dtypes; a :class:`~pytreeckpt.ShardedLeaf`
    holds every rank's shards of a complete random layout (see :func:`specs`); Python
    leaves are None, bool, int (beyond 64 bits too), float (NaN included) and str. Dict
    keys are strings (with dots and slashes) and integers. The root is a container.

    Args:
      max_leaves: the most leaves.
      max_side: the largest side of a tensor.
      leaf_dtypes: the dtypes of tensor leaves (default: :func:`dtypes`, every stored dtype).

    Returns:
      A strategy of trees that :func:`pytreeckpt.save` takes as they are.
    """
    dtype_st = dtypes() if leaf_dtypes is None else leaf_dtypes

    @st.composite
    def array(draw: st.DrawFn) -> Any:
        shape = draw(shapes(max_dims=3, max_side=max_side))
        t = draw(tensors(shape, draw(dtype_st)))
        if draw(st.booleans()):
            return ShardedLeaf.from_global(t, draw(specs(shape)))
        return t

    leaf = st.one_of(array(), array(), _VALUES)  # mostly arrays

    def containers(kids: st.SearchStrategy[Any], min_size: int = 0) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.dictionaries(_KEYS, kids, min_size=min_size, max_size=3),
            st.lists(kids, min_size=min_size, max_size=3),
            st.lists(kids, min_size=min_size, max_size=3).map(tuple),
        )

    return containers(st.recursive(leaf, containers, max_leaves=max_leaves), min_size=1)


def target_specs(
    tree: Any, *, complete: bool = False, max_ranks: int = 8, namespace: str = ""
) -> st.SearchStrategy[Any]:
    """Load layouts for ``tree``: a tree of its structure with a layout or None per tensor leaf.

    Args:
      tree: a tree of tensors, :class:`~pytreeckpt.ShardedLeaf` and Python values.
      complete: layouts hold every element (False: they may leave gaps).
      max_ranks: the most ranks a layout spans.
      namespace: the optree namespace of custom pytree nodes in ``tree``.

    Returns:
      A strategy of spec trees, to pass as ``spec_a`` or ``spec_b`` of :func:`check_reshard`.
    """
    leaves, _, root = flatten(tree, _is_leaf, namespace=namespace)

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        out: list[Any] = []
        for leaf in leaves:
            if KINDS.kind(leaf).name in ("tensor", "dtensor", "sharded"):
                shape = tuple(leaf.shape)
                out.append(draw(st.one_of(st.none(), specs(shape, complete=complete, max_ranks=max_ranks))))
            else:
                out.append(None)
        return root.unflatten(out)

    return build()
