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

from ._api import CheckpointMetadata as CheckpointMetadata
from ._api import SaveHandle as SaveHandle
from ._api import VerifyReport as VerifyReport
from ._api import async_save as async_save
from ._api import load as load
from ._api import load_slice as load_slice
from ._api import metadata as metadata
from ._api import save as save
from ._api import verify as verify
from ._dcp import import_dcp as import_dcp
from ._distributed import placements_from_spec as placements_from_spec
from ._distributed import spec_from_dtensor as spec_from_dtensor
from ._errors import CheckpointError as CheckpointError
from ._errors import LayoutError as LayoutError
from ._errors import MetadataError as MetadataError
from ._errors import NotCommittedError as NotCommittedError
from ._errors import TargetMismatchError as TargetMismatchError
from ._executor import ExecutorOptions as ExecutorOptions
from ._format import ArrayMeta as ArrayMeta
from ._format import Compression as Compression
from ._leaf import Abstract as Abstract
from ._leaf import ShardedLeaf as ShardedLeaf
from ._load import plan_load_of as plan_load
from ._location import Location as Location
from ._location import StorageOptions as StorageOptions
from ._manager import CheckpointManager as CheckpointManager
from ._monitor import Monitor as Monitor
from ._monitor import Span as Span
from ._region import Region as Region
from ._safetensors import export_safetensors as export_safetensors
from ._safetensors import import_safetensors as import_safetensors
from ._save import plan_save_of as plan_save
from ._sharding import ExplicitRegions as ExplicitRegions
from ._sharding import FlatRanges as FlatRanges
from ._sharding import Layout as Layout
from ._sharding import Mesh as Mesh
from ._sharding import Replicate as Replicate
from ._sharding import Shard as Shard
from ._sharding import ShardingSpec as ShardingSpec
from ._sharding import StridedShard as StridedShard
from ._tiered import TwoTierManager as TwoTierManager
from .plan import ChunkingOptions as ChunkingOptions
from .plan import LoadPlan as LoadPlan
from .plan import SavePlan as SavePlan

__version__ = "0.1.0"

__all__ = [
    "Abstract",
    "ArrayMeta",
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
    "Location",
    "Mesh",
    "MetadataError",
    "Monitor",
    "NotCommittedError",
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
