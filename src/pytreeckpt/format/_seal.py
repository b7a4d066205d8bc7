"""The document's own checksum: the member that ends it (:func:`seal_document`, :func:`unseal_document`),
and the check of its encoding (UTF-8, no byte order mark)."""

from __future__ import annotations

import re

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._errors import MetadataError

DOCUMENT_CRC32C = "document_crc32c"
_SEAL_OPEN = b',"document_crc32c":"'
SEAL_BYTES = len(_SEAL_OPEN) + 8 + 2
"""The bytes the document's checksum adds to it: ``,"document_crc32c":"<8 hex digits>"}`` in place of its ``}``."""
_SEAL = re.compile(rb',"document_crc32c":"([0-9a-f]{8})"\}\Z')
SEAL_FORM = _SEAL_OPEN.decode() + '<8 lowercase hex digits>"}'


def seal_document(document: bytes | bytearray) -> tuple[memoryview, bytes]:
    """The document as it is stored: its bytes up to its closing ``}``, and the member that ends it in
    their place, ``,"document_crc32c":"<crc32c of those bytes, 8 lowercase hex digits>"}`` (write one after
    the other: a document of 10^5 leaves is not copied to append 30 bytes).

    >>> body, tail = seal_document(b'{"a":1}')
    >>> bytes(body) + tail
    b'{"a":1,"document_crc32c":"149cdbb2"}'
    >>> unseal_document(bytes(body) + tail)
    True
    """
    view = memoryview(document)
    if not len(view) or view[-1] != ord("}"):
        raise ValueError("a metadata document is a JSON object: it ends with '}'")
    body = view[:-1]
    return body, b'%s%08x"}' % (_SEAL_OPEN, crc32c(body))


def unseal_document(raw: bytes | bytearray) -> bool:
    """Whether ``raw`` ends in its checksum (:func:`seal_document`), checked against the bytes before it:
    MetadataError if they differ. False for a document without one (written before it was recorded).

    Any change of one bit is refused: in the bytes the checksum covers, by the checksum; in the
    member itself, by the checksum (another hex digit), or by the parse (a document whose last
    member is not this exact form: it is not JSON, or has a key no document has, or a
    ``document_crc32c`` the parse refuses where this did not check it).
    """
    if len(raw) < SEAL_BYTES or raw[-2:] != b'"}':
        return False
    m = _SEAL.match(raw, len(raw) - SEAL_BYTES)
    if m is None:
        return False
    recorded = int(m.group(1), 16)
    found = crc32c(memoryview(raw)[: len(raw) - SEAL_BYTES])
    if found != recorded:
        raise MetadataError(
            f"the metadata document is damaged: its bytes have crc32c {found:08x}, its {DOCUMENT_CRC32C} "
            f"records {recorded:08x}"
        )
    return True


def check_encoding(raw: bytes | bytearray) -> None:
    """MetadataError unless ``raw`` is UTF-8 without a byte order mark, as the format says (json.loads
    would read UTF-16 and UTF-32 too, and skip a BOM)."""
    if raw[:3] == b"\xef\xbb\xbf":
        raise MetadataError("the metadata document starts with a UTF-8 byte order mark; the format is UTF-8 without")
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or raw[:4] == b"\x00\x00\xfe\xff":
        raise MetadataError("the metadata document starts with a UTF-16 or UTF-32 byte order mark; the format is UTF-8")
    nul = raw.find(b"\x00")  # (no JSON text in UTF-8 holds a NUL byte; UTF-16 and UTF-32 of ASCII do)
    if nul >= 0:
        raise MetadataError(
            f"the metadata document holds a NUL byte (at byte {nul}): it is not UTF-8 JSON (UTF-16 or UTF-32?); "
            f"the format is UTF-8"
        )
    if not raw.isascii():
        try:
            bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MetadataError(f"the metadata document is not UTF-8 (at byte {e.start}: {e.reason})") from None


# --------------------------------------------------------------------------- parsing
