"""Journal records and the replay decision table: pure (bytes in, records out, no I/O).

A journal is a sequence of segment files ``segment-<id:016x>.log``. Each segment starts with a
24-byte header and is followed by groups::

    magic "BKJS" | version:u16 (4) | padding:u16 | segment_id:u64 | previous_end:u32 | crc32c:u32

``previous_end`` is where the segment before it ended (the end of its last group) when the writer
rolled into this one, 0 when there is none to check (segment 1; a segment whose predecessor a
restart found behind the checkpoint); the CRC32C covers the 20 bytes before it. A version 2 or 3
header is the first 16 bytes alone (no previous end). A group is what one ``pwrite`` + ``fdatasync``
of the journal writer puts in one segment: a GROUP header record, then the records appended
meanwhile. Every record, the group header included, is::

    magic:u32 | body_length:u32 | crc32c:u32 | type:u8 | body (body_length bytes)

The CRC32C covers ``body_length``, ``type`` and the body, so a torn or corrupt record is caught
whatever part of it is damaged; but for ENTRY records (type 7, format 3), whose CRC32C is the
body's alone: one C call per add on the bookie's loop instead of two and a pack of the prefix
(docs/benchmarks.md, issue 19). Nothing it leaves out goes unchecked: a changed type makes the other
rule apply (or is no type), a changed length checksums other bytes, either fails the check but for
the CRC's 2^-32 chance, as a changed body does; and the ids a read or replay takes are the body's
first 16 bytes, under the CRC. Space after the last group is zeros (segments are preallocated).

Format versions (the segment header's): 4 adds the previous end to the header (24 bytes; the
records are 3's), 3 writes ENTRY records of type 7, 2 wrote type 1. Records say their own kind, so a
segment of any version is read by the same decoder, and compaction's verbatim copies of type-1
records may lie in a later segment. A journal found ending in an
older segment goes on in the next one (``Recovered.start_format``): a segment never holds a record
its header's version does not know, so a bookie that reads only version 2 refuses a journal this
one wrote (``JournalFormatUnsupported``) rather than taking its records for damage.

Record bodies (all integers big-endian; ids signed 64-bit):

=============  =============================================================
GROUP          segment_id u64, offset u32 (where this header itself lies),
               length u32 (bytes of the group's records after this header)
ENTRY (7)      the entry body exactly as received; it starts with its ledger id
               and entry id (protocol/digest.py), which the add path checked
               against the request, so the record needs no copy of them
ENTRY_V2 (1)   ledger_id, entry_id, then the entry body exactly as received
               (format 2; still read, no longer written)
MASTER_KEY     ledger_id, then the master key bytes
FENCE          ledger_id
EXPLICIT_LAC   ledger_id, lac, then the opaque LAC body from WRITE_LAC
REKEY          ledger_id, then the master key bytes: the ledger's record so far
               was a squatter's (bookie/ledger_keys.py); replay starts it anew
=============  =============================================================

A group header names its own position: that is the group's sequence number (groups are totally
ordered by position, and it needs no state across restarts), and a header found at any other
place than the one it names is not a header. Its length gives the group's extent.

Why groups: the writer has at most one group in flight and writes the next only after the previous
``fdatasync`` returned. A process crash leaves the in-flight group as a prefix (bytes reach the page
cache in order); a power loss may leave **any subset of its pages** (zeroed or garbled holes, later
pages present while earlier ones are not). Either way only that final group is damaged, and none of
its records was acknowledged. Damage followed by a *later* group is different: that later group was
written after the damaged one was synced, so the damage hit acknowledged data.

Replay decision table (:func:`scan`, :func:`classify`). ``p`` is the end of the last whole group
(a group is whole when its header is valid and its records decode back to back and fill exactly
its extent); ``E`` the end of the extent of the group at ``p`` when its header is valid:

====================================================  ===========  ===================================
after ``p``                                           outcome      action at startup
====================================================  ===========  ===================================
nothing, or only zero bytes                           CLEAN        append at ``p``
bytes, and evidence of a later group: a valid         CORRUPT      refuse to start (never skip)
record at or after ``E``, or a group header (valid,
at the place it names) after ``p``
bytes, and no evidence of a later group               TORN         cut (zero) from ``p``: the whole
                                                                   final group goes, start
====================================================  ===========  ===================================

Across segments: only the last segment holding bytes may end TORN; a TORN or CORRUPT segment followed
by a segment holding any bytes is CORRUPT (a group that spans segments is written as one group per
segment and the writer syncs the older segment before writing the newer one, so power loss tears at
most the newer of them). Zeros are space never written only at the end of the journal:

- a segment holding nothing (zero length, or all zeros: created ahead of time) followed by a segment
  holding any bytes is CORRUPT: the writer writes a segment's header with its first group before a
  later segment gets a byte (it rolls only out of a segment holding a record), so it lost them all;
- a segment whose header records a ``previous_end`` (version 4, not 0) is the writer's word on where
  the segment before it ended: when that one is replayed, its whole groups must end exactly there,
  else CORRUPT (its last groups read back as zeros: a lost write, a zeroed extent, a truncation; they
  were synced, and acknowledged, before the roll that wrote the header). A restart that goes on just
  past a segment's header writes it again with the same previous end (replay's, :mod:`bookie.replay`).
  Before a version 2 or 3 segment (no previous end) zeros at a segment's end stay undetected.

A segment header that is zeros, not ours (magic), or of version 4 failing its CRC is a torn segment
start when nothing in the segment or after it says otherwise; a header with our magic but a format
version not read refuses to start (:class:`JournalFormatUnsupported`).

Known limit: the final group of a journal is indistinguishable from an unsynced one, so damage in the
last group before a power loss or a crash is cut like a torn group even if it had been synced; a later
group (the next append) makes the same damage detectable. Replay makes such a cut under a limbo marker
(:mod:`bookie.limbo`) unless the *synced mark* proves the cut bytes were never synced: the file
``synced`` in the data dir (beside ``journal/``), rewritten in place by the writer after every
``fdatasync`` and before any of the group is acknowledged (not synced itself), holds the position
the journal is synced up to and a digest of the machine's boot id::

    magic "BKSYNC01" | boot digest (16 bytes) | segment_id:u64 | offset:u64 | crc32c:u32

A process crash keeps the page cache, so a mark written in the boot that is still running is
current, and the one group in flight started at its position: damage starting exactly there (or at
the next segment's start, for a group spanning a roll) was never synced, so never acknowledged (a
crash tore the write in flight). After a reboot or a power cut (another boot id), with no valid
mark, or for damage anywhere else, nothing is proven.
"""

from __future__ import annotations

import enum
import hashlib
import mmap
import struct
from collections.abc import Sequence
from typing import NamedTuple

import crc32c

Buffer = bytes | mmap.mmap
"""What a segment is scanned from: bytes in tests, a read-only mmap at startup (nothing copied)."""

SEGMENT_MAGIC = b"BKJS"
SEGMENT_VERSION = 4
"""4: the segment header records where the segment before it ended, under a CRC32C (24 bytes).
3: ENTRY records of type 7 (the body's CRC32C alone, no id prefix). 2: records come in groups,
each led by a GROUP header record, ENTRY records of type 1. 2 and 3 are still read (their 16-byte
headers record no previous end: the segment before one is checked as it was). 1 had no groups and
has no upgrade path (the project had no releases then: an old data dir is wiped)."""
READABLE_SEGMENT_VERSIONS = frozenset((2, 3, 4))
_SHORT_HEADER_VERSIONS = frozenset((2, 3))
SEGMENT_HEADER = struct.Struct(">4sHxxQ")  # magic, version, padding, segment id: every version starts so
SHORT_SEGMENT_HEADER_BYTES = SEGMENT_HEADER.size  # 16: all of a version 2 or 3 header
_U32 = struct.Struct(">I")  # version 4 adds two: the previous segment's end, crc32c of the bytes before it
SEGMENT_HEADER_BYTES = SEGMENT_HEADER.size + 2 * _U32.size  # 24
"""The header this bookie writes: a new segment's first group lies just past it."""

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
    ENTRY_V2 = 1
    MASTER_KEY = 2
    FENCE = 3
    EXPLICIT_LAC = 4
    GROUP = 5
    REKEY = 6
    ENTRY = 7


_TYPES = frozenset(int(t) for t in RecordType)
ENTRY_TYPES = frozenset((RecordType.ENTRY, RecordType.ENTRY_V2))
"""The types of ENTRY records, either format: a record of one is an entry (:func:`entry_of`)."""


class JournalCorrupt(Exception):
    """The journal holds damage that replay must not paper over; the bookie refuses to start."""


class JournalFormatUnsupported(JournalCorrupt):
    """A segment written in a journal format this bookie does not read; it refuses to start."""


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
    records: list[Record]  # of whole groups, group headers left out
    end: int  # offset just past the last whole group: where appends continue
    tail: Tail
    garbage_end: int  # offset just past the last non-zero byte at or after ``end``
    groups: int = 0  # whole groups scanned
    bad: int = -1  # first offset that did not decode (the damage), -1 when CLEAN
    evidence: int = -1  # offset of the later group's record or header that made it CORRUPT


def _crc(body: bytes | memoryview, record_type: int) -> int:
    if record_type == _ENTRY:
        return _crc32c(body)
    return _crc32c(body, _crc32c(_LEN_TYPE.pack(len(body), record_type)))


def encode_record(record_type: int, body: bytes | memoryview) -> bytes:
    """One record, header and body, ready to append."""
    if len(body) > RECORD_BODY_BYTES_MAX:
        raise ValueError(f"record body of {len(body)} bytes exceeds {RECORD_BODY_BYTES_MAX}")
    header = RECORD_HEADER.pack(RECORD_MAGIC, len(body), _crc(body, record_type), record_type)
    return header + bytes(body)


def encode_entry(entry_body: bytes | memoryview) -> bytes:
    """An ENTRY record of ``entry_body``, which starts with its ledger and entry ids."""
    if len(entry_body) < ENTRY_PREFIX_BYTES:
        raise ValueError(f"an entry body of {len(entry_body)} bytes does not hold its ids")
    return encode_record(RecordType.ENTRY, entry_body)


def encode_entry_v2(ledger_id: int, entry_id: int, entry_body: bytes | memoryview) -> bytes:
    """An ENTRY record of format 2 (type 1), as bookies wrote them before format 3: replay and
    reads still take them (tests write old journals with it)."""
    return encode_record(RecordType.ENTRY_V2, LEDGER_ENTRY.pack(ledger_id, entry_id) + bytes(entry_body))


_pack_entry_v2_crc_prefix = struct.Struct(">IBqq").pack  # body length, type, ledger id, entry id
_pack_record_header = RECORD_HEADER.pack
_crc32c = crc32c.crc32c
_ENTRY = int(RecordType.ENTRY)
_ENTRY_V2 = int(RecordType.ENTRY_V2)
_MASTER_KEY = int(RecordType.MASTER_KEY)  # ints: an enum member is a slow lookup on Python 3.11
_REKEY = int(RecordType.REKEY)
_FENCE = int(RecordType.FENCE)
_EXPLICIT_LAC = int(RecordType.EXPLICIT_LAC)
ENTRY_RECORD_OVERHEAD_BYTES = RECORD_HEADER_BYTES
"""An ENTRY record's bytes besides the entry body (a format-2 record has ``ENTRY_PREFIX_BYTES``
more)."""
ENTRY_RECORD_OVERHEAD_BYTES_MAX = RECORD_HEADER_BYTES + ENTRY_PREFIX_BYTES
"""The same for the ENTRY record kind with the most (format 2's, which compaction may copy)."""


def encode_entry_head(entry_body: bytes) -> bytes:
    """The bytes of an ENTRY record before its entry body (the record header): the record is this
    followed by ``entry_body``, so the add path never copies a body (the journal joins a whole
    group's parts in one go). The one producer of ENTRY record bytes; the caller checked that the
    body starts with the ids of the entry it is (the add path compares them with the request's)
    and keeps ``len(entry_body)`` within ``RECORD_BODY_BYTES_MAX`` (the journal's
    ``record_bytes_max`` does). Same bytes as :func:`encode_entry`, pinned by a test."""
    return _pack_record_header(RECORD_MAGIC, len(entry_body), _crc32c(entry_body), _ENTRY)


def entry_record_parts(entry_bodies: list[bytes]) -> list[bytes]:
    """The ENTRY records of ``entry_bodies`` as parts, in order: each one's header (the bytes of
    :func:`encode_entry_head`, pinned by a test) and then its body. One call for a batch of the add
    path (:meth:`bookie.journal.Journal.close_batch`): no Python call per record. Each body meets
    :func:`encode_entry_head`'s terms (the add path checked its ids and size)."""
    parts = entry_bodies * 2  # the room: heads at the even places, bodies at the odd ones (slices: C)
    parts[0::2] = [
        _pack_record_header(RECORD_MAGIC, len(body), _crc32c(body), _ENTRY) for body in entry_bodies
    ]
    parts[1::2] = entry_bodies
    return parts


def entry_of(record: Record) -> memoryview:
    """The entry body (as the client sent it) of an ENTRY record of either format."""
    if record.type == _ENTRY:
        return record.body
    return record.body[ENTRY_PREFIX_BYTES:]


def encode_master_key(ledger_id: int, key: bytes) -> bytes:
    return encode_record(_MASTER_KEY, LEDGER.pack(ledger_id) + key)


def encode_rekey(ledger_id: int, key: bytes) -> bytes:
    return encode_record(_REKEY, LEDGER.pack(ledger_id) + key)


def encode_fence(ledger_id: int) -> bytes:
    return encode_record(_FENCE, LEDGER.pack(ledger_id))


def encode_explicit_lac(ledger_id: int, lac: int, lac_body: bytes) -> bytes:
    return encode_record(_EXPLICIT_LAC, LEDGER_ENTRY.pack(ledger_id, lac) + lac_body)


def encode_segment_header(segment_id: int, previous_end: int) -> bytes:
    """The header of segment ``segment_id`` (current version); ``previous_end``: where the segment
    before it ended (the end of its last group), 0 when there is none to check (segment 1, or one
    a restart found gone or behind the checkpoint)."""
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, segment_id) + _U32.pack(previous_end)
    return head + _U32.pack(crc32c.crc32c(head))


def segment_format(data: Buffer) -> int:
    """The format version a segment's header names (:data:`SEGMENT_VERSION` for a header that is
    not ours: the writer writes its header again with its first group)."""
    if len(data) < SHORT_SEGMENT_HEADER_BYTES or bytes(data[:4]) != SEGMENT_MAGIC:
        return SEGMENT_VERSION
    return int(SEGMENT_HEADER.unpack_from(data, 0)[1])


GROUP_BODY = struct.Struct(">QII")  # segment id, offset of this header, length of the records after it
GROUP_HEADER_BYTES = RECORD_HEADER_BYTES + GROUP_BODY.size  # 29
_GROUP = 5
_GROUP_CRC_PREFIX = _LEN_TYPE.pack(GROUP_BODY.size, _GROUP)


def encode_group_header(segment_id: int, offset: int, length: int) -> bytes:
    """The GROUP record that leads a group at ``offset`` of segment ``segment_id`` whose records
    take ``length`` bytes after it."""
    body = GROUP_BODY.pack(segment_id, offset, length)
    crc = crc32c.crc32c(body, crc32c.crc32c(_GROUP_CRC_PREFIX))
    return RECORD_HEADER.pack(RECORD_MAGIC, GROUP_BODY.size, crc, _GROUP) + body


def group_length_at(data: Buffer, offset: int, segment_id: int) -> int | None:
    """The records' length of the group whose header is at ``offset``, or None when there is no
    valid group header there naming that very place."""
    record = decode_record_at(data, offset)
    if record is None or record.type != _GROUP or record.length != GROUP_HEADER_BYTES:
        return None
    found_segment, found_offset, length = GROUP_BODY.unpack_from(record.body, 0)
    if found_segment != segment_id or found_offset != offset:
        return None
    return int(length)


class SegmentHeader(enum.Enum):
    VALID = "valid"
    ZERO = "zero"  # created (preallocated) but never written, or the header page was lost
    GARBLED = "garbled"  # not a whole header of ours: a header page torn by power loss, or a torn write


def check_segment_header(data: Buffer, segment_id: int) -> SegmentHeader:
    """Classify the header of segment ``segment_id``. Raises :class:`JournalFormatUnsupported` for
    our magic with a format version not read, :class:`JournalCorrupt` for another segment's id."""
    if len(data) < SHORT_SEGMENT_HEADER_BYTES or not any(data[:SHORT_SEGMENT_HEADER_BYTES]):
        return SegmentHeader.ZERO
    magic, version, found_id = SEGMENT_HEADER.unpack_from(data, 0)
    if magic != SEGMENT_MAGIC:
        return SegmentHeader.GARBLED
    head = bytes(data[:SHORT_SEGMENT_HEADER_BYTES])
    readable = version in READABLE_SEGMENT_VERSIONS
    expected = SEGMENT_HEADER.pack(SEGMENT_MAGIC, version if readable else SEGMENT_VERSION, segment_id)
    kept = len(head.rstrip(b"\0"))
    if head != expected and head[:kept] == expected[:kept]:
        # our header's first bytes, then zeros: its write was torn (never synced, so nothing
        # acknowledged lies behind it), not a header of another version or segment
        return SegmentHeader.GARBLED
    if not readable:
        raise JournalFormatUnsupported(
            f"journal segment {segment_id:016x} is in journal format version {version}; this bookie "
            f"reads versions {sorted(READABLE_SEGMENT_VERSIONS)} and has no upgrade path from it: "
            "wipe the data dir and let re-replication rebuild the bookie"
        )
    if version not in _SHORT_HEADER_VERSIONS:
        if len(data) < SEGMENT_HEADER_BYTES:
            return SegmentHeader.GARBLED
        (crc,) = _U32.unpack_from(data, SEGMENT_HEADER_BYTES - _U32.size)
        if crc32c.crc32c(data[: SEGMENT_HEADER_BYTES - _U32.size]) != crc:
            return SegmentHeader.GARBLED  # a torn or damaged header: what follows says which
    if found_id != segment_id:
        raise JournalCorrupt(f"journal segment {segment_id:016x}: its header names segment {found_id:016x}")
    return SegmentHeader.VALID


def segment_layout(data: Buffer) -> tuple[int, int]:
    """Of a VALID segment header (:func:`check_segment_header`): where the segment's first group
    lies, and where its writer recorded the segment before it ended (0: none recorded, as in every
    version 2 or 3 header)."""
    if SEGMENT_HEADER.unpack_from(data, 0)[1] in _SHORT_HEADER_VERSIONS:
        return SHORT_SEGMENT_HEADER_BYTES, 0
    return SEGMENT_HEADER_BYTES, int(_U32.unpack_from(data, SEGMENT_HEADER.size)[0])


def decode_record_at(data: Buffer, offset: int) -> Record | None:
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
    if _crc(body, record_type) != crc or (record_type == _ENTRY and length < ENTRY_PREFIX_BYTES):
        return None
    return Record(offset, record_type, body, RECORD_HEADER_BYTES + length)


_ENTRY_HEAD = struct.Struct(">IIIBqq")  # the record header and the entry's ids
_unpack_entry_head = _ENTRY_HEAD.unpack_from
_ENTRY_HEAD_BYTES = _ENTRY_HEAD.size


def entry_bodies(
    data: memoryview,
    offsets: Sequence[int],
    base: int,
    ledger_id: int,
    first_entry_id: int,
    step: int,
    out: list[memoryview],
) -> bool:
    """Append to ``out`` the entry bodies (views of ``data``) of entries ``first_entry_id``,
    ``+ step``, ... of ``ledger_id``, whose ENTRY records lie at ``offsets[k] - base`` in ``data``:
    what a read asks of the records the index points it at, in one loop. Each must be that entry's
    record, whole and valid (checksum); False at the first that is not (those before it are in
    ``out``; :func:`decode_record_at` says what is wrong with it). Either ENTRY format: the ids
    follow the record header in both (a format-3 body starts with them)."""
    entry_id = first_entry_id
    size = len(data)
    for offset in offsets:
        offset -= base
        if size - offset < _ENTRY_HEAD_BYTES:
            return False
        magic, length, crc, record_type, lid, eid = _unpack_entry_head(data, offset)
        if (
            magic != RECORD_MAGIC
            or lid != ledger_id
            or eid != entry_id
            or not ENTRY_PREFIX_BYTES <= length <= size - offset - RECORD_HEADER_BYTES
        ):
            return False
        start = offset + RECORD_HEADER_BYTES
        if record_type == _ENTRY:
            body = data[start : start + length]
            if _crc32c(body) != crc:
                return False
        elif record_type == _ENTRY_V2:
            body = data[start + ENTRY_PREFIX_BYTES : start + length]
            if _crc32c(body, _crc32c(_pack_entry_v2_crc_prefix(length, _ENTRY_V2, lid, eid))) != crc:
                return False
        else:
            return False
        out.append(body)
        entry_id += step
    return True


_ZERO_SCAN_CHUNK_BYTES = 1 << 16
"""Zeros are looked for a chunk at a time: one memcmp against `_ZEROS` (a chunk under malloc's
mmap threshold, so its copy out of the segment reuses the heap instead of faulting fresh pages)."""
_ZEROS = bytes(_ZERO_SCAN_CHUNK_BYTES)
_ZERO_SCAN_STRIP_BYTES = 64
"""Below this, the zero tail of a chunk is stripped byte by byte (``rstrip`` is ~2 ns a byte)."""


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
        chunk = data[chunk_start:end]
        if chunk != _ZEROS[: len(chunk)]:
            return chunk_start + _end_of_nonzero(chunk)
        end = chunk_start
    return start


def _end_of_nonzero(chunk: bytes) -> int:
    """Offset just past the last non-zero byte of ``chunk``, which has one: its zero tail is
    narrowed by halves, each a memcmp, and only the last few bytes are stripped one by one."""
    low, high = 0, len(chunk)  # chunk[high:] is all zero; chunk[low:high] holds a non-zero byte
    while high - low > _ZERO_SCAN_STRIP_BYTES:
        middle = (low + high) // 2
        if chunk[middle:high] == _ZEROS[: high - middle]:
            high = middle
        else:
            low = middle
    return low + len(chunk[low:high].rstrip(b"\x00"))


def is_all_zero(data: Buffer) -> bool:
    return _last_nonzero(data, 0) == 0


def find_group_header(data: Buffer, start: int, end: int, segment_id: int) -> int | None:
    """Offset of the first group header in ``[start, end)`` that is valid and names its place."""
    pos = data.find(_RECORD_MAGIC_BYTES, start, end)
    while pos != -1:
        if group_length_at(data, pos, segment_id) is not None:
            return pos
        pos = data.find(_RECORD_MAGIC_BYTES, pos + 1, end)
    return None


def classify(nonzero_after_end: bool, later_group: bool) -> Tail:
    """The decision table: what ends the whole groups of a segment (see the module docstring)."""
    if not nonzero_after_end:
        return Tail.CLEAN
    return Tail.CORRUPT if later_group else Tail.TORN


def _group_records(data: Buffer, start: int, end: int) -> tuple[list[Record], int]:
    """The records filling ``[start, end)`` back to back, and the offset of the first one that
    does not decode (or is a group header, or crosses ``end``); ``end`` when all do."""
    records: list[Record] = []
    pos = start
    while pos < end:
        record = decode_record_at(data, pos)
        if record is None or record.type == _GROUP or pos + record.length > end:
            return records, pos
        records.append(record)
        pos += record.length
    return records, pos


def scan(data: Buffer, start: int, segment_id: int) -> ScanResult:
    """Decode every whole group of segment ``segment_id`` from ``start`` (a group boundary: just
    past the segment header, or a journal position the index checkpointed) and classify the rest."""
    records: list[Record] = []
    groups = 0
    pos = start
    extent_end: int | None = None  # end of the damaged group, when its header is readable
    bad = start
    while True:
        length = group_length_at(data, pos, segment_id)
        if length is None:
            bad = pos
            break
        first = pos + GROUP_HEADER_BYTES
        end = first + length
        group, stop = _group_records(data, first, min(end, len(data)))
        if stop != end:  # a record that does not decode, or the file ends inside the group
            extent_end, bad = end, stop
            break
        records += group
        groups += 1
        pos = end
    garbage_end = _last_nonzero(data, pos)
    evidence: int | None = None
    if garbage_end > pos:
        if extent_end is not None and extent_end < garbage_end:
            evidence = find_valid_record(data, extent_end, garbage_end)
        if evidence is None:
            evidence = find_group_header(data, pos + 1, garbage_end, segment_id)
    tail = classify(garbage_end > pos, evidence is not None)
    return ScanResult(
        records,
        pos,
        tail,
        garbage_end,
        groups,
        -1 if tail is Tail.CLEAN else bad,
        -1 if evidence is None else evidence,
    )


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


SYNCED_MARK_FILE = "synced"
"""The synced mark's name in the data dir (the module doc)."""
_SYNCED_MAGIC = b"BKSYNC01"
_SYNCED_MARK = struct.Struct(">8s16sQQ")  # magic, boot digest, segment id, offset
_SYNCED_CRC = struct.Struct(">I")
SYNCED_MARK_BYTES = _SYNCED_MARK.size + _SYNCED_CRC.size


class SyncedMark(NamedTuple):
    boot: bytes
    """The digest of the boot id it was written in (:func:`boot_digest`)."""
    position: Position
    """Everything before it was synced."""


def boot_digest(boot_id: bytes) -> bytes:
    return hashlib.blake2b(boot_id, digest_size=16).digest()


def encode_synced_mark(boot: bytes, position: Position) -> bytes:
    """The mark's bytes; ``boot`` is a :func:`boot_digest`."""
    body = _SYNCED_MARK.pack(_SYNCED_MAGIC, boot, position.segment_id, position.offset)
    return body + _SYNCED_CRC.pack(crc32c.crc32c(body))


def decode_synced_mark(data: bytes) -> SyncedMark | None:
    """The mark in ``data``, or None when it is not one whole (a torn or damaged mark proves nothing)."""
    if len(data) < SYNCED_MARK_BYTES:
        return None
    body = data[: _SYNCED_MARK.size]
    (crc,) = _SYNCED_CRC.unpack_from(data, _SYNCED_MARK.size)
    if crc32c.crc32c(body) != crc:
        return None
    magic, boot, segment_id, offset = _SYNCED_MARK.unpack(body)
    if magic != _SYNCED_MAGIC:
        return None
    return SyncedMark(boot, Position(segment_id, offset))
