"""The log reader (docs/api.md "Logs"): records across ledger boundaries, in order, each once.

``follow=False`` (the default) reads to the log's **current end** and stops: every entry of the
ledgers the list marks CLOSED (or whose ledger metadata is closed), and of an OPEN ledger up to its
last add confirmed at the time it is reached.

``follow=True`` tails the log and never ends by itself: each ledger of the list is read with
`ReadHandle.tail` (caught up: long-poll LAC reads), which ends once that ledger is closed (a roll,
the writer's close, or a takeover's recovery: the metadata's last entry bounds it, never a bookie's
LAC) and its last entry was handed out. The reader then watches the log's metadata key until a
ledger after it is in the list, and goes on at that ledger's entry 0. Ledger ids grow along the
list, so positions come out strictly increasing. Close it with ``aclose()`` (or
``contextlib.aclosing``); cancelling the task iterating it is clean.

Both modes stop before ``end`` (exclusive) when given. A position the log no longer holds raises
`LogTruncated` — at the start, or when a ledger disappears under the reader because a truncation
removed it — never a silent gap. Sequenced logs: the header is stripped into ``record.sequence``,
and a record whose sequence is not above the last one handed out is dropped (a duplicate).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Literal

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.read_handle import LedgerEntry, ReadHandle
from bookkeeper_aio.errors import BKInterfaceError, LogTruncated, NoSuchLedger, NoSuchLog
from bookkeeper_aio.log import records
from bookkeeper_aio.log._common import log_manager
from bookkeeper_aio.log.position import LogPosition, LogRecord, check_position
from metadata.log_manager import LogManager
from metadata.log_metadata import LogLedger, LogMetadata

START_LAC_WAIT_S = 2.0
START_LAC_POLL_S = 0.05
"""How long a start position past an open ledger's LAC waits for the LAC to catch up."""

Start = Literal["earliest", "latest"] | LogPosition


async def open_log_reader(
    bk: BookKeeper,
    name: str,
    *,
    start: Start = "earliest",
    end: LogPosition | None = None,
    password: bytes = b"",
    follow: bool = False,
) -> AsyncGenerator[LogRecord, None]:
    """Every record from ``start`` (inclusive; "latest": after the records confirmed now, so a
    follower reads every append acknowledged after this call returned, also during a roll) up to
    ``end`` (exclusive), in log order: to the log's current end, or, with ``follow=True``, on and on
    as the writer appends (see the module docstring).

    Raises NoSuchLog (naming the log), MetadataFormatError (a corrupt log key, naming the log),
    LogTruncated (``start`` was truncated), BKInterfaceError (``start`` not in the log, bad
    arguments), and the ledger API's read errors.
    """
    if end is not None:
        check_position(end, "end")
    manager = log_manager(bk)
    md = (await manager.read(name)).metadata
    first_index, first_entry = await _start_at(bk, md, start, password)
    walk = _Walk(bk, manager, md, password, end)
    ledgers = md.ledgers[first_index:]
    if follow:
        return walk.follow(ledgers, first_entry)
    return walk.to_current_end(ledgers, first_entry)


async def _start_at(bk: BookKeeper, md: LogMetadata, start: Start, password: bytes) -> tuple[int, int]:
    """(index in the list, entry id) of the first record to read."""
    ledger_ids = md.ledger_ids
    if start == "earliest":
        return 0, 0
    if start == "latest":
        # After every record confirmed now, in the first ledger that may still take appends: only
        # the last two can (a roll lists the new ledger first; the previous one takes appends until
        # the writer switches, then it is closed). All closed: after the last one.
        last = len(ledger_ids) - 1
        for index in range(max(0, last - 1), last + 1):
            try:
                handle = await bk.open_ledger(ledger_ids[index], password=password)
            except NoSuchLedger:
                if index == last:
                    raise
                continue  # truncated since the list was read: it was closed
            if not handle.is_closed or index == last:
                return index, handle.last_add_confirmed + 1
        return 0, 0  # an empty list
    if not isinstance(start, LogPosition):
        raise BKInterfaceError(f"start must be 'earliest', 'latest' or a LogPosition, got {start!r}")
    check_position(start, "start")
    if start.ledger_id < md.truncated_before or (ledger_ids and start.ledger_id < ledger_ids[0]):
        raise LogTruncated(md.name, f"position {tuple(start)}", _first_position(md))
    if start.ledger_id not in ledger_ids:
        raise BKInterfaceError(f"log {md.name!r}: ledger {start.ledger_id} is not in the log")
    await _check_not_beyond_end(bk, md.name, start, password)
    return ledger_ids.index(start.ledger_id), start.entry_id


async def _check_not_beyond_end(bk: BookKeeper, name: str, start: LogPosition, password: bytes) -> None:
    """A start may be at most one past its ledger's last record (where a consumer that read that
    record resumes); further would skip records that may yet exist. An open ledger's LAC may lag an
    acknowledged append until the writer's next add or explicit LAC, so it gets a short wait."""
    handle = await bk.open_ledger(start.ledger_id, password=password)
    deadline = asyncio.get_running_loop().time() + START_LAC_WAIT_S
    while start.entry_id > handle.last_add_confirmed + 1:
        if handle.is_closed or asyncio.get_running_loop().time() >= deadline:
            state = "closed" if handle.is_closed else "open"
            raise BKInterfaceError(
                f"log {name!r}: position {tuple(start)} is beyond the end of ledger {start.ledger_id} "
                f"({state}, last confirmed entry {handle.last_add_confirmed}): start at most one past it"
            )
        await asyncio.sleep(START_LAC_POLL_S)
        await handle.refresh_lac()


def _first_position(md: LogMetadata) -> tuple[int, int] | None:
    return (md.ledgers[0].ledger_id, 0) if md.ledgers else None


class _Walk:
    """One reader's state: where it is, the sequence it passed, where it stops."""

    def __init__(
        self, bk: BookKeeper, manager: LogManager, md: LogMetadata, password: bytes, end: LogPosition | None
    ) -> None:
        self._bk = bk
        self._manager = manager
        self._name = md.name
        self._sequenced = md.sequenced
        self._password = password
        self._end = end
        self._last_sequence = -1
        self._truncated_at_start = md.truncated_before

    async def to_current_end(
        self, ledgers: tuple[LogLedger, ...], first_entry: int
    ) -> AsyncGenerator[LogRecord, None]:
        for index, listed in enumerate(ledgers):
            ledger_id = listed.ledger_id
            if self._past_end(ledger_id, 0):
                return
            handle = await self._open(ledger_id)
            first = first_entry if index == 0 else 0
            last = handle.last_add_confirmed
            if self._end is not None and ledger_id == self._end.ledger_id:
                last = min(last, self._end.entry_id - 1)
            if last >= first:
                async for record in self._records(ledger_id, handle.read(first, last)):
                    yield record
            if not handle.is_closed and index < len(ledgers) - 1:
                # A roll listed the next ledger but has not closed this one yet: appends acked on it
                # may still be beyond its LAC. The current end is here, not in the next ledger.
                return

    async def follow(
        self, ledgers: tuple[LogLedger, ...], first_entry: int
    ) -> AsyncGenerator[LogRecord, None]:
        pending = list(ledgers)
        done = -1  # the last ledger read to its end; the next ones have larger ids
        done_end: int | None = None  # the log offset after its last record, when known
        next_entry = first_entry
        while True:
            while pending:
                listed = pending.pop(0)
                ledger_id = listed.ledger_id
                if self._past_end(ledger_id, next_entry):
                    return
                start_offset = listed.first_offset if listed.first_offset is not None else done_end
                handle = await self._open(ledger_id)
                entries = handle.tail(next_entry)
                async with contextlib.aclosing(entries):
                    async for record in self._records(ledger_id, self._before_end(ledger_id, entries)):
                        yield record
                if self._end is not None and ledger_id >= self._end.ledger_id:
                    return  # read up to ``end`` (or this ledger closed before it): nothing later
                done, next_entry = ledger_id, 0  # closed and read to its last entry
                count = handle.last_add_confirmed + 1
                done_end = None if start_offset is None else start_offset + count
            pending = await self._next_ledgers(done, done_end)

    def _past_end(self, ledger_id: int, entry_id: int) -> bool:
        return self._end is not None and LogPosition(ledger_id, entry_id) >= self._end

    async def _before_end(
        self, ledger_id: int, entries: AsyncIterator[LedgerEntry]
    ) -> AsyncGenerator[LedgerEntry, None]:
        """``entries`` up to the one just before ``end``, then stop: a tail does not wait for an
        entry past the end (nor does a duplicate dropped at the end keep it waiting)."""
        async for entry in entries:
            if self._past_end(ledger_id, entry.entry_id):
                return
            yield entry
            if self._past_end(ledger_id, entry.entry_id + 1):
                return

    async def _records(
        self, ledger_id: int, entries: AsyncIterator[LedgerEntry]
    ) -> AsyncGenerator[LogRecord, None]:
        try:
            async for entry in entries:
                data = entry.payload
                position = LogPosition(ledger_id, entry.entry_id)
                if not self._sequenced:
                    yield LogRecord(position, data)
                    continue
                sequence, payload = records.decode_sequenced(data, where=f"log {self._name!r} {position}")
                if sequence <= self._last_sequence:
                    continue  # a duplicate of a record already handed out
                self._last_sequence = sequence
                yield LogRecord(position, payload, sequence)
        except NoSuchLedger as error:
            raise await self._truncated(ledger_id) from error

    async def _open(self, ledger_id: int) -> ReadHandle:
        try:
            return await self._bk.open_ledger(ledger_id, password=self._password)
        except NoSuchLedger as error:
            raise await self._truncated(ledger_id) from error

    async def _truncated(self, ledger_id: int) -> BaseException:
        """The error for a listed ledger that vanished: `LogTruncated` when a truncation removed
        it, else the ledger's own NoSuchLedger (someone deleted a listed ledger: data loss)."""
        md = (await self._manager.read(self._name)).metadata
        if ledger_id < md.truncated_before:
            return LogTruncated(self._name, f"ledger {ledger_id}, being read,", _first_position(md))
        return NoSuchLedger(
            f"log {self._name!r}: listed ledger {ledger_id} does not exist (deleted by hand?)"
        )

    async def _next_ledgers(self, after: int, after_end: int | None) -> list[LogLedger]:
        """The ledgers of the list after ledger ``after``, once there are some: from a watch of the
        log's key (the current list first, then each change). Truncation removes a prefix of the
        list, so records can have gone between ``after`` and the next ledger only if ``after``
        itself was truncated: then the next ledger's first offset must be ``after_end`` (the log
        offset after ``after``'s last record), else it is `LogTruncated`, never a silent gap.
        Raises NoSuchLog once the log is deleted."""
        changes = self._manager.watch(self._name)
        async with contextlib.aclosing(changes):
            async for versioned in changes:
                if versioned is None:
                    raise NoSuchLog(self._name)
                md = versioned.metadata
                later = [entry for entry in md.ledgers if entry.ledger_id > after]
                if not later:
                    continue
                if after < 0:  # nothing read yet: only a truncation since the reader started counts
                    gap = md.truncated_before > self._truncated_at_start
                else:
                    gap = md.truncated_before > after and (
                        after_end is None or later[0].first_offset != after_end
                    )
                if gap:
                    raise LogTruncated(self._name, f"the part after ledger {after}", _first_position(md))
                return later
        raise NoSuchLog(self._name)
