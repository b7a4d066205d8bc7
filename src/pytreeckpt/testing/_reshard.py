"""The resharding check: save a tree in one layout, load it in another, compare every element bit for bit."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pytreeckpt.api import async_save, load, save
from pytreeckpt.core._dtypes import dtype_of_torch
from pytreeckpt.core._keys import keystr
from pytreeckpt.core._leaf import Abstract, ShardedLeaf
from pytreeckpt.core._sharding import Layout
from pytreeckpt.core._tree import broadcast_prefix, flatten
from pytreeckpt.leaves import KINDS
from pytreeckpt.leaves import is_leaf as _is_leaf
from pytreeckpt.plan import ChunkingOptions


def _is_layout(x: Any) -> bool:
    return isinstance(x, Layout)


def _bits(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``t``'s elements, one row per element (NaNs compare equal to themselves)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().reshape(flat.numel(), t.dtype.itemsize)


def _describe(layout: Layout | None, full: str) -> str:
    return full if layout is None else repr(layout)


def _compare(
    key: str, have: torch.Tensor, want: torch.Tensor, saved: Layout | None, loaded: Layout | None, rank: int | None
) -> None:
    where = "" if rank is None else f" in rank {rank}'s shard"
    context = (
        f"leaf {key or '(root)'!r}: saved in layout {_describe(saved, 'unsharded')} and loaded in layout "
        f"{_describe(loaded, 'full tensor')}"
    )
    if have.dtype != want.dtype or tuple(have.shape) != tuple(want.shape):
        raise AssertionError(
            f"{context}: expected{where} shape {tuple(want.shape)} and dtype {want.dtype}, "
            f"loaded shape {tuple(have.shape)} and dtype {have.dtype}"
        )
    a, b = _bits(have), _bits(want)
    differ = (a != b).any(axis=1)
    if differ.any():
        first = int(np.flatnonzero(differ)[0])
        index = tuple(int(i) for i in np.unravel_index(first, tuple(want.shape))) if want.dim() else ()
        raise AssertionError(
            f"{context}: {int(differ.sum())} of {differ.size} elements differ{where}; the first at index {index}: "
            f"saved bits {bytes(b[first]).hex()}, loaded bits {bytes(a[first]).hex()}"
        )


def _same_value(want: Any, got: Any) -> bool:
    if type(want) is not type(got):
        return False
    if isinstance(want, float):
        return repr(want) == repr(got)  # NaN equals NaN, -0.0 differs from 0.0
    return bool(want == got)


def check_reshard(
    tree: Any,
    spec_a: Any,
    spec_b: Any,
    *,
    path: str | Path | None = None,
    chunking: ChunkingOptions | None = None,
    use_save_spec: bool = False,
    asynchronous: bool = False,
    namespace: str = "",
) -> Any:
    """Save ``tree`` in layout ``spec_a``, load it in layout ``spec_b``, and check every element bit for bit.

    Args:
      tree: a pytree whose array leaves are full (global) tensors or
        :class:`~pytreeckpt.ShardedLeaf`; other leaves are plain Python values.
      spec_a: the layouts to save from: a pytree prefix of ``tree`` whose leaves are
        layouts or None. A tensor under a layout is cut into a ShardedLeaf of that
        layout (every rank's shards); under None it is saved whole, and a ShardedLeaf
        in its own layout.
      spec_b: the layouts to load into, in the same form: an
        :class:`~pytreeckpt.Abstract` target with that layout, or a full tensor under None.
      path: the checkpoint directory (replaced if it holds one); by default a temporary
        directory, removed afterwards.
      chunking: chunking options of the save, e.g. tiny chunks so that chunks straddle
        shards and are merged.
      use_save_spec: pass ``spec_a`` as the ``spec`` argument of
        :func:`pytreeckpt.save`, with full tensors, instead of cutting ShardedLeafs.
      asynchronous: save with :func:`pytreeckpt.async_save` and wait.
      namespace: the optree namespace of custom pytree nodes in ``tree``.

    Returns:
      The loaded tree: ShardedLeaf leaves where ``spec_b`` gives a layout, full tensors
      elsewhere, Python values as stored.

    Raises:
      AssertionError: naming the leaf's key path and both layouts where a loaded value,
        shape, dtype or layout differs from the saved one.
    """
    leaves, paths, root = flatten(tree, _is_leaf, namespace=namespace)
    keys = [keystr(p) for p in paths]
    a_specs = broadcast_prefix(spec_a, root, _is_layout, len(leaves), namespace=namespace)
    b_specs = broadcast_prefix(spec_b, root, _is_layout, len(leaves), namespace=namespace)
    wants: list[torch.Tensor | None] = []
    saved_layouts: list[Layout | None] = []
    to_save: list[Any] = []
    save_specs: list[Layout | None] = []
    targets: list[Any] = []
    for key, leaf, a, b in zip(keys, leaves, a_specs, b_specs, strict=True):
        kind = KINDS.kind(leaf).name
        if kind == "value":
            wants.append(None)
            saved_layouts.append(None)
            to_save.append(leaf)
            save_specs.append(None)
            targets.append(leaf)
            continue
        if kind == "sharded":
            full = leaf.to_global()
        elif kind in ("tensor", "dtensor"):
            full = leaf
        else:
            raise TypeError(
                f"check_reshard: leaf {key or '(root)'!r} is a {type(leaf).__name__}; leaves are tensors, "
                f"ShardedLeaf or plain Python values"
            )
        dtype_of_torch(full.dtype)
        wants.append(full)
        saved_layouts.append(a if a is not None else leaf.spec if kind == "sharded" else None)
        if a is None:
            to_save.append(leaf)
            save_specs.append(None)
        elif use_save_spec:
            to_save.append(full)
            save_specs.append(a)
        else:
            to_save.append(ShardedLeaf.from_global(full, a))
            save_specs.append(None)
        targets.append(Abstract(tuple(full.shape), full.dtype, b))

    def roundtrip(where: Path) -> Any:
        state = root.unflatten(to_save)
        spec = root.unflatten(save_specs) if use_save_spec else None
        if asynchronous:
            async_save(where, state, spec, chunking=chunking, overwrite=True, namespace=namespace).wait()
        else:
            save(where, state, spec, chunking=chunking, overwrite=True, namespace=namespace)
        return load(where, root.unflatten(targets), namespace=namespace)

    if path is None:
        with tempfile.TemporaryDirectory(prefix="pytreeckpt-check-") as d:
            out = roundtrip(Path(d) / "ckpt")
    else:
        out = roundtrip(Path(path))
    _check_loaded(out, paths, keys, leaves, wants, saved_layouts, b_specs, namespace)
    return out


def _check_loaded(
    out: Any,
    paths: list[Any],
    keys: list[str],
    leaves: list[Any],
    wants: list[torch.Tensor | None],
    saved_layouts: list[Layout | None],
    b_specs: list[Any],
    namespace: str,
) -> None:
    got_leaves, got_paths, _ = flatten(out, _is_leaf, namespace=namespace)
    if got_paths != paths:
        raise AssertionError(
            f"the loaded tree has leaves {[keystr(p) for p in got_paths]}, the saved one {[keystr(p) for p in paths]}"
        )
    for key, leaf, want, got, a, b in zip(keys, leaves, wants, got_leaves, saved_layouts, b_specs, strict=True):
        if want is None:
            if not _same_value(leaf, got):
                raise AssertionError(f"leaf {key or '(root)'!r}: saved the value {leaf!r}, loaded {got!r}")
            continue
        if b is None:
            if not isinstance(got, torch.Tensor):
                raise AssertionError(f"leaf {key or '(root)'!r}: expected a full tensor, loaded {type(got).__name__}")
            _compare(key, got, want, a, b, None)
            continue
        if not isinstance(got, ShardedLeaf) or got.spec != b or set(got.shards) != set(range(b.world_size)):
            raise AssertionError(
                f"leaf {key or '(root)'!r}: expected a ShardedLeaf in layout {b!r} holding all {b.world_size} ranks, "
                f"loaded {got!r}"
            )
        expected = ShardedLeaf.from_global(want, b)
        for rank in range(b.world_size):
            _compare(key, got.shards[rank], expected.shards[rank], a, b, rank)
