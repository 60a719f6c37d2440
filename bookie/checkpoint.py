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
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import crc32c
import msgpack

from bookie.index import LedgerIndex
from bookie.journal_format import Position
from bookie.ledger_state import LedgerState

MAGIC = b"BKIX"
VERSION = 1
HEADER = struct.Struct(">4sHxxIQ")


class CheckpointCorrupt(Exception):
    """The checkpoint file exists but cannot be trusted; the bookie refuses to start."""


def encode(position: Position, ledgers: Iterable[LedgerState]) -> bytes:
    rows = [
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
        for state in ledgers
    ]
    payload = msgpack.packb([position.segment_id, position.offset, rows], use_bin_type=True)
    return HEADER.pack(MAGIC, VERSION, crc32c.crc32c(payload), len(payload)) + payload


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
