"""The functional API, re-exported: ``save``/``async_save`` live in ``_save``, ``load`` and friends in ``_load``."""

from __future__ import annotations

from ._load import CheckpointMetadata as CheckpointMetadata
from ._load import VerifyReport as VerifyReport
from ._load import load as load
from ._load import load_slice as load_slice
from ._load import metadata as metadata
from ._load import read_array as read_array
from ._load import verify as verify
from ._save import SaveHandle as SaveHandle
from ._save import async_save as async_save
from ._save import save as save
from ._shared import _comm as _comm
from ._shared import _is_leaf as _is_leaf
from ._shared import _is_value as _is_value

__all__ = [
    "CheckpointMetadata",
    "SaveHandle",
    "VerifyReport",
    "async_save",
    "load",
    "load_slice",
    "metadata",
    "read_array",
    "save",
    "verify",
]
