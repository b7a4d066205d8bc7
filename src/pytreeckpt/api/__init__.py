"""The functional entry points: ``save``, ``async_save``, ``plan_save`` (``_save``), ``load``, ``plan_load``,
``load_slice``, ``read_array``, ``metadata``, ``verify`` (``_load``).

Each is a short function: it builds a request from its arguments (the process group
made a :class:`~pytreeckpt.distributed._comm.Comm`) and runs a pipeline: the save
pipeline (:mod:`pytreeckpt.saving`) or the load pipeline (:mod:`pytreeckpt.loading`).
"""

from ._load import CheckpointMetadata as CheckpointMetadata
from ._load import LoadReport as LoadReport
from ._load import VerifyReport as VerifyReport
from ._load import load as load
from ._load import load_slice as load_slice
from ._load import metadata as metadata
from ._load import read_array as read_array
from ._load import verify as verify
from ._save import SaveHandle as SaveHandle
from ._save import async_save as async_save
from ._save import save as save

__all__ = [
    "CheckpointMetadata",
    "LoadReport",
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
