"""Other formats in and out: safetensors export and import, and torch.distributed.checkpoint import.

DCP's own files are pickled: they are read here, and only here, by allowlist-only
unpicklers. Everything converts through the functional API.
"""
