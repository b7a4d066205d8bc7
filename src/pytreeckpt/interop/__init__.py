"""Other formats in and out: safetensors export and import, torch.distributed.checkpoint import and export.

DCP's own files are pickled: they are read here, and only here, by allowlist-only
unpicklers. Everything converts through the functional API.
"""
