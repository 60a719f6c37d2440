"""Streaming reads through Spark into a file sink: every entry exactly once across a restart from
the checkpoint, while a writer appends and rolls; the named cursor follows the commits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from bookkeeper_aio import (
    BookKeeper,
    LogFenced,
    LogPosition,
    open_log_reader,
    open_log_writer,
    read_cursors,
    truncate_log,
)
from tests.integration.spark.conftest import Cluster, blocking

pytestmark = pytest.mark.etcd


def stream(spark: SparkSession, cluster: Cluster, name: str, sink: Path, **options: str):  # type: ignore[no-untyped-def]
    df = (
        spark.readStream.format("bookkeeper")
        .option("metadata", cluster.url)
        .option("password", "pw")
        .options(**options)
        .load(name)
    )
    return (
        df.writeStream.format("parquet")
        .option("path", str(sink / "data"))
        .option("checkpointLocation", str(sink / "checkpoint"))
    )


async def test_restart_from_the_checkpoint_reads_each_entry_once(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper, tmp_path: Path
) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "events", write_quorum=3, password=b"pw")
    for i in range(250):
        await writer.append(f"e{i}".encode())
        if i == 120:
            await writer.roll()
    options = {"startingPosition": "earliest", "maxEntriesPerTrigger": "100", "cursor": "etl"}

    # 1: read what is there now (AvailableNow), in batches of at most 100
    first = stream(spark, cluster, "events", tmp_path, **options).trigger(availableNow=True)
    query = await blocking(spark, first.start)
    await blocking(spark, query.awaitTermination)
    batches = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert max(batches) <= 100
    seen = sum(batches)
    assert 240 <= seen <= 250  # the open ledger is read up to its last add confirmed

    # 2: restart from the checkpoint while the writer appends, rolls, and another writer takes over
    second = stream(spark, cluster, "events", tmp_path, **options).trigger(processingTime="200 milliseconds")
    query = await blocking(spark, second.start)
    try:
        for i in range(250, 400):
            await writer.append(f"e{i}".encode())
            if i == 300:
                await writer.roll()
            if i % 75 == 0:
                await asyncio.sleep(0.2)  # let a trigger or two see the log mid-write
        async with await open_log_writer(bk, "events", write_quorum=3, password=b"pw") as taker:
            for i in range(400, 450):
                await taker.append(f"e{i}".encode())
        await blocking(spark, query.processAllAvailable)
    finally:
        await blocking(spark, query.stop)
    with pytest.raises(LogFenced):  # the takeover closed its ledger
        await writer.close()

    expected = [r async for r in await open_log_reader(bk, "events", password=b"pw")]
    assert [r.payload for r in expected] == [f"e{i}".encode() for i in range(450)]
    rows = spark.read.parquet(str(tmp_path / "data")).collect()
    got = sorted((LogPosition(r.ledger_id, r.entry_id), bytes(r.payload)) for r in rows)
    assert got == [(r.position, r.payload) for r in expected]  # each once, none missing
    # Spark confirms a batch to the source when it plans the next one: the cursor trails the sink
    # by at most the last batch (<= 100 entries), and never passes what the sink holds
    cursor = (await read_cursors(bk, "events"))["etl"]
    positions = [r.position for r in expected]
    assert cursor in positions[-101:]


@pytest.mark.slow  # the decision itself: tests/unit/spark/test_stream_offsets.py
async def test_truncation_never_skips_unread_records(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper, tmp_path: Path
) -> None:
    await cluster.start(3)
    async with await open_log_writer(bk, "kept", write_quorum=3, password=b"pw") as writer:
        first = [await writer.append(f"a{i}".encode()) for i in range(10)]
        await writer.roll()
        second = [await writer.append(f"b{i}".encode()) for i in range(10)]
    once = stream(spark, cluster, "kept", tmp_path, startingPosition="earliest").trigger(availableNow=True)
    query = await blocking(spark, once.start)
    await blocking(spark, query.awaitTermination)

    # the query read everything; truncating what it read is fine, it goes on with what follows
    async with await open_log_writer(bk, "kept", write_quorum=3, password=b"pw") as writer:
        third = [await writer.append(f"c{i}".encode()) for i in range(5)]
    await truncate_log(bk, "kept", third[0], password=b"pw")
    query = await blocking(spark, once.start)  # from the checkpoint
    await blocking(spark, query.awaitTermination)
    rows = spark.read.parquet(str(tmp_path / "data")).collect()
    assert sorted(LogPosition(r.ledger_id, r.entry_id) for r in rows) == first + second + third

    # a new query whose start was truncated before it read it: an error, not a silent gap
    gone = f'{{"ledger_id": {second[0].ledger_id}, "entry_id": 3}}'
    fresh = stream(spark, cluster, "kept", tmp_path / "fresh", startingPosition=gone)
    query = await blocking(spark, fresh.trigger(availableNow=True).start)
    # (checked when the query starts: docs/spark.md, a position names a ledger of the log)
    with pytest.raises(
        StreamingQueryException, match=r"option 'startingPosition': ledger \d+ of log 'kept' was truncated"
    ):
        await blocking(spark, query.awaitTermination)
