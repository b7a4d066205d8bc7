"""Planning: pure functions from layouts to save and load plans, as plain data.

One planner, columnar (numpy), used by ``save``, ``async_save`` and ``load`` at every
world size. In: each array's global shape, element size and spec, placed on world
ranks (:class:`ArraySpec`). Out: the writes or reads of one rank, or of every rank (a
process holding every rank's shards). Deterministic, so ranks agree on a plan without
shipping it; memoised per layout, so the layers of a model cost one computation; cached
per state (:class:`PlanCache`, held by its caller), so a save in the same layout as the
last costs a lookup. Nothing here does I/O, reads a clock, draws random numbers or talks
to other ranks. Its one state beyond a call is the bounded memos of ``_memos``, listed
there with what each holds and why: they change how long planning takes, never what it
returns (``clear_caches`` forgets them).

Modules, in call order: ``_types`` (specs and plans), ``_tables`` (a layout's pieces as
columns), ``_chunking`` (chunk shapes), ``_structure`` and ``_cells`` (a save's structure
per layout), ``_balance`` (handing out replicated work by bytes), ``_save`` (``plan_save``),
``_load`` (``plan_load``), ``_cache`` (``PlanCache``).
"""

from typing import TYPE_CHECKING

from pytreeckpt.core._lazy import lazy_exports

if TYPE_CHECKING:
    from ._cache import PlanCache as PlanCache
    from ._cache import spec_digest as spec_digest
    from ._cache import spec_plan_key as spec_plan_key
    from ._load import plan_load as plan_load
    from ._save import check_complete as check_complete
    from ._save import plan_save as plan_save
    from ._save import plan_whole as plan_whole
    from ._types import ArrayLoadPlan as ArrayLoadPlan
    from ._types import ArraySavePlan as ArraySavePlan
    from ._types import ArraySpec as ArraySpec
    from ._types import ChunkingOptions as ChunkingOptions
    from ._types import Fragment as Fragment
    from ._types import LoadPlan as LoadPlan
    from ._types import ReadOp as ReadOp
    from ._types import SavePlan as SavePlan
    from ._types import WriteOp as WriteOp
    from ._types import array_spec_of as array_spec_of

# Each name imported on first use (``core._lazy``): what the command line's ls, inspect and verify
# reach of this package imports no more than they need.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "PlanCache": "._cache",
        "spec_digest": "._cache",
        "spec_plan_key": "._cache",
        "plan_load": "._load",
        "check_complete": "._save",
        "plan_save": "._save",
        "plan_whole": "._save",
        "ArrayLoadPlan": "._types",
        "ArraySavePlan": "._types",
        "ArraySpec": "._types",
        "ChunkingOptions": "._types",
        "Fragment": "._types",
        "LoadPlan": "._types",
        "ReadOp": "._types",
        "SavePlan": "._types",
        "WriteOp": "._types",
        "array_spec_of": "._types",
    },
)

__all__ = [
    "ArrayLoadPlan",
    "ArraySavePlan",
    "ArraySpec",
    "ChunkingOptions",
    "Fragment",
    "LoadPlan",
    "PlanCache",
    "ReadOp",
    "SavePlan",
    "WriteOp",
    "array_spec_of",
    "check_complete",
    "clear_caches",
    "plan_load",
    "plan_save",
    "plan_whole",
    "spec_digest",
    "spec_plan_key",
]


def clear_caches() -> None:
    """Forget every memo of planning (``_memos``) and of the layouts it reads (``core._sharding``'s), as
    before a process's first plan: benchmarks time cold planning with this."""
    from pytreeckpt.core import _sharding

    from . import _memos

    _sharding._spec_intervals.cache_clear()
    _sharding._spec_pieces.cache_clear()
    _sharding._spec_local_shape.cache_clear()
    _memos.clear()
