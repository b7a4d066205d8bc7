"""Reductions along the short rows of a box table (one row per box, one column per dim).

numpy reduces along a row of 2 to 4 elements one row at a time: ``(m).all(axis=1)`` over
16,384 rows of 2 takes 0.4 ms on this project's 2-core test machine, and a cold rank
plan at 16,384 ranks makes dozens of them. These do the same work a column at a time
(or, for a contiguous bool table of 1, 2, 4 or 8 columns, a row as one machine word), 10
to 100 times faster, with the results of the numpy reductions.
"""

from __future__ import annotations

import numpy as np

__all__ = ["rows_all", "rows_any", "rows_prod"]

# a contiguous bool row of d (0 or 1) bytes read as one unsigned word; all true: every byte 1
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ALL_ONES = {1: 0x01, 2: 0x0101, 4: 0x01010101, 8: 0x0101010101010101}


def rows_all(m: np.ndarray) -> np.ndarray:
    """``m.all(axis=1)`` for a 2-D bool array.

    >>> rows_all(np.array([[True, True], [True, False], [False, False]]))
    array([ True, False, False])
    >>> rows_all(np.zeros((2, 0), dtype=bool))
    array([ True,  True])
    """
    n, d = m.shape
    word = _WORD.get(d)
    if word is not None and m.dtype == np.bool_ and m.flags.c_contiguous:
        return m.view(word).reshape(n) == _ALL_ONES[d]  # type: ignore[no-any-return]
    out = np.ones(n, dtype=bool)
    for j in range(d):
        out &= m[:, j]
    return out


def rows_any(m: np.ndarray) -> np.ndarray:
    """``m.any(axis=1)`` for a 2-D bool array.

    >>> rows_any(np.array([[True, False], [False, False]]))
    array([ True, False])
    >>> rows_any(np.zeros((2, 0), dtype=bool))
    array([False, False])
    """
    n, d = m.shape
    word = _WORD.get(d)
    if word is not None and m.dtype == np.bool_ and m.flags.c_contiguous:
        return m.view(word).reshape(n) != 0  # type: ignore[no-any-return]
    out = np.zeros(n, dtype=bool)
    for j in range(d):
        out |= m[:, j]
    return out


def rows_prod(x: np.ndarray) -> np.ndarray:
    """``np.prod(x, axis=1)`` for a 2-D int64 array (1 for rows of no column).

    >>> rows_prod(np.array([[2, 3], [4, 0]]))
    array([6, 0])
    """
    n, d = x.shape
    if d == 0:
        return np.ones(n, dtype=np.int64)
    out = x[:, 0].astype(np.int64, copy=True)
    for j in range(1, d):
        out *= x[:, j]
    return out
