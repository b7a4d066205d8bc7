"""The only code that talks to other ranks: a typed :class:`Comm` over torch.distributed.

``Comm`` is the protocol the API needs (rank, world, gather to the coordinator, broadcast,
agreement on success or failure); :class:`DistComm` implements it on gloo groups of the
checkpoint's own (never the user's default group from background work), and
:func:`single_comm` is a world of one. It also translates DTensors to and from the
library's declarative specs, moves merge fragments and forwarded reads point to point,
and agrees on failures so no rank waits forever. What a rank receives does not grow with
the world size: layouts travel as 16-byte digests.
"""
