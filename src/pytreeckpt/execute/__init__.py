"""Runs this rank's part of a plan: staging, then chunk reads and writes with bounded memory.

``_sources`` is not here: the API snapshots leaves. This package owns the bounded staging
pool of an asynchronous save (``_staging``: ping-pong buffers, device-to-host copies), the
pipeline that copies pieces into it while earlier writes drain (``_pipeline``), the
executor that issues a plan's writes and reads as futures with a bound on the bytes in
flight, reads landing straight in destination memory (``_executor``), and the per-phase
monitoring of saves and loads (``_monitor``).
"""
