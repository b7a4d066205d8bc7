"""The names of a checkpoint's files and directories, the format's name and version, and its limits.

A checkpoint is a directory::

    pytreeckpt.json          the metadata document; written last, atomically: the commit
    arrays/<name>/zarr.json  one zarr v3 array per tensor leaf, of its global shape
    arrays/<name>/c/...      its chunks
    ocdbt/<rank>/            small arrays packed: an OCDBT database per writing rank,
                             holding arrays/<name>/... as keys
    packed/<rank>/<n>.zip    small arrays packed as zip archive entries (format version 3)
    checksums/crc32c         every chunk's crc32c, when there are too many to keep in the
                             document (each array's part named by the document)

A save replacing a committed checkpoint writes its arrays under names of the next
generation (:func:`generation_name`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pytreeckpt.core._errors import MetadataError

FORMAT_NAME = "pytreeckpt"
FORMAT_VERSION = 3
"""The newest version written: 3 when some array is packed in zip archives, 2 when some is
packed in an OCDBT database, else 1."""
METADATA_FILE = "pytreeckpt.json"
LOCK_FILE = ".pytreeckpt.lock"
STEP_DIR = re.compile(r"step_(0|[1-9][0-9]*)\Z")  # (match)
"""A CheckpointManager's step directory (or key prefix): exactly ``step_<n>`` as it writes it, ``n`` in ASCII
digits without a leading zero: ``step_007``, ``"step_5\\n"`` and other digits (Arabic-Indic ones) name no step."""
ARRAYS_DIR = "arrays"
PACKED_DIR = "ocdbt"
ARCHIVE_DIR = "packed"
"""Packed arrays as zip archive entries (format version 3): ``packed/<rank>/<n>.zip``."""
CHECKSUMS_DIR = "checksums"
CHECKSUMS_FILE = "checksums/crc32c"
"""Every chunk's crc32c, when a document would hold more of them than ``StorageOptions.max_inline_checksum_bytes``
(each array's part is named by its leaf's ``chunk_crc32c_at``); ``checksums/crc32c~g<n>`` in a later generation."""
STORED_DIRS = (ARRAYS_DIR, PACKED_DIR, ARCHIVE_DIR, CHECKSUMS_DIR)
"""The top-level directories (key prefixes) holding a checkpoint's arrays, databases and checksums."""
CONTAINERS = ("torch", "numpy")
MAX_METADATA_BYTES = 256 << 20
"""The default cap on the metadata document's size (``StorageOptions.max_metadata_bytes``)."""
PARSE_BYTES_PER_BYTE = 32
PARSE_BASE_BYTES = 64 << 20
"""The most memory reading a metadata document may take: ``PARSE_BYTES_PER_BYTE`` for each of its bytes and
``PARSE_BASE_BYTES``, bounded before the memory is taken (``format._parse``: its JSON values by counting them, its tree
nodes by a walk). What a save writes stays far within: a document of many array leaves takes 4 to 10 bytes a byte
(bound: 13 to 22), one of many Python values in small containers up to 20 (bound: 34, so past some 40 MB it is
refused). A document of empty objects, legal JSON, would take 29 (bound: 49: refused past 4 MB)."""
MAX_PACKED_BYTES = 64 << 20
"""A packed array is small: a document claiming a bigger one is refused before any allocation."""
MAX_NDIM = 32
"""The most dims a saved array may have: TensorStore's limit (``kMaxRank``) for the arrays it opens."""

# Patterns on names a document gives are applied with fullmatch (or end in \Z): "$" also
# matches before a final newline, and "packed/0\n" is no database.
DATABASE_PATTERN = re.compile(r"(ocdbt|packed)/(0|[1-9][0-9]{0,8})(~g[1-9][0-9]{0,8})?")  # (fullmatch)
CHECKSUMS_PATTERN = re.compile(r"checksums/crc32c(~g[1-9][0-9]{0,8})?")  # (fullmatch)
_GENERATION = re.compile(r"~g([1-9][0-9]{0,8})\Z")

# (fullmatch: no newline at the end either)
ARRAY_PATH_PATTERN = re.compile(r"arrays/[A-Za-z0-9_][A-Za-z0-9_.~-]{0,199}")


_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9_.-]")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,179}")  # (fullmatch: a key that is its own name)


def array_names(keys: Sequence[str]) -> list[str]:
    """Directory names for arrays: readable, safe on every file system, distinct ignoring case.

    >>> array_names(["model.w", "model/w", "", "Model.W"])
    ['model.w', 'model_w', 'root', 'Model.W~1']
    """
    seen: set[str] = set()
    out = []
    for key in keys:
        if _PLAIN_NAME.fullmatch(key):  # (most keys: a dotted path of plain words)
            base = key
        else:
            base = _UNSAFE_CHAR.sub("_", key)[:180] or "root"
            if base[0] in ".-":
                base = "_" + base
        name, n = base, 0
        while name.lower() in seen:
            n += 1
            name = f"{base}~{n}"
        seen.add(name.lower())
        out.append(name)
    return out


def generation_name(name: str, generation: int) -> str:
    """The name an array or database ``name`` gets in the save of ``generation``.

    The first save of a path writes generation 0, plain names; a save replacing a
    committed checkpoint writes the next generation beside it, under names the committed
    metadata does not use, and deletes the old arrays only once its own metadata is
    committed. Array names never contain ``~g`` otherwise (see :func:`array_names`).

    >>> generation_name("arrays/w", 0), generation_name("arrays/w", 3), generation_name("ocdbt/1", 2)
    ('arrays/w', 'arrays/w~g3', 'ocdbt/1~g2')
    >>> generation_of("arrays/w~1~g3"), generation_of("arrays/w~1")
    (3, 0)
    """
    return name if generation == 0 else f"{name}~g{generation}"


def generation_of(name: str) -> int:
    """The generation of a stored array or database name (0 for a plain name)."""
    m = _GENERATION.search(name)
    return int(m.group(1)) if m else 0


def check_relative_path(path: Any, key: str) -> str:
    """``path`` if it is a safe relative path below ``arrays/``; MetadataError otherwise."""
    if type(path) is not str:
        raise MetadataError(f"leaf {key!r}: array path must be a string, found {path!r}")
    if not ARRAY_PATH_PATTERN.fullmatch(path):
        raise MetadataError(
            f"leaf {key!r}: array path {path!r} is not of the form '{ARRAYS_DIR}/<name>' with a plain name; "
            f"a checkpoint may not point outside its directory"
        )
    return path


# --------------------------------------------------------------------------- the document's checksum
