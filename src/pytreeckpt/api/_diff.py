"""``diff``: two checkpoints compared leaf by leaf, a chunk at a time (:mod:`pytreeckpt.loading._diff`)."""

from __future__ import annotations

from pytreeckpt.loading._diff import DiffReport, LeafDiff, diff_checkpoints
from pytreeckpt.storage import ExecutorOptions
from pytreeckpt.storage._location import Where

from ._args import check_args

__all__ = ["DiffReport", "LeafDiff", "diff"]


def diff(a: Where, b: Where, *, executor: ExecutorOptions | None = None) -> DiffReport:
    """Compare two committed checkpoints leaf by leaf, by key path, reading a chunk at a time.

    Arrays of the same shape and dtype are read along the stored chunk grid (the finer of
    the two, when they are chunked differently), the same box from both, so the memory
    held is about twice the larger of 16 MiB and the largest chunk, whatever the
    checkpoints' sizes; every chunk is checked as a load checks it. Elements are compared
    bit for bit, and those that differ give the largest absolute and relative difference.
    Arrays of other shapes or dtypes are reported from the metadata, without reading
    them; plain Python values are compared as stored (type and value). A checkpoint
    replaced while it is read is read again, as :func:`load` does.

    Raises:
      NotCommittedError: either path holds no committed checkpoint.
      CheckpointError: a chunk is damaged or missing (naming the leaf and the chunk).

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp()
    >>> pytreeckpt.save(d + "/a", {"w": torch.zeros(4), "step": 1})
    >>> pytreeckpt.save(d + "/b", {"w": torch.tensor([0.0, 0.5, 0.0, 0.0]), "step": 1})
    >>> report = pytreeckpt.diff(d + "/a", d + "/b")
    >>> report.equal, report["w"].status, report["w"].differing, report["w"].max_abs, report["step"].status
    (False, 'values', 1, 0.5, 'equal')
    """
    check_args("diff", executor=executor)
    return diff_checkpoints(a, b, executor)
