"""Record framing of sequenced logs: an 8-byte big-endian sequence number before the payload.

Plain logs store the payload as the entry. A sequenced log's writer supplies a strictly growing
sequence number per append; a new writer reads the log's last record to learn where it stands, and
readers drop a record whose sequence they already passed (the copy a fenced writer's "maybe written"
append left before the new leader wrote it again).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.errors import BKInterfaceError, DigestError
from metadata.log_metadata import LogLedger, LogMetadata

_HEADER = struct.Struct(">Q")
HEADER_BYTES = _HEADER.size
SEQUENCE_MAX = 2**64 - 1


def encode_sequenced(sequence: int, payload: bytes) -> bytes:
    if not isinstance(sequence, int) or isinstance(sequence, bool) or not 0 <= sequence <= SEQUENCE_MAX:
        raise BKInterfaceError(f"sequence must be an int in [0, 2^64), got {sequence!r}")
    return _HEADER.pack(sequence) + payload


def decode_sequenced(data: bytes, *, where: str) -> tuple[int, bytes]:
    """(sequence, payload); `DigestError` names ``where`` for an entry too short to hold a header
    (the entry passed its checksum, so its writer did not frame it: not a record of this log)."""
    if len(data) < HEADER_BYTES:
        raise DigestError(f"{where}: {len(data)}-byte entry in a sequenced log has no sequence header")
    return _HEADER.unpack_from(data)[0], data[HEADER_BYTES:]


async def last_sequence(bk: BookKeeper, md: LogMetadata, password: bytes) -> int | None:
    """The sequence number of the log's last record (None: not sequenced, or never a record). Every
    listed ledger but the last (the new writer's, empty) is closed when this runs; when none holds
    a record, what truncation removed counts (``truncated_sequence``)."""
    if not md.sequenced:
        return None
    found = await last_sequence_in(bk, md.name, md.ledgers[:-1], password)
    return md.truncated_sequence if found is None else found


async def last_sequence_in(
    bk: BookKeeper, name: str, ledgers: Sequence[LogLedger], password: bytes
) -> int | None:
    """The sequence number of the last record in ``ledgers`` (closed ones), None when all are empty."""
    for entry in reversed(ledgers):
        if entry.last_entry_id == -1:
            continue  # known empty
        handle = await bk.open_ledger(entry.ledger_id, password=password)
        last = handle.last_add_confirmed
        if last >= 0:
            record = await handle.read_entry(last)
            sequence, _ = decode_sequenced(record.payload, where=f"log {name!r} {entry.ledger_id}:{last}")
            return sequence
    return None
