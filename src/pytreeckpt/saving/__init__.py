"""The save pipeline, its stages in call order.

1. ``_describe``: the tree flattened and each leaf described by its kind
   (:mod:`pytreeckpt.leaves`), or a tree recognised from an earlier save (``_recall``);
   the ranks agree on the description (:mod:`pytreeckpt.distributed`); this rank's part
   is planned (:mod:`pytreeckpt.plan`).
2. ``_prepare``: each array's stored metadata, the document's size checked, the location
   checked writable: a :class:`SaveJob`.
3. ``_job``: (``async_save``) the snapshot staged and copied; the writes issued
   (:mod:`pytreeckpt.execute`); rank 0 commits the document (:mod:`pytreeckpt.storage`).
4. ``_handle``: ``async_save``'s writer thread and the :class:`SaveHandle` it returns.

``pytreeckpt.api`` builds a :class:`SaveRequest` and runs these.
"""

from ._describe import SAVE_PLANS, plan_state
from ._handle import SaveHandle, start
from ._job import SaveJob
from ._prepare import SaveRequest, array_bytes_bound, prepare

__all__ = ["SAVE_PLANS", "SaveHandle", "SaveJob", "SaveRequest", "array_bytes_bound", "plan_state", "prepare", "start"]
