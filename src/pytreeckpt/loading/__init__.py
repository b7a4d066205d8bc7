"""The load pipeline, its stages in call order.

1. ``_open``: the location opened, the metadata document read and parsed; a read that
   fails because the checkpoint was replaced under it starts again.
2. ``_match``: (rank 0 reads the document and sends it on) the target matched against
   the stored leaves, each target leaf's kind (:mod:`pytreeckpt.leaves`) giving where its
   data goes.
3. ``_run``: the ranks agree on the target's layouts, this rank's reads are planned
   along the stored chunks, read into the destinations, and the result leaves made.

``_inspect`` holds the read-only calls' stages: ``metadata``, ``verify``, a box of one
array. ``pytreeckpt.api`` builds a :class:`LoadRequest` and runs these.
"""

from typing import TYPE_CHECKING

from pytreeckpt.core._lazy import lazy_exports

if TYPE_CHECKING:
    from ._inspect import CheckpointMetadata, VerifyReport, inspect, read_region, region_of, verify_once
    from ._match import LoadRequest
    from ._open import again_if_replaced, open_checkpoint
    from ._report import LoadReport
    from ._run import LOAD_PLANS, load_once

# Each name imported on first use (``core._lazy``): the command line reads metadata and verifies
# through ``_inspect`` and ``_open`` without importing torch, which ``_match`` and ``_run`` need.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CheckpointMetadata": "._inspect",
        "VerifyReport": "._inspect",
        "inspect": "._inspect",
        "read_region": "._inspect",
        "region_of": "._inspect",
        "verify_once": "._inspect",
        "LoadRequest": "._match",
        "again_if_replaced": "._open",
        "open_checkpoint": "._open",
        "LoadReport": "._report",
        "LOAD_PLANS": "._run",
        "load_once": "._run",
    },
)

__all__ = [
    "LOAD_PLANS",
    "CheckpointMetadata",
    "LoadReport",
    "LoadRequest",
    "VerifyReport",
    "again_if_replaced",
    "inspect",
    "load_once",
    "open_checkpoint",
    "read_region",
    "region_of",
    "verify_once",
]
