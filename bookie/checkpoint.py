"""Index checkpoints: a snapshot of every ledger's state at a journal position (pure serde).

File layout: ``magic "BKIX" | version:u16 | pad:u16 | crc32c:u32 | length:u64 | payload`` (header
big-endian, CRC32C and length over the payload).

**Version 2** (written since issue 19): a flat binary payload, little-endian,
``segment_id:u64 | offset:u64 | rows:u64`` then that many rows, each :data:`ROW` —
``ledger_id:u64 | flags:u8 (1 = has a master key, 2 = fenced) | piggyback_lac:i64 |
explicit_lac:i64 | last_entry_id:i64 | index base:i64 | key_len:u16 | lac_body_len:u32 |
slots:u32 | overflow:u32`` — followed by the master key, the LAC body, the index's dense arrays
(``slots`` int64 positions, ``slots`` int32 lengths: :class:`bookie.index.LedgerIndex`'s own arrays
as raw bytes, so a million entries pack and unpack in one C copy) and ``overflow`` entries of four
int64 (entry id, segment id, offset, length). No per-entry and no per-field object is built to read
or write a row, and a row is read with one ``struct`` call: a million ledgers decode in a couple of
seconds in a worker thread whose every step is short (the event loop keeps its share of the GIL;
version 1's one ``msgpack.unpackb`` held it for 2.4 s; every millisecond the decoding thread lets
go of the GIL: :class:`bookie.threads.GilShare`).

**Version 1** (read, never written): a msgpack payload ``[segment_id, offset, ledgers]``, each
ledger ``[ledger_id, master_key|nil, fenced, piggyback_lac, explicit_lac, lac_body, last_entry_id,
index]`` with ``index`` = ``[base, positions bytes, lengths bytes, overflow ids, overflow
locations]``. It is read row by row (a streaming unpacker: no step holds the GIL for long); the
first checkpoint after the start writes version 2. A bookie older than version 2 refuses a version 2
file (``checkpoint has magic b'BKIX' version 2``): there is no downgrade once a new bookie wrote a
checkpoint (run the new version, or wipe the bookie and let re-replication rebuild it).

A checkpoint at position P holds the effect of every journal record before P (it may hold more:
a fence or master key is set in memory before its record is durable; both are safe to keep, as
refusing adds and knowing a key never loses acknowledged data). Replay from P re-applies records,
which is idempotent.

Built in two halves so the event loop never stalls (issue 20: 2-6 s with 200k ledgers when the
whole file was encoded on the loop): :func:`encode_row` on the loop, one ledger at a time, time-
sliced by the caller and cached per ledger until the ledger changes (so a checkpoint re-encodes only
what changed since the last one); :func:`encode_parts` in a worker thread joins the rows in chunks
of about :data:`CHUNK_BYTES` (no single step holds the GIL for long) and computes the header.
"""

from __future__ import annotations

import bisect
import itertools
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence

import crc32c
import msgpack

from bookie.index import LedgerIndex
from bookie.journal_format import Position
from bookie.ledger_state import LedgerState
from bookie.threads import GilShare

MAGIC = b"BKIX"
VERSION = 2
"""The version written; :data:`VERSION_MSGPACK` is still read."""
VERSION_MSGPACK = 1
HEADER = struct.Struct(">4sHxxIQ")
HEAD = struct.Struct("<QQQ")
"""The payload's head: the position's segment id and offset, the number of rows."""
ROW = struct.Struct("<QBqqqqHIII")
"""A row's fixed part: ledger id, flags, piggyback LAC, explicit LAC, last entry id, index base,
the lengths of the key and of the LAC body, dense slots, overflow entries."""
HAS_KEY = 1
FENCED = 2
_OVERFLOW_FIELDS = 4
_SCAN_ROWS = 8192
CHUNK_BYTES = 1 << 20
"""Bytes of rows joined per step in :func:`encode_parts`: a join holds the GIL (the event loop
waits meanwhile), 1 MiB takes ~0.1 ms."""
_LITTLE = sys.byteorder == "little"


class CheckpointCorrupt(Exception):
    """The checkpoint file exists but cannot be trusted; the bookie refuses to start."""


def _le(values: array) -> bytes:  # type: ignore[type-arg]
    """An array's bytes in little-endian order (a copy swapped on a big-endian host)."""
    if _LITTLE:
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


def encode_row(state: LedgerState) -> bytes:
    """One ledger's row (on the event loop: it reads live state)."""
    index = state.index
    key = state.master_key
    base, positions, lengths, overflow = index.snapshot()
    flags = (HAS_KEY if key is not None else 0) | (FENCED if state.fenced else 0)
    key_bytes = key or b""
    lac_body = state.lac_body
    head = ROW.pack(
        state.ledger_id,
        flags,
        state.piggyback_lac,
        state.explicit_lac,
        index.last_entry_id,
        base,
        len(key_bytes),
        len(lac_body),
        len(positions),
        len(overflow) // _OVERFLOW_FIELDS,
    )
    if not positions and not overflow:
        return head + key_bytes + lac_body
    return b"".join((head, key_bytes, lac_body, _le(positions), _le(lengths), _le(overflow)))


def encode_parts(position: Position, rows: Sequence[bytes]) -> list[bytes]:
    """The checkpoint file as consecutive parts (header first) from encoded rows. Blocking: call
    it off the event loop; each step (a join of about :data:`CHUNK_BYTES`, its CRC) is short."""
    head = HEAD.pack(position.segment_id, position.offset, len(rows))
    parts = [head]
    crc = crc32c.crc32c(head)
    length = len(head)
    start = 0
    while start < len(rows):
        end = _chunk_end(rows, start)
        chunk = b"".join(rows[start:end])
        crc = crc32c.crc32c(chunk, crc)
        length += len(chunk)
        parts.append(chunk)
        start = end
    return [HEADER.pack(MAGIC, VERSION, crc, length), *parts]


def _chunk_end(rows: Sequence[bytes], start: int) -> int:
    """The end of the chunk from ``start``: its rows reach :data:`CHUNK_BYTES` (or the list ends).
    Row sizes are summed in C a :data:`_SCAN_ROWS` slice at a time: no Python step per row, and no
    single step long enough to keep the GIL from the event loop for more than a moment."""
    end, size = start, 0
    while end < len(rows):
        sizes = list(itertools.accumulate(map(len, rows[end : end + _SCAN_ROWS]), initial=size))
        k = bisect.bisect_left(sizes, CHUNK_BYTES, 1)
        if k < len(sizes):
            return end + k
        end += len(sizes) - 1
        size = sizes[-1]
    return end


def encode(position: Position, ledgers: Iterable[LedgerState]) -> bytes:
    """The whole checkpoint at once (tests, tools)."""
    return b"".join(encode_parts(position, [encode_row(state) for state in ledgers]))


def decode(data: bytes, row_cache_bytes_max: int = 0) -> tuple[Position, dict[int, LedgerState]]:
    """Raises :class:`CheckpointCorrupt` for anything but a whole, valid checkpoint. Blocking (a
    million ledgers take seconds): call it off the event loop; no single step of it holds the GIL
    for long, so the loop keeps running meanwhile. A version 2 row up to ``row_cache_bytes_max``
    is kept as the ledger's :attr:`~bookie.ledger_state.LedgerState.row`: the next checkpoint
    reuses it (it is the bytes :func:`encode_row` gives for that state) instead of encoding every
    ledger anew after a restart."""
    if len(data) < HEADER.size:
        raise CheckpointCorrupt(f"checkpoint of {len(data)} bytes is shorter than its header")
    magic, version, crc, length = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version not in (VERSION, VERSION_MSGPACK):
        raise CheckpointCorrupt(
            f"checkpoint has magic {magic!r} version {version}: this bookie reads versions "
            f"{VERSION_MSGPACK} and {VERSION} (a newer bookie wrote it? run that version)"
        )
    payload = memoryview(data)[HEADER.size :]  # no copy of the whole file
    if len(payload) != length or crc32c.crc32c(payload) != crc:
        raise CheckpointCorrupt("checkpoint length or CRC32C mismatch")
    try:
        if version == VERSION_MSGPACK:
            return _decode_msgpack(payload)
        return _decode_rows(payload, row_cache_bytes_max)
    except (ValueError, TypeError, IndexError, struct.error, msgpack.UnpackException) as exc:
        raise CheckpointCorrupt(f"checkpoint payload does not decode: {exc}") from exc


def _decode_rows(payload: memoryview, row_cache_bytes_max: int) -> tuple[Position, dict[int, LedgerState]]:
    segment_id, offset, count = HEAD.unpack_from(payload, 0)
    at = HEAD.size
    ledgers: dict[int, LedgerState] = {}
    unpack_row = ROW.unpack_from
    row_size = ROW.size
    restored = LedgerState.restored
    from_arrays = LedgerIndex.from_arrays
    tick = GilShare().tick
    for _ in range(count):
        tick()
        start = at
        ledger_id, flags, piggyback, explicit, last_entry_id, base, key_len, lac_len, slots, spill = (
            unpack_row(payload, at)
        )
        at += row_size
        key = None
        if flags & HAS_KEY:
            key = bytes(payload[at : at + key_len])
        at += key_len
        lac_body = bytes(payload[at : at + lac_len]) if lac_len else b""
        at += lac_len
        if slots or spill:
            positions, at = _array(payload, at, "q", slots)
            lengths, at = _array(payload, at, "i", slots)
            overflow, at = _array(payload, at, "q", spill * _OVERFLOW_FIELDS)
            index = from_arrays(base, positions, lengths, overflow, last_entry_id)
        else:
            index = from_arrays(base, None, None, None, last_entry_id)
        state = restored(ledger_id, key, bool(flags & FENCED), piggyback, explicit, lac_body, index)
        if at - start <= row_cache_bytes_max:
            state.row = bytes(payload[start:at])
        ledgers[ledger_id] = state
    if at != len(payload):
        raise ValueError(f"{len(payload) - at} bytes after the last of {count} rows")
    return Position(segment_id, offset), ledgers


def _array(payload: memoryview, at: int, typecode: str, n: int) -> tuple[array, int]:  # type: ignore[type-arg]
    values = array(typecode)
    end = at + n * values.itemsize
    if end > len(payload):
        raise ValueError("a row runs past the end of the checkpoint")
    values.frombytes(payload[at:end])
    if not _LITTLE:
        values.byteswap()
    return values, end


def _decode_msgpack(payload: memoryview) -> tuple[Position, dict[int, LedgerState]]:
    """Version 1, one row per unpacker call (no call holds the GIL for long)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(payload) + 1)
    unpacker.feed(payload)
    if unpacker.read_array_header() != 3:
        raise ValueError("checkpoint payload is not [segment_id, offset, ledgers]")
    segment_id, offset = unpacker.unpack(), unpacker.unpack()
    ledgers = {}
    tick = GilShare().tick
    for _ in range(unpacker.read_array_header()):
        tick()
        row = unpacker.unpack()
        ledgers[row[0]] = _ledger_from_msgpack_row(row)
    if unpacker.tell() != len(payload):
        raise ValueError("bytes after the checkpoint payload")
    return Position(int(segment_id), int(offset)), ledgers


def _ledger_from_msgpack_row(row: list[object]) -> LedgerState:
    ledger_id, key, fenced, piggyback, explicit, lac_body, last_entry_id, index = row
    if not (
        isinstance(ledger_id, int)
        and isinstance(piggyback, int)
        and isinstance(explicit, int)
        and isinstance(last_entry_id, int)
        and isinstance(lac_body, bytes)
        and isinstance(index, list)
    ):
        raise CheckpointCorrupt(f"checkpoint row for ledger {ledger_id!r} has wrong field types")
    base, positions, lengths, overflow_ids, overflow_locations = index
    if not (isinstance(base, int) and isinstance(positions, bytes) and isinstance(lengths, bytes)):
        raise TypeError("index snapshot has wrong field types")
    if not (isinstance(overflow_ids, list) and isinstance(overflow_locations, list)):
        raise TypeError("index snapshot has wrong overflow types")
    overflow = array("q")
    for entry_id, location in zip(overflow_ids, overflow_locations, strict=True):
        segment_id, offset, length = location
        overflow.extend((int(entry_id), int(segment_id), int(offset), int(length)))
    restored_index = LedgerIndex.from_arrays(
        base, array("q", positions), array("i", lengths), overflow, last_entry_id
    )
    key_bytes = key if isinstance(key, bytes) else None
    return LedgerState.restored(
        ledger_id, key_bytes, bool(fenced), piggyback, explicit, lac_body, restored_index
    )
