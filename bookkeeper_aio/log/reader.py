"""The log reader (docs/api.md "Logs"): records across ledger boundaries, in order, each once.

This slice reads to the log's **current end** and stops: every entry of the ledgers the list
marks CLOSED (or whose ledger metadata is closed), and of an OPEN ledger up to its last add
confirmed at the time it is reached. It does not tail (no waiting for new records or ledgers yet).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.errors import BKInterfaceError
from bookkeeper_aio.log._common import log_manager
from bookkeeper_aio.log.position import LogPosition, LogRecord


async def open_log_reader(
    bk: BookKeeper,
    name: str,
    *,
    start: Literal["earliest"] | LogPosition = "earliest",
    password: bytes = b"",
) -> AsyncIterator[LogRecord]:
    """Every record from ``start`` (inclusive) to the log's current end, in log order.

    Raises NoSuchLog (naming the log), MetadataFormatError (a corrupt log key, naming the log),
    BKInterfaceError (``start`` not in the log), and the ledger API's read errors.
    """
    versioned = await log_manager(bk).read(name)
    ledger_ids = versioned.metadata.ledger_ids
    first_index, first_entry = 0, 0
    if start != "earliest":
        if not isinstance(start, LogPosition):
            raise BKInterfaceError(f"start must be 'earliest' or a LogPosition, got {start!r}")
        if start.ledger_id not in ledger_ids:
            raise BKInterfaceError(f"log {name!r}: ledger {start.ledger_id} is not in the log")
        first_index, first_entry = ledger_ids.index(start.ledger_id), max(0, start.entry_id)
    return _records(bk, ledger_ids[first_index:], first_entry, password)


async def _records(
    bk: BookKeeper, ledger_ids: tuple[int, ...], first_entry: int, password: bytes
) -> AsyncIterator[LogRecord]:
    for index, ledger_id in enumerate(ledger_ids):
        handle = await bk.open_ledger(ledger_id, password=password)
        first = first_entry if index == 0 else 0
        last = handle.last_add_confirmed
        if last < first:
            continue
        async for entry in handle.read(first, last):
            yield LogRecord(LogPosition(ledger_id, entry.entry_id), entry.payload)
