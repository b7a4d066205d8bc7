"""Core: trees, boxes, chunk grids, specs, element types and errors; no I/O, no other ranks."""
