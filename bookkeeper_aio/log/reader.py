"""The log reader (docs/api.md "Logs"): records across ledger boundaries, in order, each once.

``follow=False`` (the default) reads to the log's **current end** and stops: every entry of the
ledgers the list marks CLOSED (or whose ledger metadata is closed), and of an OPEN ledger up to its
last add confirmed at the time it is reached.

``follow=True`` tails the log and never ends by itself: each ledger of the list is read with
`ReadHandle.tail` (caught up: long-poll LAC reads), which ends once that ledger is closed (a roll,
the writer's close, or a takeover's recovery: the metadata's last entry bounds it, never a bookie's
LAC) and its last entry was handed out. The reader then re-reads the log metadata (bounded,
exponential backoff between reads) until a ledger after it is in the list, and goes on at that
ledger's entry 0. Ledger ids grow along the list, so positions come out strictly increasing.
Close it with ``aclose()`` (or ``contextlib.aclosing``); cancelling the task iterating it is clean.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Literal

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.errors import BKInterfaceError
from bookkeeper_aio.log._common import log_manager
from bookkeeper_aio.log.position import LogPosition, LogRecord
from metadata.log_manager import LogManager

FOLLOW_POLL_S_INITIAL = 0.01
FOLLOW_POLL_S_MAX = 0.5
"""Between reads of the log metadata while a following reader waits for the next ledger."""


async def open_log_reader(
    bk: BookKeeper,
    name: str,
    *,
    start: Literal["earliest"] | LogPosition = "earliest",
    password: bytes = b"",
    follow: bool = False,
) -> AsyncGenerator[LogRecord, None]:
    """Every record from ``start`` (inclusive) in log order: to the log's current end, or, with
    ``follow=True``, on and on as the writer appends (see the module docstring).

    Raises NoSuchLog (naming the log), MetadataFormatError (a corrupt log key, naming the log),
    BKInterfaceError (``start`` not in the log), and the ledger API's read errors.
    """
    manager = log_manager(bk)
    versioned = await manager.read(name)
    ledger_ids = versioned.metadata.ledger_ids
    first_index, first_entry = 0, 0
    if start != "earliest":
        if not isinstance(start, LogPosition):
            raise BKInterfaceError(f"start must be 'earliest' or a LogPosition, got {start!r}")
        if start.ledger_id not in ledger_ids:
            raise BKInterfaceError(f"log {name!r}: ledger {start.ledger_id} is not in the log")
        first_index, first_entry = ledger_ids.index(start.ledger_id), max(0, start.entry_id)
    if follow:
        return _follow(bk, manager, name, ledger_ids[first_index:], first_entry, password)
    return _records(bk, ledger_ids[first_index:], first_entry, password)


async def _records(
    bk: BookKeeper, ledger_ids: tuple[int, ...], first_entry: int, password: bytes
) -> AsyncGenerator[LogRecord, None]:
    for index, ledger_id in enumerate(ledger_ids):
        handle = await bk.open_ledger(ledger_id, password=password)
        first = first_entry if index == 0 else 0
        last = handle.last_add_confirmed
        if last < first:
            continue
        async for entry in handle.read(first, last):
            yield LogRecord(LogPosition(ledger_id, entry.entry_id), entry.payload)


async def _follow(
    bk: BookKeeper,
    manager: LogManager,
    name: str,
    ledger_ids: tuple[int, ...],
    first_entry: int,
    password: bytes,
) -> AsyncGenerator[LogRecord, None]:
    pending = list(ledger_ids)
    done = -1  # the last ledger read to its end; the next ones have larger ids
    next_entry = first_entry
    while True:
        while pending:
            ledger_id = pending.pop(0)
            handle = await bk.open_ledger(ledger_id, password=password)
            entries = handle.tail(next_entry)
            async with contextlib.aclosing(entries):
                async for entry in entries:
                    yield LogRecord(LogPosition(ledger_id, entry.entry_id), entry.payload)
            done, next_entry = ledger_id, 0  # closed and read to its last entry
        pending = await _next_ledgers(manager, name, done)


async def _next_ledgers(manager: LogManager, name: str, after: int) -> list[int]:
    """The ledgers of the list after ledger ``after``, once there are some."""
    delay_s = FOLLOW_POLL_S_INITIAL
    while True:
        versioned = await manager.read(name)
        later = [ledger_id for ledger_id in versioned.metadata.ledger_ids if ledger_id > after]
        if later:
            return later
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, FOLLOW_POLL_S_MAX)
