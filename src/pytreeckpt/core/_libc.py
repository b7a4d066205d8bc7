"""libc's functions on Linux, through ctypes, for the system calls Python does not wrap."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

__all__ = ["linux_libc"]


def linux_libc(name: str, restype: Any, argtypes: list[Any] | None = None) -> Any:
    """libc's function ``name``, typed (``errno`` kept for ``ctypes.get_errno``), on Linux; None elsewhere, or
    where libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        fn.argtypes = argtypes
    fn.restype = restype
    return fn
