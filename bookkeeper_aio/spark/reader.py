"""Batch reads: plan on the driver (which entries), read on the executors (batch reads per range).

The driver lists the ledgers (a log's list, or the ``ledgers`` option), opens each to learn what
is readable now (a closed ledger's last entry, an open one's last add confirmed) and cuts the
positions between ``startingPosition`` (inclusive) and ``endingPosition`` (exclusive) into
:class:`~bookkeeper_aio.spark.plan.EntryRange` partitions. Each executor task opens the ledger
with its own client and reads its range in order (``ReadHandle.read``: BATCH_READs when every
bookie holds every entry; a sequenced log's through the log reader), turning entries into Arrow
record batches.

Arrow rather than row tuples: measured in docs/benchmarks.md ("Spark batch read"), row tuples
cost Spark a Python-to-JVM conversion per row.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    LogPosition,
    NoSuchLedger,
    ReadHandle,
    open_log_reader,
)
from bookkeeper_aio.spark import options as opt
from bookkeeper_aio.spark import runtime
from bookkeeper_aio.spark.catalog import connect, log_extents, open_checked
from bookkeeper_aio.spark.plan import EntryRange, LedgerExtent, in_log_order, plan_ranges

if TYPE_CHECKING:
    from pyarrow import RecordBatch

SCHEMA_DDL = "log STRING, ledger_id BIGINT, entry_id BIGINT, payload BINARY, offset BIGINT"
"""The rows of a read (docs/spark.md "Schema"). ``log`` is null for a read of explicit ledgers;
``offset`` (the entry's index in the whole log) is null where the log does not know it."""

READ_SCHEMA = StructType(
    [
        StructField("log", StringType()),
        StructField("ledger_id", LongType()),
        StructField("entry_id", LongType()),
        StructField("payload", BinaryType()),
        StructField("offset", LongType()),
    ]
)


def check_read_schema(schema: StructType) -> None:
    """A schema given with ``.schema(...)`` must be the source's own: the rows are what they are."""
    if schema != READ_SCHEMA:
        raise opt.SparkOptionError(
            "schema",
            f"the bookkeeper source's rows are ({SCHEMA_DDL}), got ({schema.simpleString()}); leave "
            "out .schema(...) and select or cast columns after load()",
        )


ARROW_SCHEMA = pa.schema(
    [
        ("log", pa.string()),
        ("ledger_id", pa.int64()),
        ("entry_id", pa.int64()),
        ("payload", pa.binary()),
        ("offset", pa.int64()),
    ]
)

LAC_CATCH_UP_S = 5.0
LAC_CATCH_UP_POLL_S = 0.05

BATCH_ROWS_MAX = 4096
BATCH_BYTES_MAX = 8 * 1024 * 1024
"""An Arrow batch is cut at 4096 rows or 8 MiB of payload, whichever first: big enough to amortise
the per-batch cost of crossing to the JVM, small enough to bound a task's memory."""


class RangePartition(InputPartition):
    """One task's work: a range of one ledger (pickled to the executor); ``sequenced``: of a
    sequenced log (read through the log reader, which strips headers and drops duplicates)."""

    def __init__(self, index: int, entries: EntryRange, sequenced: bool = False) -> None:
        super().__init__(index)
        self.entries = entries
        self.sequenced = sequenced

    def __repr__(self) -> str:
        e = self.entries
        return f"RangePartition(ledger {e.ledger_id}, entries {e.first}..{e.last})"


@dataclass(frozen=True, slots=True)
class ReadSpec:
    """Everything an executor needs to read a partition (plain data: pickled)."""

    metadata: str
    log: str | None
    password: bytes = field(repr=False)  # logs and tracebacks print the repr


def check_listed(
    name: str, position: LogPosition, log: str | None, ids: Sequence[int], truncated_before: int
) -> None:
    """Raise SparkOptionError naming the option ``name`` when ``position``'s ledger is not among
    ``ids``: the ledgers of ``log`` (those truncated said so), or those read (``log`` None)."""
    if position.ledger_id in ids:
        return
    if log is None:
        problem = f"ledger {position.ledger_id} is not among the ledgers read ({list(ids)})"
    elif position.ledger_id < truncated_before:
        problem = (
            f"ledger {position.ledger_id} of log {log!r} was truncated (the log starts at "
            f'ledger {truncated_before}); start at "earliest" or a later position'
        )
    else:
        problem = f"ledger {position.ledger_id} is not in log {log!r} (its ledgers: {list(ids)})"
    raise opt.SparkOptionError(name, problem)


class BookKeeperBatchReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        opt.check_known(options, opt.READ_OPTIONS, "batch read")
        source = opt.parse_source(options, allow_ledgers=True)
        self.spec = ReadSpec(source.metadata, source.log, source.password)
        self.ledgers = source.ledgers
        start = opt.parse_position(options, opt.STARTING_POSITION, "earliest", ("earliest",))
        end = opt.parse_position(options, opt.ENDING_POSITION, "latest", ("latest",))
        self.start = start if isinstance(start, LogPosition) else None
        self.end = end if isinstance(end, LogPosition) else None
        max_entries = opt.parse_positive_int(
            options, opt.MAX_ENTRIES_PER_PARTITION, opt.MAX_ENTRIES_PER_PARTITION_DEFAULT
        )
        assert max_entries is not None
        self.max_entries = max_entries

    def partitions(self) -> Sequence[InputPartition]:
        truncated_before, sequenced, extents = runtime.run(self._extents)
        ids = [extent.ledger_id for extent in extents]
        for name, position in ((opt.STARTING_POSITION, self.start), (opt.ENDING_POSITION, self.end)):
            if position is not None:
                check_listed(name, position, self.spec.log, ids, truncated_before)
        if self.start is not None and self.end is not None and self.end < self.start:
            raise opt.SparkOptionError(
                opt.ENDING_POSITION, f"{tuple(self.end)} is before the startingPosition {tuple(self.start)}"
            )
        if self.spec.log is not None:  # a log's ledgers in order, up to its first open one
            extents = in_log_order(extents)
        ranges = plan_ranges(extents, self.start, self.end, self.max_entries)
        return [RangePartition(i, entries, sequenced) for i, entries in enumerate(ranges)]

    async def _extents(self) -> tuple[int, bool, list[LedgerExtent]]:
        async with connect(self.spec.metadata) as bk:
            if self.spec.log is not None:
                info, extents = await log_extents(bk, self.spec.log, self.spec.password)
                return info.truncated_before, info.sequenced, extents
            assert self.ledgers is not None
            return 0, False, await ledger_extents(bk, self.ledgers, self.spec.password)

    def read(self, partition: InputPartition) -> Iterator[RecordBatch]:
        assert isinstance(partition, RangePartition)
        return read_range(self.spec, partition.entries, partition.sequenced)


async def ledger_extents(bk: BookKeeper, ledger_ids: Sequence[int], password: bytes) -> list[LedgerExtent]:
    async def one(ledger_id: int) -> LedgerExtent:
        try:
            handle = await open_checked(bk, ledger_id, password)
        except NoSuchLedger:
            raise opt.SparkOptionError(opt.LEDGERS, f"ledger {ledger_id} does not exist") from None
        return LedgerExtent(ledger_id, handle.last_add_confirmed, None, handle.is_closed)

    return list(await asyncio.gather(*(one(ledger_id) for ledger_id in ledger_ids)))


def read_range(spec: ReadSpec, entries: EntryRange, sequenced: bool) -> Iterator[RecordBatch]:
    return runtime.iterate(lambda: _batches(spec, entries, sequenced))


async def _batches(spec: ReadSpec, entries: EntryRange, sequenced: bool) -> AsyncIterator[RecordBatch]:
    async with connect(spec.metadata, probe=False) as bk:
        ids: list[int] = []
        payloads: list[bytes] = []
        size = 0
        async for entry_id, payload in _entries(bk, spec, entries, sequenced):
            assert entries.first <= entry_id <= entries.last
            assert not ids or ids[-1] < entry_id
            ids.append(entry_id)
            payloads.append(payload)
            size += len(payload)
            if len(payloads) >= BATCH_ROWS_MAX or size >= BATCH_BYTES_MAX:
                yield _batch(spec.log, entries, ids, payloads)
                ids, payloads, size = [], [], 0
        if payloads:
            yield _batch(spec.log, entries, ids, payloads)


async def _entries(
    bk: BookKeeper, spec: ReadSpec, entries: EntryRange, sequenced: bool
) -> AsyncIterator[tuple[int, bytes]]:
    """(entry id, payload) of the range: every entry of it (the driver saw them confirmed, so they
    are there), never fewer. A sequenced log's through the log reader (headers stripped, duplicates
    dropped, a truncated range ``LogTruncated``), following the ledger up to the range's end: this
    task's LAC may lag the driver's, and stopping at it would skip records silently; any other
    log's straight from the ledger."""
    handle = await bk.open_ledger(entries.ledger_id, password=spec.password)
    await _catch_up(handle, entries.last)
    if sequenced:
        assert spec.log is not None
        if handle.last_add_confirmed < entries.last:  # as handle.read refuses it: Spark retries
            raise BKInterfaceError(
                f"ledger {entries.ledger_id}: entry {entries.last} is beyond the last add confirmed "
                f"{handle.last_add_confirmed} (the driver saw it confirmed)"
            )
        start = LogPosition(entries.ledger_id, entries.first)
        end = LogPosition(entries.ledger_id, entries.last + 1)
        records = await open_log_reader(
            bk, spec.log, start=start, end=end, password=spec.password, follow=True
        )
        async with contextlib.aclosing(records):
            async for record in records:
                yield record.position.entry_id, record.payload
        return
    async for entry in handle.read(entries.first, entries.last):
        yield entry.entry_id, entry.payload


async def _catch_up(handle: ReadHandle, last: int) -> None:
    """Wait until this handle's last add confirmed reaches ``last`` (the driver saw it confirmed;
    another reader's LAC read may answer lower for a moment). Past the deadline ``read`` refuses
    the range with an error naming the LAC, and Spark retries the task."""
    deadline = asyncio.get_running_loop().time() + LAC_CATCH_UP_S
    while handle.last_add_confirmed < last and asyncio.get_running_loop().time() < deadline:
        if await handle.refresh_lac() < last:
            await asyncio.sleep(LAC_CATCH_UP_POLL_S)


def _batch(log: str | None, entries: EntryRange, ids: list[int], payloads: list[bytes]) -> RecordBatch:
    n = len(payloads)
    if entries.first_offset is None:
        offsets = pa.nulls(n, pa.int64())
    else:
        base = entries.first_offset - entries.first
        offsets = pa.array([base + entry_id for entry_id in ids], pa.int64())
    columns: list[Any] = [
        pa.array([log] * n, pa.string()) if log is not None else pa.nulls(n, pa.string()),
        pa.array([entries.ledger_id] * n, pa.int64()),
        pa.array(ids, pa.int64()),
        pa.array(payloads, pa.binary()),
        offsets,
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)
