"""The snapshot's copy moves bits: every element type, any strides, NaN payloads and all.

``copy_into`` copies elements as integers of their size through torch. For any dtype and
any same-shaped views (strided, reversed, read-only sources), the destination's buffer
ends as numpy's own same-dtype assignment leaves it: the view bit for bit the source,
everything around it untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pytreeckpt.execute._staging import copy_into

DTYPES = [
    np.dtype(t)
    for t in (
        np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.uint8, np.uint16,
        np.int32, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128,
    )
]  # fmt: skip

View = Callable[[np.ndarray], np.ndarray]


@st.composite
def buffers(draw: st.DrawFn, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, View]:
    """Random bits in a buffer larger than ``shape``, and how to take a ``shape`` view of it
    (any step per dim, either direction)."""
    steps = [draw(st.sampled_from([1, 2, 3, -1, -2])) for _ in shape]
    full = tuple(max(1, n * abs(s)) for n, s in zip(shape, steps, strict=True))
    seed = draw(st.integers(0, 2**32 - 1))
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(full)) * dtype.itemsize, dtype=np.uint8)
    base = (raw % 2).astype(np.bool_).reshape(full) if dtype == np.bool_ else raw.view(dtype).reshape(full)

    def view(a: np.ndarray) -> np.ndarray:
        if not shape:
            return a[...]  # a 0-d view, not a scalar
        return a[tuple(slice(None, None, s) for s in steps)][tuple(slice(0, n) for n in shape)]

    return base, view


@settings(max_examples=200)
@given(st.data())
def test_copy_into_is_a_bit_exact_copy(data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES))
    shape = tuple(data.draw(st.lists(st.integers(0, 6), max_size=3)))
    src_base, src_view = data.draw(buffers(shape, dtype))
    dst_base, dst_view = data.draw(buffers(shape, dtype))
    src = src_view(src_base)
    if data.draw(st.booleans()):
        src.flags.writeable = False
    expected = dst_base.copy()
    dst_view(expected)[...] = src  # numpy's same-dtype assignment: the oracle
    copy_into(dst_view(dst_base), src)
    assert dst_base.tobytes() == expected.tobytes()
    assert dst_view(dst_base).tobytes() == src.tobytes()
