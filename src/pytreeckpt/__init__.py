"""pytreeckpt: functional pytree checkpointing for PyTorch, on TensorStore and zarr v3.

>>> import tempfile, torch, pytreeckpt
>>> from pytreeckpt import Mesh, Shard, ShardingSpec, ShardedLeaf, Abstract
>>> d = tempfile.mkdtemp() + "/ckpt"
>>> w = torch.arange(12.0).reshape(4, 3)
>>> pytreeckpt.save(d, {"w": ShardedLeaf.from_global(w, ShardingSpec(Mesh(2), [Shard(0)]))})
>>> new = pytreeckpt.load(d, {"w": Abstract((4, 3), torch.float32, ShardingSpec(Mesh(3), [Shard(1)]))})
>>> new["w"].shards[2]
tensor([[ 2.],
        [ 5.],
        [ 8.],
        [11.]])
"""

# The public names are imported on first use (PEP 562), so that ``import pytreeckpt`` (and the
# command line's ``ls``, ``inspect`` and ``verify``, which need no torch) stays fast; ``from
# pytreeckpt import save`` and ``pytreeckpt.save`` import what ``save`` needs, as before.

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytreeckpt.api import CheckpointMetadata as CheckpointMetadata
    from pytreeckpt.api import LoadReport as LoadReport
    from pytreeckpt.api import SaveHandle as SaveHandle
    from pytreeckpt.api import VerifyReport as VerifyReport
    from pytreeckpt.api import async_save as async_save
    from pytreeckpt.api import load as load
    from pytreeckpt.api import load_slice as load_slice
    from pytreeckpt.api import metadata as metadata
    from pytreeckpt.api import save as save
    from pytreeckpt.api import verify as verify
    from pytreeckpt.api._load import plan_load_of as plan_load
    from pytreeckpt.api._save import plan_save_of as plan_save
    from pytreeckpt.core._errors import CheckpointError as CheckpointError
    from pytreeckpt.core._errors import CheckpointTimeoutError as CheckpointTimeoutError
    from pytreeckpt.core._errors import LayoutError as LayoutError
    from pytreeckpt.core._errors import MetadataError as MetadataError
    from pytreeckpt.core._errors import NotCommittedError as NotCommittedError
    from pytreeckpt.core._errors import PermissionDeniedError as PermissionDeniedError
    from pytreeckpt.core._errors import TargetMismatchError as TargetMismatchError
    from pytreeckpt.core._leaf import Abstract as Abstract
    from pytreeckpt.core._leaf import ShardedLeaf as ShardedLeaf
    from pytreeckpt.core._per_rank import PER_RANK as PER_RANK
    from pytreeckpt.core._per_rank import PerRank as PerRank
    from pytreeckpt.core._region import Region as Region
    from pytreeckpt.core._sharding import ExplicitRegions as ExplicitRegions
    from pytreeckpt.core._sharding import FlatRanges as FlatRanges
    from pytreeckpt.core._sharding import Layout as Layout
    from pytreeckpt.core._sharding import Mesh as Mesh
    from pytreeckpt.core._sharding import Replicate as Replicate
    from pytreeckpt.core._sharding import Shard as Shard
    from pytreeckpt.core._sharding import ShardingSpec as ShardingSpec
    from pytreeckpt.core._sharding import StridedShard as StridedShard
    from pytreeckpt.core._timeout import set_default_timeout as set_default_timeout
    from pytreeckpt.distributed._dtensor import placements_from_spec as placements_from_spec
    from pytreeckpt.distributed._dtensor import spec_from_dtensor as spec_from_dtensor
    from pytreeckpt.execute._monitor import Monitor as Monitor
    from pytreeckpt.execute._monitor import Span as Span
    from pytreeckpt.format import ArrayMeta as ArrayMeta
    from pytreeckpt.format import Compression as Compression
    from pytreeckpt.interop._dcp import import_dcp as import_dcp
    from pytreeckpt.interop._dcp_export import export_dcp as export_dcp
    from pytreeckpt.interop._safetensors import export_safetensors as export_safetensors
    from pytreeckpt.interop._safetensors import import_safetensors as import_safetensors
    from pytreeckpt.interop._st_load import load_safetensors as load_safetensors
    from pytreeckpt.manager._fallback import CheckpointDamageWarning as CheckpointDamageWarning
    from pytreeckpt.manager._manager import CheckpointManager as CheckpointManager
    from pytreeckpt.manager._manager import CheckpointSkippedWarning as CheckpointSkippedWarning
    from pytreeckpt.manager._peers import PeerTierManager as PeerTierManager
    from pytreeckpt.manager._tiered import TwoTierManager as TwoTierManager
    from pytreeckpt.plan import ChunkingOptions as ChunkingOptions
    from pytreeckpt.plan import LoadPlan as LoadPlan
    from pytreeckpt.plan import SavePlan as SavePlan
    from pytreeckpt.storage import ExecutorOptions as ExecutorOptions
    from pytreeckpt.storage._location import Location as Location
    from pytreeckpt.storage._location import StorageOptions as StorageOptions

__version__ = "0.1.0"

# public name -> (module, attribute there)
_EXPORTS: dict[str, tuple[str, str]] = {
    "CheckpointMetadata": ("pytreeckpt.api", "CheckpointMetadata"),
    "LoadReport": ("pytreeckpt.api", "LoadReport"),
    "SaveHandle": ("pytreeckpt.api", "SaveHandle"),
    "VerifyReport": ("pytreeckpt.api", "VerifyReport"),
    "async_save": ("pytreeckpt.api", "async_save"),
    "load": ("pytreeckpt.api", "load"),
    "load_slice": ("pytreeckpt.api", "load_slice"),
    "metadata": ("pytreeckpt.api", "metadata"),
    "save": ("pytreeckpt.api", "save"),
    "verify": ("pytreeckpt.api", "verify"),
    "plan_load": ("pytreeckpt.api._load", "plan_load_of"),
    "plan_save": ("pytreeckpt.api._save", "plan_save_of"),
    "CheckpointError": ("pytreeckpt.core._errors", "CheckpointError"),
    "CheckpointTimeoutError": ("pytreeckpt.core._errors", "CheckpointTimeoutError"),
    "set_default_timeout": ("pytreeckpt.core._timeout", "set_default_timeout"),
    "LayoutError": ("pytreeckpt.core._errors", "LayoutError"),
    "MetadataError": ("pytreeckpt.core._errors", "MetadataError"),
    "NotCommittedError": ("pytreeckpt.core._errors", "NotCommittedError"),
    "PermissionDeniedError": ("pytreeckpt.core._errors", "PermissionDeniedError"),
    "TargetMismatchError": ("pytreeckpt.core._errors", "TargetMismatchError"),
    "Abstract": ("pytreeckpt.core._leaf", "Abstract"),
    "ShardedLeaf": ("pytreeckpt.core._leaf", "ShardedLeaf"),
    "PER_RANK": ("pytreeckpt.core._per_rank", "PER_RANK"),
    "PerRank": ("pytreeckpt.core._per_rank", "PerRank"),
    "Region": ("pytreeckpt.core._region", "Region"),
    "ExplicitRegions": ("pytreeckpt.core._sharding", "ExplicitRegions"),
    "FlatRanges": ("pytreeckpt.core._sharding", "FlatRanges"),
    "Layout": ("pytreeckpt.core._sharding", "Layout"),
    "Mesh": ("pytreeckpt.core._sharding", "Mesh"),
    "Replicate": ("pytreeckpt.core._sharding", "Replicate"),
    "Shard": ("pytreeckpt.core._sharding", "Shard"),
    "ShardingSpec": ("pytreeckpt.core._sharding", "ShardingSpec"),
    "StridedShard": ("pytreeckpt.core._sharding", "StridedShard"),
    "placements_from_spec": ("pytreeckpt.distributed._dtensor", "placements_from_spec"),
    "spec_from_dtensor": ("pytreeckpt.distributed._dtensor", "spec_from_dtensor"),
    "Monitor": ("pytreeckpt.execute._monitor", "Monitor"),
    "Span": ("pytreeckpt.execute._monitor", "Span"),
    "ArrayMeta": ("pytreeckpt.format", "ArrayMeta"),
    "Compression": ("pytreeckpt.format", "Compression"),
    "import_dcp": ("pytreeckpt.interop._dcp", "import_dcp"),
    "export_dcp": ("pytreeckpt.interop._dcp_export", "export_dcp"),
    "export_safetensors": ("pytreeckpt.interop._safetensors", "export_safetensors"),
    "import_safetensors": ("pytreeckpt.interop._safetensors", "import_safetensors"),
    "load_safetensors": ("pytreeckpt.interop._st_load", "load_safetensors"),
    "CheckpointDamageWarning": ("pytreeckpt.manager._fallback", "CheckpointDamageWarning"),
    "CheckpointManager": ("pytreeckpt.manager._manager", "CheckpointManager"),
    "CheckpointSkippedWarning": ("pytreeckpt.manager._manager", "CheckpointSkippedWarning"),
    "PeerTierManager": ("pytreeckpt.manager._peers", "PeerTierManager"),
    "TwoTierManager": ("pytreeckpt.manager._tiered", "TwoTierManager"),
    "ExecutorOptions": ("pytreeckpt.storage", "ExecutorOptions"),
    "Location": ("pytreeckpt.storage._location", "Location"),
    "StorageOptions": ("pytreeckpt.storage._location", "StorageOptions"),
    "ChunkingOptions": ("pytreeckpt.plan", "ChunkingOptions"),
    "LoadPlan": ("pytreeckpt.plan", "LoadPlan"),
    "SavePlan": ("pytreeckpt.plan", "SavePlan"),
}

# The layers, reachable as attributes (``pytreeckpt.api``) as when this module imported them all.
_SUBPACKAGES = frozenset(
    (
        "api",
        "core",
        "distributed",
        "execute",
        "format",
        "interop",
        "leaves",
        "loading",
        "manager",
        "plan",
        "saving",
        "storage",
    )
)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # (resolved once: later lookups find it in the module)
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "PER_RANK",
    "Abstract",
    "ArrayMeta",
    "CheckpointDamageWarning",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMetadata",
    "CheckpointSkippedWarning",
    "CheckpointTimeoutError",
    "ChunkingOptions",
    "Compression",
    "ExecutorOptions",
    "ExplicitRegions",
    "FlatRanges",
    "Layout",
    "LayoutError",
    "LoadPlan",
    "LoadReport",
    "Location",
    "Mesh",
    "MetadataError",
    "Monitor",
    "NotCommittedError",
    "PeerTierManager",
    "PerRank",
    "PermissionDeniedError",
    "Region",
    "Replicate",
    "SaveHandle",
    "SavePlan",
    "Shard",
    "ShardedLeaf",
    "ShardingSpec",
    "Span",
    "StorageOptions",
    "StridedShard",
    "TargetMismatchError",
    "TwoTierManager",
    "VerifyReport",
    "async_save",
    "export_dcp",
    "export_safetensors",
    "import_dcp",
    "import_safetensors",
    "load",
    "load_safetensors",
    "load_slice",
    "metadata",
    "placements_from_spec",
    "plan_load",
    "plan_save",
    "save",
    "set_default_timeout",
    "spec_from_dtensor",
    "verify",
]
