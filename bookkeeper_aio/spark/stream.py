"""Streaming reads: micro-batches between log positions, exactly once from the checkpoint.

An offset is the log position of the next record to read, ``{"ledger_id": L, "entry_id": E}``;
a micro-batch reads the positions ``[start, end)``. Spark checkpoints each batch's offsets before
running it and replays exactly that interval after a restart, so every entry reaches the sink
once as long as an interval always holds the same entries. Two rules make it so:

- ``latestOffset`` never ends a batch past the first ledger that is not closed (an open
  ledger's entries above its last add confirmed are not final yet, and a roll leaves the previous
  ledger open for a moment): it ends at that ledger's LAC + 1 and the ledgers after it wait until
  it is closed. Entries up to a LAC survive any recovery, so ``[start, end)`` is fixed forever.
- ledger ids grow along the list, so position order is log order across rolls and takeovers.
- ``partitions(start, end)`` (and a driver replaying a checkpointed batch) plans exactly
  ``[start, end)``: it trusts the interval, not a fresh LAC read, which may answer lower (another
  set of bookies covers the ensemble) and would leave the entries above it in no batch. Every
  ledger before ``end``'s was closed when the interval was chosen, and ``end``'s holds at least
  ``end.entry_id`` confirmed entries; a task whose LAC lags waits for them (or fails: Spark
  retries it).

``maxEntriesPerTrigger`` bounds a batch (Spark's ``ReadMaxRows``); ``Trigger.AvailableNow`` reads to
the end seen when the query starts. With ``cursor``, a fresh query starts after the cursor's
position, and each committed batch moves the cursor to its last record (``commit_cursor``): the
log's truncation and retention never remove what the query has not consumed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from bookkeeper_aio import LogInfo, LogPosition, LogTruncated, commit_cursor, read_cursors
from bookkeeper_aio.spark import options as opt
from bookkeeper_aio.spark import runtime
from bookkeeper_aio.spark.catalog import connect, log_extents
from bookkeeper_aio.spark.plan import LedgerExtent, plan_ranges
from bookkeeper_aio.spark.reader import RangePartition, ReadSpec, check_listed, read_range

if TYPE_CHECKING:
    from pyarrow import RecordBatch

Offset = dict[str, int]


def to_offset(position: LogPosition, log_offset: int | None = None) -> Offset:
    """Spark's offset for ``position``; ``log_offset`` (the log-wide index of the record at
    ``position``) when known, which tells a truncation that removed only consumed records from one
    that removed unread ones."""
    offset = {"ledger_id": position.ledger_id, "entry_id": position.entry_id}
    if log_offset is not None:
        offset["offset"] = log_offset
    return offset


def from_offset(offset: Mapping[str, Any]) -> tuple[LogPosition, int | None]:
    fields = dict(offset)
    log_offset = fields.pop("offset", None)
    if log_offset is not None and (isinstance(log_offset, bool) or not isinstance(log_offset, int)):
        raise opt.SparkOptionError("offset", f"not an integer in the checkpointed {offset!r}")
    return opt.position_from_json("offset", fields), log_offset


def log_offset_of(extents: Sequence[LedgerExtent], position: LogPosition) -> int | None:
    for extent in extents:
        if extent.ledger_id == position.ledger_id:
            return None if extent.first_offset is None else extent.first_offset + position.entry_id
    return None


def check_not_truncated(
    log: str,
    extents: Sequence[LedgerExtent],
    truncated_before: int,
    start: LogPosition,
    log_offset: int | None,
) -> None:
    """Raise LogTruncated when truncation removed records at or after ``start`` before the query
    read them (never skip them silently). A start in a removed ledger is fine only when its log
    offset shows every record before the log's first remaining one was read. Truncation removes
    only ledgers below ``truncated_before``: a start below the first listed ledger but not below
    that (a query started on an empty log, at ``(truncated_before, 0)``) missed nothing."""
    first = extents[0] if extents else None
    if start.ledger_id >= truncated_before:
        return
    if first is None:
        return  # an empty log: nothing left to miss, nothing to read
    if log_offset is not None and first.first_offset is not None and log_offset >= first.first_offset:
        return
    raise LogTruncated(
        log,
        f"the streaming query's position {tuple(start)} (not read yet: use a cursor to hold retention back)",
        (first.ledger_id, 0),
    )


class BookKeeperStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: Mapping[str, str]) -> None:
        opt.check_known(options, opt.STREAM_READ_OPTIONS, "streaming read")
        source = opt.parse_source(options, allow_ledgers=False)
        assert source.log is not None
        self.log = source.log
        self.spec = ReadSpec(source.metadata, source.log, source.password)
        self.starting = opt.parse_position(options, opt.STARTING_POSITION, "latest", ("earliest", "latest"))
        self.max_per_trigger = opt.parse_positive_int(options, opt.MAX_ENTRIES_PER_TRIGGER, None)
        max_entries = opt.parse_positive_int(
            options, opt.MAX_ENTRIES_PER_PARTITION, opt.MAX_ENTRIES_PER_PARTITION_DEFAULT
        )
        assert max_entries is not None
        self.max_entries = max_entries
        self.cursor = opt.get(options, opt.CURSOR) or None
        self.target: LogPosition | None = None  # Trigger.AvailableNow: the end when it started

    # ------------------------------------------------------------------ offsets (driver)
    def initialOffset(self) -> Offset:
        return runtime.run(self._initial)

    async def _initial(self) -> Offset:
        async with connect(self.spec.metadata) as bk:
            info, extents = await log_extents(bk, self.log, self.spec.password)
            start: LogPosition | None = None
            if self.cursor is not None:
                consumed = (await read_cursors(bk, self.log)).get(self.cursor)
                if consumed is not None:
                    start = LogPosition(consumed.ledger_id, consumed.entry_id + 1)
        if start is None and isinstance(self.starting, LogPosition):
            ids = [extent.ledger_id for extent in extents]
            check_listed(opt.STARTING_POSITION, self.starting, self.log, ids, info.truncated_before)
            start = self.starting
        elif start is None and not extents:  # empty: its next ledger's id is above truncated_before
            start = LogPosition(info.truncated_before, 0)
        elif start is None and self.starting == "earliest":
            start = LogPosition(extents[0].ledger_id, 0)
        elif start is None:
            start = latest_start(extents)
        return to_offset(start, log_offset_of(extents, start))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        _, extents = runtime.run(self._log)
        self.target = stable_end(extents, LogPosition(0, 0), None)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> Offset:
        first, first_offset = from_offset(start)
        info, extents = runtime.run(self._log)
        check_not_truncated(self.log, extents, info.truncated_before, first, first_offset)
        rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = stable_end(extents, first, rows)
        if self.target is not None and end > self.target:
            end = max(first, self.target)
        if end == first:
            return dict(start)
        return to_offset(end, log_offset_of(extents, end))

    def reportLatestOffset(self) -> Offset | None:
        _, extents = runtime.run(self._log)
        end = stable_end(extents, LogPosition(0, 0), None)
        return to_offset(end, log_offset_of(extents, end))

    async def _log(self) -> tuple[LogInfo, list[LedgerExtent]]:
        async with connect(self.spec.metadata) as bk:
            return await log_extents(bk, self.log, self.spec.password)

    # ------------------------------------------------------------------ batches
    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        (first, first_offset), (last, _) = from_offset(start), from_offset(end)
        if last <= first:
            return []
        info, extents = runtime.run(self._log)
        check_not_truncated(self.log, extents, info.truncated_before, first, first_offset)
        ranges = plan_ranges(batch_extents(self.log, extents, last), first, last, self.max_entries)
        return [RangePartition(i, entries, info.sequenced) for i, entries in enumerate(ranges)]

    def read(self, partition: InputPartition) -> Iterator[RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_range(self.spec, partition.entries, partition.sequenced)

    def commit(self, end: dict[str, Any]) -> None:
        if self.cursor is not None:
            position, _ = from_offset(end)
            runtime.run(lambda: self._advance_cursor(position))

    async def _advance_cursor(self, end: LogPosition) -> None:
        async with connect(self.spec.metadata) as bk:
            _, extents = await log_extents(bk, self.log, self.spec.password)
            # the batch read up to end - 1, though this LAC read may answer lower: a cursor left
            # behind would make a query started from it read records again
            with contextlib.suppress(LogTruncated):
                extents = batch_extents(self.log, extents, end)
            consumed = last_before(extents, end)
            if consumed is not None:
                await commit_cursor(bk, self.log, self.cursor or "", consumed)


def stable_end(extents: Sequence[LedgerExtent], start: LogPosition, rows_max: int | None) -> LogPosition:
    """The end (exclusive) of the next batch from ``start``: at most ``rows_max`` entries (None: no
    bound), never past the first ledger that is not closed (see the module docstring)."""
    end = start
    budget = rows_max
    for extent in extents:
        if extent.ledger_id < start.ledger_id:
            continue
        first = start.entry_id if extent.ledger_id == start.ledger_id else 0
        available = max(0, extent.last_entry_id + 1 - first)
        take = available if budget is None else min(available, budget)
        if take:
            end = LogPosition(extent.ledger_id, first + take)
        if budget is not None:
            budget -= take
            if budget == 0:
                break
        if not extent.closed:
            break
    return max(end, start)


def latest_start(extents: Sequence[LedgerExtent]) -> LogPosition:
    """Where a query started at "latest" begins: after every entry readable now. With none readable
    yet (a writer just rolled and retention removed every ledger before the new one), at the first
    listed ledger's entry 0 — not (0, 0), a position below the log's truncation point that every
    later batch would refuse as truncated. ``extents`` not empty."""
    end = stable_end(extents, LogPosition(0, 0), None)
    return end if end != LogPosition(0, 0) else LogPosition(extents[0].ledger_id, 0)


def batch_extents(log: str, extents: Sequence[LedgerExtent], end: LogPosition) -> list[LedgerExtent]:
    """``extents`` as the batch ending at ``end`` (exclusive) saw them when its interval was chosen:
    ``end``'s ledger holds at least ``end.entry_id`` confirmed entries (a fresh LAC read may answer
    lower), and every ledger before it was closed (and a closed ledger's end never moves). Raises
    LogTruncated when a ledger holding entries of the batch is no longer listed."""
    adjusted: list[LedgerExtent] = []
    found = False
    for extent in extents:
        if extent.ledger_id == end.ledger_id:
            found = True
            extent = replace(extent, last_entry_id=max(extent.last_entry_id, end.entry_id - 1))
        elif extent.ledger_id < end.ledger_id:
            extent = replace(extent, closed=True)
        adjusted.append(extent)
    if not found and end.entry_id > 0:
        raise LogTruncated(
            log,
            f"ledger {end.ledger_id}, which holds records of the batch ending at {tuple(end)},",
            (extents[0].ledger_id, 0) if extents else None,
        )
    return adjusted


def last_before(extents: Sequence[LedgerExtent], end: LogPosition) -> LogPosition | None:
    """The position of the last readable entry before ``end`` (None: there is none)."""
    for extent in reversed(extents):
        if extent.ledger_id > end.ledger_id:
            continue
        last = extent.last_entry_id if extent.ledger_id < end.ledger_id else end.entry_id - 1
        last = min(last, extent.last_entry_id)
        if last >= 0:
            return LogPosition(extent.ledger_id, last)
    return None
