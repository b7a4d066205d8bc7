"""The functional entry points: ``save``, ``async_save``, ``load``, ``load_slice``, ``metadata``, ``verify``.

Each call flattens the user's tree (:mod:`pytreeckpt.core`), describes every leaf by its
spec, agrees on those specs with the other ranks (:mod:`pytreeckpt.distributed`), plans
this rank's part (:mod:`pytreeckpt.plan`), snapshots the leaves (``_sources``) and runs the
plan (:mod:`pytreeckpt.execute`) against a location (:mod:`pytreeckpt.storage`); rank 0
assembles and commits the metadata document (:mod:`pytreeckpt.format`). ``save`` and
``async_save`` live in ``_save``, ``load`` and the read-only calls in ``_load``, what
both share across ranks in ``_shared``.
"""

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
