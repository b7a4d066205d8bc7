"""Every array numpy or torch can hand us comes back equal, through every way of saving.

Leaves of every storable dtype, in either byte order, in any layout a caller may hold
(strided, reversed, transposed, Fortran order, expanded or broadcast with zero strides,
0-d, empty, read-only, conjugate and negative views), alone or as the shards of a
ShardedLeaf, are saved by ``save``, ``async_save``, ``async_save(snapshot="lazy")`` and an
incremental save (``chunk_hashes=True``, then ``base=``), and each checkpoint loads back
equal, bit for bit, in the machine's byte order. Chunks and staging pieces are kept tiny
so every path cuts, copies and reassembles its leaves.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pytreeckpt
from pytreeckpt import ChunkingOptions, ExecutorOptions, Location, Mesh, Shard, ShardedLeaf, ShardingSpec
from pytreeckpt import StorageOptions as Storage
from pytreeckpt.core._dtypes import _BY_NAME, _torch_tables

CHUNKING = ChunkingOptions(single_chunk_bytes=48, min_chunk_bytes=16, max_chunk_bytes=48)
EXECUTOR = ExecutorOptions(staging_bytes=256, staging_piece_bytes=64)

_NUMERIC = ["i2", "i4", "i8", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
NUMPY_DTYPES = [
    *(np.dtype(f"<{c}") for c in _NUMERIC),
    *(np.dtype(f">{c}") for c in _NUMERIC),
    *(np.dtype(c) for c in ("?", "i1", "u1")),
    *(np.dtype(getattr(ml_dtypes, d.name)) for d in _BY_NAME.values() if d.storage == d.name and d.name not in
      {np.dtype(c).name for c in (*_NUMERIC, "?", "i1", "u1")}),
]  # fmt: skip
TORCH_DTYPES = sorted(_torch_tables()[1], key=str)  # (every torch dtype with a DType)
_NIBBLES = ("int4", "uint4", "float4_e2m1fn")


def _random_bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def _base_numpy(seed: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Random bits (NaN payloads and all) of ``shape``; bool elements are 0 or 1."""
    n = int(np.prod(shape))
    raw = _random_bytes(seed, n * dtype.itemsize)
    if dtype.kind == "b":
        return (raw % 2).astype(np.bool_).reshape(shape)
    if dtype.name in _NIBBLES:  # 4-bit elements: a byte's low half
        raw &= 0x0F
    return raw.view(dtype).reshape(shape)


def _base_torch(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = int(np.prod(shape))
    raw = torch.from_numpy(_random_bytes(seed, n * dtype.itemsize))
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@st.composite
def views(draw: st.DrawFn, nd: int, negative: bool) -> tuple[list[int], list[int], list[int]]:
    """How to cut a view of ``nd`` dims from a larger base: base sizes, steps and final sizes."""
    sizes = [draw(st.integers(0, 4)) for _ in range(nd)]
    steps = [draw(st.sampled_from([1, 2, 3, -1, -2] if negative else [1, 2, 3])) for _ in range(nd)]
    base = [max(1, n * abs(s)) + draw(st.integers(0, 1)) for n, s in zip(sizes, steps, strict=True)]
    return base, steps, sizes


def _cut(a: Any, steps: list[int], sizes: list[int]) -> Any:
    """``a`` stepped (numpy may step backwards) then cut to ``sizes``; a 0-d ``a`` as a 0-d view."""
    if not steps:
        return a[...]
    return a[tuple(slice(None, None, s) for s in steps)][tuple(slice(0, n) for n in sizes)]


@st.composite
def numpy_leaves(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    nd = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    how = draw(st.sampled_from(["view", "fortran", "transpose", "broadcast"]))
    if how == "broadcast":  # zero strides, read-only
        small = [draw(st.integers(1, 3)) if draw(st.booleans()) else 1 for _ in range(nd)]
        wide = [n if n > 1 else draw(st.integers(0, 3)) for n in small]
        arr = np.broadcast_to(_base_numpy(seed, tuple(small), dtype), tuple(wide))
    else:
        base, steps, sizes = draw(views(nd, negative=True))
        arr = _cut(_base_numpy(seed, tuple(base), dtype), steps, sizes)
        if how == "fortran":
            arr = np.asfortranarray(arr)
        elif how == "transpose":
            arr = arr.transpose(tuple(draw(st.permutations(range(nd)))))
    if draw(st.booleans()) and arr.flags.writeable:
        arr.flags.writeable = False
    return arr


@st.composite
def torch_leaves(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    nd = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    kinds = ["view", "transpose", "expand"]
    if dtype.is_complex and dtype != torch.complex32:
        kinds.append("conj")
    if dtype in (torch.float32, torch.float64):
        kinds.append("neg")
    how = draw(st.sampled_from(kinds))
    if how == "expand":  # zero strides
        small = [draw(st.integers(1, 3)) if draw(st.booleans()) else 1 for _ in range(nd)]
        wide = [n if n > 1 else draw(st.integers(0, 3)) for n in small]
        return _base_torch(seed, tuple(small), dtype).expand(tuple(wide))
    base, steps, sizes = draw(views(nd, negative=False))
    if how == "neg":  # the imaginary part of a conjugate view: a tensor with its negative bit set
        cplx = torch.complex64 if dtype == torch.float32 else torch.complex128
        t = _cut(_base_torch(seed, tuple(base), cplx), steps, sizes).conj().imag
        assert t.is_neg()
        return t
    t = _cut(_base_torch(seed, tuple(base), dtype), steps, sizes)
    if how == "conj":
        t = t.conj()
        assert t.is_conj()
    elif how == "transpose":
        t = t.permute(tuple(draw(st.permutations(range(nd)))))
    return t


@st.composite
def sharded_leaves(draw: st.DrawFn) -> ShardedLeaf:
    """A ShardedLeaf whose shards are strided views (transposed storage) of the rank's data."""
    t = draw(torch_leaves())
    if t.dim() == 0:
        t = t.reshape(1)
    full = t.resolve_conj().resolve_neg().contiguous()
    leaf = ShardedLeaf.from_global(full, ShardingSpec(Mesh(2), [Shard(0)]))
    flip = tuple(reversed(range(t.dim())))
    shards = {r: s.permute(flip).contiguous().permute(flip) for r, s in leaf.shards.items()}
    return ShardedLeaf(leaf.shape, leaf.dtype, leaf.spec, shards)


trees = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d", "e"]),
    st.one_of(numpy_leaves(), torch_leaves(), sharded_leaves()),
    min_size=1,
    max_size=4,
)


def _expected(leaf: Any) -> Any:
    """What a leaf loads back as: numpy in native byte order, a full tensor with its bits applied."""
    if isinstance(leaf, np.ndarray):
        return np.array(leaf, dtype=leaf.dtype.newbyteorder("="), order="C")
    if isinstance(leaf, ShardedLeaf):
        return leaf.to_global()
    return leaf.resolve_conj().resolve_neg().contiguous()


def _bits(t: torch.Tensor) -> bytes:
    """The raw bytes of ``t`` in row-major order (a fresh copy: a size-1 dim may carry any stride)."""
    dense = torch.empty(tuple(t.shape), dtype=t.dtype).copy_(t)
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _check_equal(got: dict[str, Any], tree: dict[str, Any], how: str) -> None:
    assert list(got) == list(tree), how
    for k, leaf in tree.items():
        want = _expected(leaf)
        out = got[k]
        if isinstance(want, np.ndarray):
            assert isinstance(out, np.ndarray), (how, k)
            assert (out.dtype, out.shape) == (want.dtype, want.shape), (how, k, out.dtype, want.dtype)
            assert out.tobytes() == want.tobytes(), (how, k)
        else:
            if isinstance(leaf, ShardedLeaf):
                out = out.to_global() if isinstance(out, ShardedLeaf) else out
            assert isinstance(out, torch.Tensor), (how, k)
            assert (out.dtype, tuple(out.shape)) == (want.dtype, tuple(want.shape)), (how, k)
            assert _bits(out) == _bits(want), (how, k, leaf)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@settings(max_examples=max(10, settings.default.max_examples // 3))
@given(trees, st.booleans())
def test_every_leaf_comes_back_equal_through_every_save(tree: dict[str, Any], packed: bool) -> None:
    with tempfile.TemporaryDirectory() as d:

        def at(name: str) -> Location:
            return Location(Path(d) / name, Storage(pack_small_leaves=packed))

        opts = {"chunking": CHUNKING, "executor": EXECUTOR}
        pytreeckpt.save(at("save"), tree, **opts)
        pytreeckpt.async_save(at("async"), tree, **opts).wait()
        pytreeckpt.async_save(at("lazy"), tree, snapshot="lazy", **opts).wait()
        pytreeckpt.save(at("base"), tree, chunk_hashes=True, **opts)
        pytreeckpt.async_save(at("incremental"), tree, base=Path(d) / "base", **opts).wait()
        for how in ("save", "async", "lazy", "base", "incremental"):
            _check_equal(pytreeckpt.load(at(how)), tree, how)
