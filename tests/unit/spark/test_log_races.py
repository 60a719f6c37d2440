"""The Spark source and sink against races of the log, on fake bookies and MemoryStore (no Spark
session: the executor- and driver-side coroutines are called directly)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

import pytest

from bookkeeper_aio import BookKeeper, CommitTokenReused, LogPosition, describe_log, open_log_writer
from bookkeeper_aio.spark import stream_writer
from bookkeeper_aio.spark import writer as spark_writer
from bookkeeper_aio.spark.catalog import log_extents
from bookkeeper_aio.spark.options import SparkOptionError
from bookkeeper_aio.spark.plan import EntryRange, plan_ranges
from bookkeeper_aio.spark.reader import ReadSpec, _entries
from bookkeeper_aio.spark.stream import batch_extents, stable_end
from bookkeeper_aio.spark.writer import WriteSpec
from metadata.errors import MetadataUnavailable
from tests.unit.log.fakes import world


@contextlib.asynccontextmanager
async def client() -> AsyncIterator[BookKeeper]:
    async with world(clients=1) as w:
        yield w.clients[0]


async def _read(bk: BookKeeper, entries: EntryRange, sequenced: bool) -> list[tuple[int, bytes]]:
    return [item async for item in _entries(bk, ReadSpec("unused", "s", b""), entries, sequenced)]


async def test_a_sequenced_range_is_read_to_its_planned_end_though_the_task_sees_a_lower_lac() -> None:
    """The driver planned entries 0..4 (it saw LAC 4); the task's first LAC read answers 2. It must
    read 0..4, not stop at 2 (a streaming query would commit past the missing records)."""
    async with client() as bk:
        writer = await open_log_writer(bk, "s", sequenced=True)
        for seq in range(1, 4):
            await writer.append(b"r%d" % seq, sequence=seq)
        await asyncio.sleep(0.3)  # the explicit LAC tells the bookies 2
        planned = EntryRange(writer.ledger_id, 0, 4, 0)
        task = asyncio.create_task(_read(bk, planned, True))
        await asyncio.sleep(0.3)
        for seq in range(4, 6):  # entries 3 and 4, acknowledged while the task reads
            await writer.append(b"r%d" % seq, sequence=seq)
        got = await asyncio.wait_for(task, 10)
        assert got == [(i, b"r%d" % (i + 1)) for i in range(5)]
        # the same range once the LAC is there, and a range ending before the LAC
        assert await _read(bk, planned, True) == got
        assert await _read(bk, EntryRange(writer.ledger_id, 1, 2, 1), True) == got[1:3]
        await writer.close()


async def test_a_committed_batch_write_is_reported_committed_though_its_sweep_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once the CAS listed the job's ledgers the job is committed: a failing look for leftovers
    afterwards must not fail it (a rerun would write every row twice)."""

    async def unreachable(bk: BookKeeper, spec: WriteSpec) -> list[int]:
        raise MetadataUnavailable("ledgers/", "etcd did not answer")

    monkeypatch.setattr(spark_writer, "_ledgers_of_job", unreachable)
    async with client() as bk:
        writer = await open_log_writer(bk, "out")
        await writer.append(b"x")
        await writer.close()
        spec = WriteSpec("unused", "out", b"", "payload", 3, 2, 2, "job-1", writer.ledger_id)
        handle = await bk.create_ledger(3, 2, 2, after_ledger_id=writer.ledger_id)
        await handle.append(b"row")
        await handle.close()
        assert await spark_writer.commit_with(bk, spec, [handle.id], None, sweep=True) is True
        assert handle.id in [ledger.ledger_id for ledger in (await describe_log(bk, "out")).ledgers]


def test_a_streaming_batch_below_its_writer_ids_committed_one_fails_naming_writer_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def reused(
        spec: WriteSpec, ledger_ids: list[int], token: tuple[str, int], *, sweep: bool, tag: str | None
    ) -> bool:
        raise CommitTokenReused(spec.log, token[0], token[1], 2)

    monkeypatch.setattr(stream_writer, "commit_ledgers", reused)
    sink = stream_writer.BookKeeperStreamWriter.__new__(stream_writer.BookKeeperStreamWriter)
    sink.spec = WriteSpec("unused", "out", b"", "payload", 3, 2, 2, "job-1")
    sink.writer_id = "enricher"
    written = stream_writer.BatchLedgerWritten(spark_writer.LedgerWritten(12, 1, 3), "enricher")
    with pytest.raises(
        SparkOptionError, match=r"writer id 'enricher' already committed batch 2 into log 'out'.*new writerId"
    ) as caught:
        sink.commit([written], 0)
    assert caught.value.option == "writerId"
    assert isinstance(caught.value.__cause__, CommitTokenReused)


async def test_a_streaming_batch_equal_to_its_writer_ids_committed_one_from_another_query_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second query (a new checkpoint) with the same writerId reaches the batch id the first one
    committed last: the token carries the query id as its tag, so the batch is refused, not taken
    for a replay (its rows deleted, the query reporting success); the first query's own replay of
    that batch is still skipped."""
    async with client() as bk:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(
            stream_writer.runtime, "run", lambda make: asyncio.run_coroutine_threadsafe(make(), loop).result()
        )
        monkeypatch.setattr(stream_writer, "commit_ledgers", functools.partial(spark_writer.commit_with, bk))
        sink = stream_writer.BookKeeperStreamWriter.__new__(stream_writer.BookKeeperStreamWriter)
        sink.spec = WriteSpec("unused", "out", b"", "payload", 3, 2, 2, "job-1")
        sink.writer_id = "orders-sink"

        async def commit(query_id: str, batch_id: int) -> None:
            handle = await bk.create_ledger(
                3, 2, 2, after_ledger_id=await spark_writer.last_ledger_id(bk, "out")
            )
            await handle.append(b"row of " + query_id.encode())
            await handle.close()
            written = spark_writer.LedgerWritten(handle.id, 1, 10)
            message = stream_writer.BatchLedgerWritten(written, "orders-sink", query_id)
            await asyncio.to_thread(sink.commit, [message], batch_id)

        await commit("query-1", 0)
        first = await describe_log(bk, "out")
        listed = [ledger.ledger_id for ledger in first.ledgers]
        with pytest.raises(
            SparkOptionError,
            match=r"already committed batch 0 into log 'out', from another query \(query-1\)",
        ) as caught:
            await commit("query-2", 0)
        assert caught.value.option == "writerId"
        assert isinstance(caught.value.__cause__, CommitTokenReused)
        assert (await describe_log(bk, "out")).version == first.version
        assert [ledger_id async for ledger_id in bk.list_ledgers()] == listed  # its ledger: deleted
        await commit("query-1", 0)  # the first query's replay of its batch: nothing changes
        assert (await describe_log(bk, "out")).version == first.version
        assert [ledger_id async for ledger_id in bk.list_ledgers()] == listed


async def test_a_streaming_batch_reads_its_whole_interval_though_a_later_lac_read_answers_lower() -> None:
    """latestOffset's LAC read saw 19 (one bookie had the entry carrying it); partitions()' read
    covers the ensemble with the others (12): the batch is still planned, and read, to entry 19
    (the next batch starts at 20: entries 13..19 would be read by no batch)."""
    async with world(clients=2) as w:
        writer_bk, driver_bk = w.clients
        writer = await open_log_writer(writer_bk, "s")
        for i in range(20):
            await writer.append(b"r%d" % i)
        ledger_id = writer.ledger_id
        ensemble = (await driver_bk.open_ledger(ledger_id)).metadata.ensembles[-1][1]
        for bookie, lac in zip(ensemble, [19] + [12] * (len(ensemble) - 1), strict=True):
            w.cluster.by_id(bookie).ledgers[ledger_id].lac = lac
        start = LogPosition(ledger_id, 0)
        _, seen = await log_extents(driver_bk, "s", b"")  # latestOffset()
        end = stable_end(seen, start, None)
        assert end == LogPosition(ledger_id, 20)
        w.cluster.by_id(ensemble[0]).pause()  # it answers late this time
        _, again = await log_extents(driver_bk, "s", b"")  # partitions(start, end)
        assert again[-1].last_entry_id < 19  # the lower answer
        ranges = plan_ranges(batch_extents("s", again, end), start, end, 1000)
        assert [(r.ledger_id, r.first, r.last) for r in ranges] == [(ledger_id, 0, 19)]
        # the task waits for its LAC to reach 19 (the late bookie answers again meanwhile)
        task = asyncio.create_task(_read(driver_bk, ranges[0], False))
        await asyncio.sleep(0.2)
        w.cluster.by_id(ensemble[0]).resume()
        assert await asyncio.wait_for(task, 10) == [(i, b"r%d" % i) for i in range(20)]
        await writer.close()
