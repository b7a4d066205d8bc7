"""The stored form: the versioned metadata document and the zarr v3 metadata of each array.

Owns the schema of ``metadata.json`` (the tree's structure as JSON, each leaf's key path,
shape, element type, layout, chunk grid, codecs, chunk checksums and Python values), how
it is built and parsed (every field checked, with limits, before anything trusts it), the
names of the files and directories of a checkpoint, and the zarr v3 array metadata any
TensorStore or zarr reader opens. Pure: it reads and writes no files itself.
"""
