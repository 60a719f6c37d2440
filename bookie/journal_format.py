"""Journal records and the replay decision table: pure (bytes in, records out, no I/O).

A journal is a sequence of segment files ``segment-<id:016x>.log``. Each segment starts with a
16-byte header (magic ``BKJS``, format version, segment id) and is followed by records::

    magic:u32 | body_length:u32 | crc32c:u32 | type:u8 | body (body_length bytes)

The CRC32C covers ``body_length``, ``type`` and the body, so a torn or corrupt record is caught
whatever part of it is damaged. Space after the last record is zeros (segments are preallocated).

Record bodies (all integers big-endian, signed 64-bit):

=============  =============================================================
ENTRY          ledger_id, entry_id, then the entry body exactly as received
MASTER_KEY     ledger_id, then the master key bytes
FENCE          ledger_id
EXPLICIT_LAC   ledger_id, lac, then the opaque LAC body from WRITE_LAC
=============  =============================================================

Replay decision table for the first record at offset ``p`` that does not decode (:func:`scan`):

=====================================================  ===========  ==============================
what follows ``p`` in the segment                      outcome      action at startup
=====================================================  ===========  ==============================
nothing (``p`` is the end of the file)                 CLEAN        append at ``p``
only zero bytes (preallocated, never written)          CLEAN        append at ``p``
bytes, but no valid record at any later offset         TORN         cut (zero) the tail, start
a valid record at some later offset                    CORRUPT      refuse to start (never skip)
=====================================================  ===========  ==============================

Across segments: only the last segment may end TORN; a TORN or CORRUPT segment followed by a
segment holding records is CORRUPT (a group that spans segments syncs the older one first, so a
crash cannot leave a hole before durable records).
"""

from __future__ import annotations

import enum
import mmap
import struct
from typing import NamedTuple

import crc32c

SEGMENT_MAGIC = b"BKJS"
SEGMENT_VERSION = 1
SEGMENT_HEADER = struct.Struct(">4sHxxQ")  # magic, version, padding, segment id
SEGMENT_HEADER_BYTES = SEGMENT_HEADER.size  # 16

RECORD_MAGIC = 0xB00C1E5A
_RECORD_MAGIC_BYTES = struct.pack(">I", RECORD_MAGIC)
RECORD_HEADER = struct.Struct(">IIIB")  # magic, body length, crc32c, type
RECORD_HEADER_BYTES = RECORD_HEADER.size  # 13
_LEN_TYPE = struct.Struct(">IB")

RECORD_BODY_BYTES_MAX = 16 * 1024 * 1024
"""No record body is larger: the biggest is an entry (a frame is at most 5 MiB by default, up to
this much by configuration). A length above this is damage, not a record to buffer."""

LEDGER = struct.Struct(">q")
LEDGER_ENTRY = struct.Struct(">qq")
ENTRY_PREFIX_BYTES = LEDGER_ENTRY.size


class RecordType(enum.IntEnum):
    ENTRY = 1
    MASTER_KEY = 2
    FENCE = 3
    EXPLICIT_LAC = 4


_TYPES = frozenset(int(t) for t in RecordType)


class JournalCorrupt(Exception):
    """The journal holds damage that replay must not paper over; the bookie refuses to start."""


class Position(NamedTuple):
    """A place in the journal: segment id and byte offset within it."""

    segment_id: int
    offset: int


class Record(NamedTuple):
    offset: int  # of the record header within its segment
    type: int
    body: memoryview
    length: int  # whole record, header included


class Tail(enum.Enum):
    CLEAN = "clean"
    TORN = "torn"
    CORRUPT = "corrupt"


class ScanResult(NamedTuple):
    records: list[Record]
    end: int  # offset just past the last valid record: where appends continue
    tail: Tail
    garbage_end: int  # offset just past the last non-zero byte at or after ``end``


def _crc(body: bytes | memoryview, record_type: int) -> int:
    return crc32c.crc32c(body, crc32c.crc32c(_LEN_TYPE.pack(len(body), record_type)))


def encode_record(record_type: int, body: bytes | memoryview) -> bytes:
    """One record, header and body, ready to append."""
    if len(body) > RECORD_BODY_BYTES_MAX:
        raise ValueError(f"record body of {len(body)} bytes exceeds {RECORD_BODY_BYTES_MAX}")
    header = RECORD_HEADER.pack(RECORD_MAGIC, len(body), _crc(body, record_type), record_type)
    return header + bytes(body)


def encode_entry(ledger_id: int, entry_id: int, entry_body: bytes | memoryview) -> bytes:
    return encode_record(RecordType.ENTRY, LEDGER_ENTRY.pack(ledger_id, entry_id) + bytes(entry_body))


_ENTRY_CRC_PREFIX = struct.Struct(">IBqq")  # body length, type, ledger id, entry id
_ENTRY_HEAD = struct.Struct(">IIIBqq")  # the record header followed by the ENTRY id prefix
_ENTRY = 1


def encode_entry_parts(ledger_id: int, entry_id: int, entry_body: bytes) -> tuple[bytes, bytes]:
    """An ENTRY record as (header and id prefix, body) so the hot path never copies the body:
    the journal joins a whole group's parts in one go. Same bytes as :func:`encode_entry`."""
    length = ENTRY_PREFIX_BYTES + len(entry_body)
    if length > RECORD_BODY_BYTES_MAX:
        raise ValueError(f"entry of {len(entry_body)} bytes exceeds the journal record maximum")
    crc = crc32c.crc32c(
        entry_body, crc32c.crc32c(_ENTRY_CRC_PREFIX.pack(length, _ENTRY, ledger_id, entry_id))
    )
    return _ENTRY_HEAD.pack(RECORD_MAGIC, length, crc, _ENTRY, ledger_id, entry_id), entry_body


def encode_master_key(ledger_id: int, key: bytes) -> bytes:
    return encode_record(RecordType.MASTER_KEY, LEDGER.pack(ledger_id) + key)


def encode_fence(ledger_id: int) -> bytes:
    return encode_record(RecordType.FENCE, LEDGER.pack(ledger_id))


def encode_explicit_lac(ledger_id: int, lac: int, lac_body: bytes) -> bytes:
    return encode_record(RecordType.EXPLICIT_LAC, LEDGER_ENTRY.pack(ledger_id, lac) + lac_body)


def encode_segment_header(segment_id: int) -> bytes:
    return SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, segment_id)


def check_segment_header(data: bytes | mmap.mmap, segment_id: int) -> bool:
    """True when ``data`` starts with a valid header for ``segment_id``; False when the header
    is missing or all zeros (a segment created but never written). Raises on a foreign header."""
    if len(data) < SEGMENT_HEADER_BYTES or not any(data[:SEGMENT_HEADER_BYTES]):
        return False
    magic, version, found_id = SEGMENT_HEADER.unpack_from(data, 0)
    if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION or found_id != segment_id:
        raise JournalCorrupt(
            f"segment {segment_id:016x}: bad header (magic={magic!r} version={version} id={found_id:x})"
        )
    return True


def decode_record_at(data: bytes | mmap.mmap, offset: int) -> Record | None:
    """The valid record at ``offset``, or None if the bytes there are not one."""
    if len(data) - offset < RECORD_HEADER_BYTES:
        return None
    magic, length, crc, record_type = RECORD_HEADER.unpack_from(data, offset)
    if magic != RECORD_MAGIC or length > RECORD_BODY_BYTES_MAX or record_type not in _TYPES:
        return None
    start = offset + RECORD_HEADER_BYTES
    end = start + length
    if end > len(data):
        return None
    body = memoryview(data)[start:end]
    if _crc(body, record_type) != crc:
        return None
    return Record(offset, record_type, body, RECORD_HEADER_BYTES + length)


Buffer = bytes | mmap.mmap
"""What a segment is scanned from: bytes in tests, a read-only mmap at startup (nothing copied)."""

_ZERO_SCAN_CHUNK_BYTES = 1 << 20


def find_valid_record(data: Buffer, start: int, end: int | None = None) -> int | None:
    """Offset of the first valid record in ``[start, end)`` (any byte alignment), or None."""
    stop = len(data) if end is None else end
    pos = data.find(_RECORD_MAGIC_BYTES, start, stop)
    while pos != -1:
        if decode_record_at(data, pos) is not None:
            return pos
        pos = data.find(_RECORD_MAGIC_BYTES, pos + 1, stop)
    return None


def _last_nonzero(data: Buffer, start: int) -> int:
    """Offset just past the last non-zero byte at or after ``start`` (``start`` if none)."""
    end = len(data)
    while end > start:
        chunk_start = max(start, end - _ZERO_SCAN_CHUNK_BYTES)
        stripped = data[chunk_start:end].rstrip(b"\x00")
        if stripped:
            return chunk_start + len(stripped)
        end = chunk_start
    return start


def is_all_zero(data: Buffer) -> bool:
    return _last_nonzero(data, 0) == 0


def scan(data: Buffer, start: int) -> ScanResult:
    """Decode every record of one segment from ``start`` and classify what ends them."""
    records: list[Record] = []
    pos = start
    while (record := decode_record_at(data, pos)) is not None:
        records.append(record)
        pos += record.length
    garbage_end = _last_nonzero(data, pos)
    if garbage_end == pos:
        return ScanResult(records, pos, Tail.CLEAN, pos)
    if find_valid_record(data, pos + 1, garbage_end) is not None:
        return ScanResult(records, pos, Tail.CORRUPT, garbage_end)
    return ScanResult(records, pos, Tail.TORN, garbage_end)


def parse_ledger_entry(body: memoryview) -> tuple[int, int]:
    ledger_id, entry_id = LEDGER_ENTRY.unpack_from(body, 0)
    return int(ledger_id), int(entry_id)


def parse_ledger(body: memoryview) -> int:
    return int(LEDGER.unpack_from(body, 0)[0])


def segment_name(segment_id: int) -> str:
    return f"segment-{segment_id:016x}.log"


def parse_segment_name(name: str) -> int | None:
    if not (name.startswith("segment-") and name.endswith(".log") and len(name) == 28):
        return None
    try:
        return int(name[8:24], 16)
    except ValueError:
        return None
