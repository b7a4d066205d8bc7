"""The functional entry points: ``save``, ``async_save``, ``plan_save`` (``_save``), ``load``, ``plan_load``,
``load_slice``, ``read_array``, ``metadata``, ``verify`` (``_load``), ``diff`` (``_diff``).

Each is a short function: it builds a request from its arguments (the process group
made a :class:`~pytreeckpt.distributed._comm.Comm`) and runs a pipeline: the save
pipeline (:mod:`pytreeckpt.saving`) or the load pipeline (:mod:`pytreeckpt.loading`).
"""

from ._diff import DiffReport as DiffReport
from ._diff import LeafDiff as LeafDiff
from ._diff import diff as diff
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
    "DiffReport",
    "LeafDiff",
    "LoadReport",
    "SaveHandle",
    "VerifyReport",
    "async_save",
    "diff",
    "load",
    "load_slice",
    "metadata",
    "read_array",
    "save",
    "verify",
]
