"""Batch reads of logs through Spark (local[2]): the rows are the log reader's records, exactly."""

from __future__ import annotations

import hashlib

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from bookkeeper_aio import BookKeeper, LogPosition, open_log_reader, open_log_writer
from tests.integration.spark.conftest import Cluster, blocking

pytestmark = pytest.mark.etcd

WRITER = {"ensemble": 3, "write_quorum": 3, "ack_quorum": 2, "password": b"pw"}


async def write_log(bk: BookKeeper, name: str, chunks: list[list[bytes]]) -> list[LogPosition]:
    """Each chunk into a ledger of its own (a roll between chunks); the positions of every append."""
    positions: list[LogPosition] = []
    async with await open_log_writer(bk, name, **WRITER) as writer:  # type: ignore[arg-type]
        for index, chunk in enumerate(chunks):
            if index:
                await writer.roll()
            futures = [await writer.append_async(payload) for payload in chunk]
            positions += [await future for future in futures]
    return positions


def load(spark: SparkSession, cluster: Cluster, name: str, **options: str):  # type: ignore[no-untyped-def]
    reader = spark.read.format("bookkeeper").option("metadata", cluster.url).option("password", "pw")
    return reader.options(**options).load(name)


async def test_a_log_across_rolls(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    chunks = [[f"{c}-{i}".encode() * (i % 5 + 1) for i in range(n)] for c, n in enumerate([30, 0, 17, 41])]
    positions = await write_log(bk, "orders", chunks)
    payloads = [p for chunk in chunks for p in chunk]
    df = load(spark, cluster, "orders", maxEntriesPerPartition="16")
    rows = sorted(await blocking(spark, df.collect), key=lambda r: r.offset)
    assert [(r.log, LogPosition(r.ledger_id, r.entry_id), bytes(r.payload)) for r in rows] == [
        ("orders", p, payload) for p, payload in zip(positions, payloads, strict=True)
    ]
    assert [r.offset for r in rows] == list(range(len(payloads)))
    assert len({p.ledger_id for p in positions}) == 3  # the empty ledger holds none

    # bounded by positions: start inclusive, end exclusive, across a ledger boundary
    start, end = positions[25], positions[50]
    bounded = load(
        spark,
        cluster,
        "orders",
        startingPosition=f'{{"ledger_id": {start.ledger_id}, "entry_id": {start.entry_id}}}',
        endingPosition=f'{{"ledger_id": {end.ledger_id}, "entry_id": {end.entry_id}}}',
    )
    rows = sorted(await blocking(spark, bounded.collect), key=lambda r: r.offset)
    assert [LogPosition(r.ledger_id, r.entry_id) for r in rows] == positions[25:50]
    assert [bytes(r.payload) for r in rows] == payloads[25:50]


@pytest.mark.slow
async def test_checksum_against_the_log_reader(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    chunks = [[hashlib.sha256(b"%d-%d" % (c, i)).digest() * 8 for i in range(700)] for c in range(3)]
    await write_log(bk, "events", chunks)
    expected = hashlib.sha256()
    count = 0
    async for record in await open_log_reader(bk, "events", password=b"pw"):
        expected.update(b"%d:%d:" % record.position + record.payload)
        count += 1
    df = load(spark, cluster, "events", maxEntriesPerPartition="300")
    assert df.rdd.getNumPartitions() == 3 * 3
    got = hashlib.sha256()
    rows = sorted(await blocking(spark, df.collect), key=lambda r: (r.ledger_id, r.entry_id))
    for r in rows:
        got.update(b"%d:%d:" % (r.ledger_id, r.entry_id) + bytes(r.payload))
    assert (len(rows), got.hexdigest()) == (count, expected.hexdigest())


async def test_bad_input_is_named(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    await write_log(bk, "real", [[b"x"]])
    with pytest.raises(PySparkException, match="'path': log 'nope' does not exist; the logs are 'real'"):
        await blocking(spark, lambda: load(spark, cluster, "nope").collect())
    wrong = load(spark, cluster, "real", password="wrong")
    with pytest.raises(PySparkException, match="'password': wrong password for ledger"):
        await blocking(spark, wrong.collect)
    # a position outside the log: test_batch_read.py::test_what_is_not_there_is_named (-m slow)


@pytest.mark.slow
async def test_a_sequenced_log_reads_as_the_client_does(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    async with await open_log_writer(bk, "seq", sequenced=True, **WRITER) as writer:  # type: ignore[arg-type]
        for i in range(30):
            await writer.append(f"s{i}".encode(), sequence=100 + i)
            if i == 14:
                await writer.roll()
    expected = [(r.position, r.payload) async for r in await open_log_reader(bk, "seq", password=b"pw")]
    rows = await blocking(spark, load(spark, cluster, "seq", maxEntriesPerPartition="8").collect)
    got = sorted((LogPosition(r.ledger_id, r.entry_id), bytes(r.payload)) for r in rows)
    assert got == expected  # the sequence headers stripped, as the client reader does
    assert [payload for _, payload in got] == [f"s{i}".encode() for i in range(30)]
