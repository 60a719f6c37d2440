"""Index checkpoints: a snapshot of every ledger's state at a journal position (pure serde).

File layout: ``magic "BKIX" | version:u16 | pad:u16 | crc32c:u32 | length:u64 | msgpack payload``.
The payload is ``[segment_id, offset, ledgers]`` where each ledger is
``[ledger_id, master_key|nil, fenced, piggyback_lac, explicit_lac, lac_body, ids, segments,
offsets, lengths]`` (columnar lists: compact and fast to pack).

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

from bookie.journal import Position
from bookie.ledger_state import LedgerState

MAGIC = b"BKIX"
VERSION = 1
HEADER = struct.Struct(">4sHxxIQ")


class CheckpointCorrupt(Exception):
    """The checkpoint file exists but cannot be trusted; the bookie refuses to start."""


def encode(position: Position, ledgers: Iterable[LedgerState]) -> bytes:
    rows = []
    for state in ledgers:
        items = state.index.items()
        rows.append(
            [
                state.ledger_id,
                state.master_key,
                state.fenced,
                state.piggyback_lac,
                state.explicit_lac,
                state.lac_body,
                [entry_id for entry_id, _ in items],
                [loc.segment_id for _, loc in items],
                [loc.offset for _, loc in items],
                [loc.length for _, loc in items],
            ]
        )
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
    ledger_id, key, fenced, piggyback, explicit, lac_body, ids, segs, offs, lens = row
    ints_ok = all(isinstance(v, int) for v in (ledger_id, piggyback, explicit))
    lists_ok = all(isinstance(v, list) for v in (ids, segs, offs, lens))
    if not (ints_ok and lists_ok and isinstance(lac_body, bytes)):
        raise CheckpointCorrupt(f"checkpoint row for ledger {ledger_id!r} has wrong field types")
    assert isinstance(ledger_id, int) and isinstance(lac_body, bytes)  # noqa: PT018 (narrowing)
    assert isinstance(piggyback, int) and isinstance(explicit, int)  # noqa: PT018
    assert isinstance(ids, list) and isinstance(segs, list)  # noqa: PT018
    assert isinstance(offs, list) and isinstance(lens, list)  # noqa: PT018
    state = LedgerState(ledger_id)
    state.master_key = key if isinstance(key, bytes) else None
    state.fenced = bool(fenced)
    state.fence_durable = state.fenced
    state.piggyback_lac = piggyback
    state.explicit_lac = explicit
    state.lac_body = lac_body
    for entry_id, seg, off, length in zip(ids, segs, offs, lens, strict=True):
        state.index.put(entry_id, seg, off, length)
    return state
