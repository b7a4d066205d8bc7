"""The entry points' arguments checked before any I/O: a wrong type or value is a TypeError or ValueError naming
the argument, what was given and what is taken (never an AttributeError from deep inside a save or load)."""

from __future__ import annotations

from typing import Any

from pytreeckpt.execute._monitor import Monitor
from pytreeckpt.loading import LoadReport
from pytreeckpt.plan import ChunkingOptions
from pytreeckpt.storage import ExecutorOptions

__all__ = ["check_args"]

_OPTIONAL = {"chunking": ChunkingOptions, "executor": ExecutorOptions, "monitor": Monitor, "report": LoadReport}


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_args(entry: str, **args: Any) -> None:
    """Check ``args`` of ``entry`` (its name, for the errors): each keyword is checked by the rule of its name.

    Raises:
      TypeError: an argument of another type than the entry takes.
      ValueError: an argument of the right type but a value the entry does not take.
    """
    for name, value in args.items():
        if name in _OPTIONAL:
            want = _OPTIONAL[name]
            if value is not None and not isinstance(value, want):
                a = "an" if want.__name__[0] in "AEIOU" else "a"
                raise TypeError(f"{entry}: {name} must be {a} {want.__name__} or None, found {_shown(value)}")
        elif name == "namespace":
            if not isinstance(value, str):
                raise TypeError(f"{entry}: namespace must be a str, found {_shown(value)}")
        elif type(value) is not bool:  # (the flags: overwrite, inplace, cast, strict, chunk_hashes)
            raise TypeError(f"{entry}: {name} must be True or False, found {_shown(value)}")
