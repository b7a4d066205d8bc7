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
from pytreeckpt.distributed._dtensor import placements_from_spec as placements_from_spec
from pytreeckpt.distributed._dtensor import spec_from_dtensor as spec_from_dtensor
from pytreeckpt.execute._monitor import Monitor as Monitor
from pytreeckpt.execute._monitor import Span as Span
from pytreeckpt.format import ArrayMeta as ArrayMeta
from pytreeckpt.format import Compression as Compression
from pytreeckpt.interop._dcp import import_dcp as import_dcp
from pytreeckpt.interop._safetensors import export_safetensors as export_safetensors
from pytreeckpt.interop._safetensors import import_safetensors as import_safetensors
from pytreeckpt.manager._fallback import CheckpointDamageWarning as CheckpointDamageWarning
from pytreeckpt.manager._manager import CheckpointManager as CheckpointManager
from pytreeckpt.manager._tiered import TwoTierManager as TwoTierManager
from pytreeckpt.storage import ExecutorOptions as ExecutorOptions
from pytreeckpt.storage._location import Location as Location
from pytreeckpt.storage._location import StorageOptions as StorageOptions

from .plan import ChunkingOptions as ChunkingOptions
from .plan import LoadPlan as LoadPlan
from .plan import SavePlan as SavePlan

__version__ = "0.1.0"

__all__ = [
    "PER_RANK",
    "Abstract",
    "ArrayMeta",
    "CheckpointDamageWarning",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMetadata",
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
    "export_safetensors",
    "import_dcp",
    "import_safetensors",
    "load",
    "load_slice",
    "metadata",
    "placements_from_spec",
    "plan_load",
    "plan_save",
    "save",
    "spec_from_dtensor",
    "verify",
]
