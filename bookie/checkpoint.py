"""Index checkpoints: a snapshot of every ledger's state at a journal position (pure serde).

File layout: ``magic "BKIX" | version:u16 | pad:u16 | crc32c:u32 | length:u64 | msgpack payload``.
The payload is ``[segment_id, offset, ledgers]`` where each ledger is
``[ledger_id, master_key|nil, fenced, piggyback_lac, explicit_lac, lac_body, last_entry_id, index]``
and ``index`` is :meth:`bookie.index.LedgerIndex.to_wire` (its arrays as raw bytes: packing a
million entries takes milliseconds and creates no per-entry objects).

A checkpoint at position P holds the effect of every journal record before P (it may hold more:
a fence or master key is set in memory before its record is durable; both are safe to keep, as
refusing adds and knowing a key never loses acknowledged data). Replay from P re-applies records,
which is idempotent.

Built in two halves so the event loop never stalls (issue 20: 2-6 s with 200k ledgers when the
whole file was encoded on the loop): :func:`encode_row` on the loop, one ledger at a time, time-
sliced by the caller and cached per ledger until the ledger changes (so a checkpoint re-encodes only
what changed since the last one); :func:`encode_parts` in a worker thread joins the rows in chunks
of about :data:`CHUNK_BYTES` (no single step holds the GIL for long) and computes the header. The bytes are
the same as one ``msgpack.packb`` of the payload: the format did not change.
"""

from __future__ import annotations

import bisect
import itertools
import struct
from collections.abc import Iterable, Sequence

import crc32c
import msgpack

from bookie.index import LedgerIndex
from bookie.journal_format import Position
from bookie.ledger_state import LedgerState

MAGIC = b"BKIX"
VERSION = 1
HEADER = struct.Struct(">4sHxxIQ")
_SCAN_ROWS = 8192
CHUNK_BYTES = 1 << 20
"""Bytes of rows joined per step in :func:`encode_parts`: a join holds the GIL (the event loop
waits meanwhile), 1 MiB takes ~0.1 ms."""


class CheckpointCorrupt(Exception):
    """The checkpoint file exists but cannot be trusted; the bookie refuses to start."""


_row_packer = msgpack.Packer(use_bin_type=True, autoreset=True)  # the event loop's only


def encode_row(state: LedgerState) -> bytes:
    """One ledger's row, msgpack-encoded (on the event loop: it reads live state)."""
    return _row_packer.pack(
        [
            state.ledger_id,
            state.master_key,
            state.fenced,
            state.piggyback_lac,
            state.explicit_lac,
            state.lac_body,
            state.index.last_entry_id,
            state.index.to_wire(),
        ]
    )


def encode_parts(position: Position, rows: Sequence[bytes]) -> list[bytes]:
    """The checkpoint file as consecutive parts (header first) from encoded rows. Blocking: call
    it off the event loop; each step (a join of about :data:`CHUNK_BYTES`, its CRC) is short."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    head = (
        packer.pack_array_header(3)
        + packer.pack(position.segment_id)
        + packer.pack(position.offset)
        + packer.pack_array_header(len(rows))
    )
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


def decode(data: bytes) -> tuple[Position, dict[int, LedgerState]]:
    """Raises :class:`CheckpointCorrupt` for anything but a whole, valid checkpoint."""
    if len(data) < HEADER.size:
        raise CheckpointCorrupt(f"checkpoint of {len(data)} bytes is shorter than its header")
    magic, version, crc, length = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise CheckpointCorrupt(f"checkpoint has magic {magic!r} version {version}")
    payload = data[HEADER.size :]
    if len(payload) != length or crc32c.crc32c(payload) != crc:
        raise CheckpointCorrupt("checkpoint length or CRC32C mismatch")
    try:
        segment_id, offset, rows = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        ledgers = {row[0]: _ledger_from_row(row) for row in rows}
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise CheckpointCorrupt(f"checkpoint payload does not decode: {exc}") from exc
    return Position(int(segment_id), int(offset)), ledgers


def _ledger_from_row(row: list[object]) -> LedgerState:
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
    state = LedgerState(ledger_id)
    state.master_key = key if isinstance(key, bytes) else None
    state.fenced = bool(fenced)
    state.fence_durable = state.fenced
    state.piggyback_lac = piggyback
    state.explicit_lac = explicit
    state.lac_body = lac_body
    state.index = LedgerIndex.from_wire(index, last_entry_id)
    return state
