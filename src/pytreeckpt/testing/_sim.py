"""A simulated world of ranks that all hold the same state, to see any rank's plan in one process."""

from __future__ import annotations

from typing import Any


class SimComm:
    """One rank of a simulated world of ``world`` ranks that all hold the same state, for planning.

    Pass it as ``process_group`` to :func:`pytreeckpt.plan_save` or
    :func:`pytreeckpt.plan_load` to see the plan rank ``rank`` of a job of any size would
    run, in one process and without torch.distributed. The other ranks are simulated by
    what they would send when they describe the same state as this one: rank 0 gathers
    ``world`` copies of this rank's objects, and another rank receives from rank 0 the
    verdict that the ranks agree, or, in a load, the metadata document rank 0 read
    (``document``). Every object this rank receives is kept in ``received``, so a caller
    can measure it. Only planning is simulated: the data transfers of a save or load are
    not.

    >>> import torch, pytreeckpt
    >>> from pytreeckpt import Mesh, Shard, ShardedLeaf, ShardingSpec
    >>> spec = ShardingSpec(Mesh(4096), [Shard(0)])
    >>> leaf = ShardedLeaf((4096 * 256, 256), torch.float32, spec, {5: torch.zeros(256, 256)})
    >>> plan = pytreeckpt.plan_save({"w": leaf}, process_group=SimComm(5, 4096))
    >>> [(op.writer, op.region.offset) for op in plan.arrays[0].writes]
    [(5, (1280, 0))]
    """

    def __init__(self, rank: int, world: int, *, document: bytes | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not a rank of a world of {world}")
        self.rank, self.world = rank, world
        self.received: list[Any] = []
        self._from_coordinator: list[Any] = [] if document is None else [document]

    def gather(self, obj: Any, what: str = "") -> list[Any]:
        if self.rank != 0:
            return []
        self.received.extend([obj] * (self.world - 1))
        return [obj] * self.world

    def broadcast(self, obj: Any, src: int = 0, what: str = "", meet: bool = True) -> Any:
        if self.rank == src:
            return obj
        # What rank 0 sends when every rank holds the same state: the document it read, then "they agree" (None).
        answer = self._from_coordinator.pop(0) if self._from_coordinator and obj is None else None
        self.received.append(answer)
        return answer

    def agree(self, error: BaseException | None, what: str) -> None:
        if error is not None:
            raise error
