"""The stored form: the versioned metadata document and the zarr v3 metadata of each array.

Owns the names of a checkpoint's files and directories and the format's limits
(``_paths``), the document's model: each leaf as stored and each array's zarr v3
metadata (``_model``), where chunk checksums go (``_checksums``), how the document's text
is built (``_build``), its own checksum (``_seal``), and how it is parsed, every field
checked, with limits, before anything trusts it (``_parse``). Pure: it reads and writes
no files itself.

The metadata document (format version 1 to 3: a save writes 3 when some array is packed
in zip archives, 2 when some is packed in an OCDBT database, else 1)::

    {"format": "pytreeckpt", "version": 3,
     "tree": <structure>, "leaves": [<leaf>, ...], "user_metadata": {...},
     "checksums": {"path": "checksums/crc32c", "bytes": <size>},   (when some leaf's are kept there)
     "document_crc32c": "<8 hex digits>"}     (its last member; older documents have none)

Array leaves are ``{"kind": "array", "key", "container", "dtype", "storage_dtype",
"shape", "chunk_shape", "path", "layout", "chunk_crc32c" | "chunk_crc32c_at"}`` (and
``"compression"``, ``"chunk_hashes"``, ``"database"`` where they apply); plain Python
leaves are ``{"kind": "value", "key", "value"}``.
"""

from typing import TYPE_CHECKING

from pytreeckpt.core._lazy import lazy_exports

if TYPE_CHECKING:
    from pytreeckpt.format._build import DocumentHead as DocumentHead
    from pytreeckpt.format._build import SumsTemplate as SumsTemplate
    from pytreeckpt.format._build import array_leaf_heads as array_leaf_heads
    from pytreeckpt.format._build import array_leaf_texts as array_leaf_texts
    from pytreeckpt.format._build import build_document as build_document
    from pytreeckpt.format._checksums import ChecksumFile as ChecksumFile
    from pytreeckpt.format._checksums import crc32c_chars as crc32c_chars
    from pytreeckpt.format._checksums import place_checksums as place_checksums
    from pytreeckpt.format._model import ArrayMeta as ArrayMeta
    from pytreeckpt.format._model import CheckpointDoc as CheckpointDoc
    from pytreeckpt.format._model import Compression as Compression
    from pytreeckpt.format._model import ValueMeta as ValueMeta
    from pytreeckpt.format._model import chunk_count as chunk_count
    from pytreeckpt.format._model import plain_array_meta as plain_array_meta
    from pytreeckpt.format._model import zarr_metadata as zarr_metadata
    from pytreeckpt.format._parse import parse_document as parse_document
    from pytreeckpt.format._paths import ARCHIVE_DIR as ARCHIVE_DIR
    from pytreeckpt.format._paths import ARRAYS_DIR as ARRAYS_DIR
    from pytreeckpt.format._paths import CHECKSUMS_DIR as CHECKSUMS_DIR
    from pytreeckpt.format._paths import CHECKSUMS_FILE as CHECKSUMS_FILE
    from pytreeckpt.format._paths import FORMAT_NAME as FORMAT_NAME
    from pytreeckpt.format._paths import FORMAT_VERSION as FORMAT_VERSION
    from pytreeckpt.format._paths import LOCK_FILE as LOCK_FILE
    from pytreeckpt.format._paths import MAX_NDIM as MAX_NDIM
    from pytreeckpt.format._paths import MAX_PACKED_BYTES as MAX_PACKED_BYTES
    from pytreeckpt.format._paths import METADATA_FILE as METADATA_FILE
    from pytreeckpt.format._paths import PACKED_DIR as PACKED_DIR
    from pytreeckpt.format._paths import STEP_DIR as STEP_DIR
    from pytreeckpt.format._paths import STORED_DIRS as STORED_DIRS
    from pytreeckpt.format._paths import array_names as array_names
    from pytreeckpt.format._paths import generation_name as generation_name
    from pytreeckpt.format._paths import generation_of as generation_of
    from pytreeckpt.format._seal import SEAL_BYTES as SEAL_BYTES
    from pytreeckpt.format._seal import seal_document as seal_document

# Each name imported on first use (``core._lazy``): what the command line's ls, inspect and verify
# reach of this package imports no more than they need.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DocumentHead": "pytreeckpt.format._build",
        "SumsTemplate": "pytreeckpt.format._build",
        "array_leaf_heads": "pytreeckpt.format._build",
        "array_leaf_texts": "pytreeckpt.format._build",
        "build_document": "pytreeckpt.format._build",
        "ChecksumFile": "pytreeckpt.format._checksums",
        "crc32c_chars": "pytreeckpt.format._checksums",
        "place_checksums": "pytreeckpt.format._checksums",
        "ArrayMeta": "pytreeckpt.format._model",
        "CheckpointDoc": "pytreeckpt.format._model",
        "Compression": "pytreeckpt.format._model",
        "ValueMeta": "pytreeckpt.format._model",
        "chunk_count": "pytreeckpt.format._model",
        "plain_array_meta": "pytreeckpt.format._model",
        "zarr_metadata": "pytreeckpt.format._model",
        "parse_document": "pytreeckpt.format._parse",
        "ARCHIVE_DIR": "pytreeckpt.format._paths",
        "ARRAYS_DIR": "pytreeckpt.format._paths",
        "CHECKSUMS_DIR": "pytreeckpt.format._paths",
        "CHECKSUMS_FILE": "pytreeckpt.format._paths",
        "FORMAT_NAME": "pytreeckpt.format._paths",
        "FORMAT_VERSION": "pytreeckpt.format._paths",
        "LOCK_FILE": "pytreeckpt.format._paths",
        "MAX_NDIM": "pytreeckpt.format._paths",
        "MAX_PACKED_BYTES": "pytreeckpt.format._paths",
        "METADATA_FILE": "pytreeckpt.format._paths",
        "PACKED_DIR": "pytreeckpt.format._paths",
        "STEP_DIR": "pytreeckpt.format._paths",
        "STORED_DIRS": "pytreeckpt.format._paths",
        "array_names": "pytreeckpt.format._paths",
        "generation_name": "pytreeckpt.format._paths",
        "generation_of": "pytreeckpt.format._paths",
        "SEAL_BYTES": "pytreeckpt.format._seal",
        "seal_document": "pytreeckpt.format._seal",
    },
)

__all__ = [
    "ARCHIVE_DIR",
    "ARRAYS_DIR",
    "CHECKSUMS_DIR",
    "CHECKSUMS_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MAX_NDIM",
    "MAX_PACKED_BYTES",
    "METADATA_FILE",
    "PACKED_DIR",
    "SEAL_BYTES",
    "STEP_DIR",
    "STORED_DIRS",
    "ArrayMeta",
    "CheckpointDoc",
    "ChecksumFile",
    "Compression",
    "DocumentHead",
    "SumsTemplate",
    "ValueMeta",
    "array_leaf_heads",
    "array_leaf_texts",
    "array_names",
    "build_document",
    "chunk_count",
    "crc32c_chars",
    "generation_name",
    "generation_of",
    "parse_document",
    "place_checksums",
    "plain_array_meta",
    "seal_document",
    "zarr_metadata",
]
