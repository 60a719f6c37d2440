"""The issue's acceptance sizes (-m slow): a 1,000,000-entry log of 1 KiB entries over 5 ledgers
read by Spark, checked against the client; a 100,000-row DataFrame written and read back, with an
injected task failure."""

from __future__ import annotations

import asyncio
import hashlib
import os
import zlib
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from bookkeeper_aio import BookKeeper, describe_log, open_log_reader, open_log_writer
from tests.integration.spark.conftest import Cluster, blocking

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


async def test_read_a_million_entries(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    entries, ledgers = 1_000_000, 5
    base = os.urandom(1024)
    writer = await open_log_writer(bk, "big", ensemble=3, write_quorum=3, ack_quorum=2)
    async with writer:
        window: list[asyncio.Future[Any]] = []
        for i in range(entries):
            if i and i % (entries // ledgers) == 0:
                await asyncio.gather(*window)
                window = []
                await writer.roll()
            window.append(await writer.append_async(i.to_bytes(8, "big") + base[8:]))
            if len(window) >= 1000:
                await asyncio.gather(*window)
                window = []
        await asyncio.gather(*window)
    assert len((await describe_log(bk, "big")).ledgers) == ledgers

    count = checksum = 0  # client side: crc32 of "ledger:entry:" + payload, summed
    async for record in await open_log_reader(bk, "big"):
        count += 1
        checksum += zlib.crc32(b"%d:%d:" % record.position + record.payload)
    assert count == entries

    df = spark.read.format("bookkeeper").option("metadata", cluster.url).load("big")
    keyed = F.concat(F.encode(F.format_string("%d:%d:", "ledger_id", "entry_id"), "UTF-8"), F.col("payload"))
    totals = df.agg(
        F.count("*").alias("n"),
        F.sum(F.crc32(keyed)).alias("checksum"),
        F.countDistinct("offset").alias("offsets"),
        F.min("offset").alias("first"),
        F.max("offset").alias("last"),
    )
    row = (await blocking(spark, totals.collect))[0]
    assert (row.n, row.checksum) == (entries, checksum)
    assert (row.offsets, row.first, row.last) == (entries, 0, entries - 1)


def _fail_once(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    from pyspark import TaskContext

    context = TaskContext.get()
    fail = context is not None and context.partitionId() == 2 and context.attemptNumber() == 0
    for index, batch in enumerate(batches):
        if fail and index == 3:
            raise RuntimeError("injected task failure")
        yield batch


async def test_write_100k_rows_with_a_task_failure(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    rows = 100_000
    df = (
        spark.range(rows, numPartitions=4)
        .select(F.col("id"), F.encode(F.sha2(F.col("id").cast("string"), 256), "UTF-8").alias("payload"))
        .mapInArrow(_fail_once, "id BIGINT, payload BINARY")
    )
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
    try:
        writer = df.write.format("bookkeeper").mode("append").option("metadata", cluster.url)
        await blocking(spark, lambda: writer.save("sink"))
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")

    expected = sorted(hashlib.sha256(str(i).encode()).hexdigest().encode() for i in range(rows))
    records = [r async for r in await open_log_reader(bk, "sink")]
    assert sorted(r.payload for r in records) == expected  # each row once
    info = await describe_log(bk, "sink")
    assert len(info.ledgers) == 4
    assert {ledger_id async for ledger_id in bk.list_ledgers()} == {x.ledger_id for x in info.ledgers}
