"""The only code that talks to other ranks: a typed :class:`Comm` over torch.distributed.

``Comm`` is the protocol the pipelines need (rank, world, gather to the coordinator,
broadcast, agreement on success or failure); :class:`DistComm` implements it (``_comm``)
on gloo groups of the checkpoint's own (``_groups``: never the user's default group, so
background work never issues collectives on it), and also moves merge fragments and
forwarded reads point to point; :func:`distributed_comm` gives None for a world of one.
DTensors are translated to and from the library's declarative specs in ``_dtensor``.
Ranks agree on failures so no rank waits forever, and on what they save or load
(``_agree``). What a rank receives does not grow with the world size: ranks compare 16-byte
digests of their layouts with rank 0's.
"""
