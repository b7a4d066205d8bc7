"""Runs this rank's part of a plan: staging, then chunk reads and writes with bounded memory.

The bounded staging pool of an asynchronous save (``_staging``: ping-pong buffers,
device-to-host copies, with the memory they live in from ``_memory``), the pipeline that
copies pieces into it while earlier writes drain (``_pipeline``), the executor that chooses
each write's route and issues a plan's writes and reads as futures with a bound on the
bytes in flight, reads landing straight in destination memory (``_executor``), the
per-phase monitoring of saves and loads (``_monitor``), and the process's calls in flight
(``_calls``: the asynchronous save being written, the paused garbage collector). How a
leaf's memory is described is not here: each leaf kind does it (:mod:`pytreeckpt.leaves`).
"""
