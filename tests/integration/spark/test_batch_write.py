"""Batch writes through Spark (local[2,3]) into logs on real bookies and etcd: all or nothing,
each row once, no ledger left behind."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession

from bookkeeper_aio import BookKeeper, LogRecord, describe_log, open_log_reader, open_log_writer
from tests.integration.spark.conftest import Cluster, blocking

pytestmark = pytest.mark.etcd


def frame(spark: SparkSession, payloads: list[bytes], partitions: int) -> DataFrame:
    rows = [(i, payload) for i, payload in enumerate(payloads)]
    return spark.createDataFrame(rows, "id BIGINT, payload BINARY").repartition(partitions, "id")


def save(df: DataFrame, cluster: Cluster, name: str, **options: str) -> None:
    writer = df.write.format("bookkeeper").mode("append").option("metadata", cluster.url)
    writer.option("password", "pw").option("writeQuorum", "3").options(**options).save(name)


async def read_log(bk: BookKeeper, name: str) -> list[LogRecord]:
    return [record async for record in await open_log_reader(bk, name, password=b"pw")]


async def assert_no_orphans(bk: BookKeeper, names: list[str]) -> None:
    """Every ledger of the cluster is in one of the logs: no task's ledger was left behind."""
    listed = set()
    for name in names:
        listed |= {ledger.ledger_id for ledger in (await describe_log(bk, name)).ledgers}
    assert {ledger_id async for ledger_id in bk.list_ledgers()} == listed


async def test_write_then_read_back(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    async with await open_log_writer(bk, "orders", password=b"pw") as writer:
        before = [await writer.append(f"old-{i}".encode()) for i in range(5)]
    payloads = [f"row-{i:05d}".encode() * (i % 3 + 1) for i in range(2000)]
    await blocking(spark, lambda: save(frame(spark, payloads, 4), cluster, "orders"))

    records = await read_log(bk, "orders")
    assert [r.position for r in records[:5]] == before
    new = records[5:]
    assert sorted(r.payload for r in new) == sorted(payloads)  # each row once
    info = await describe_log(bk, "orders")
    assert len(info.ledgers) == 1 + 4  # the old writer's ledger, one per task
    for ledger in info.ledgers[1:]:  # each task's rows in the order Spark gave them (by id here)
        ids = [int(r.payload.split(b"-")[1][:5]) for r in new if r.position.ledger_id == ledger.ledger_id]
        assert ids == sorted(ids)
        assert ledger.state == "closed"
    await assert_no_orphans(bk, ["orders"])

    # into a log that does not exist yet (created), from a STRING column named by payloadColumn
    strings = spark.createDataFrame([(f"s{i}",) for i in range(10)], "body STRING").coalesce(1)
    await blocking(spark, lambda: save(strings, cluster, "fresh", payloadColumn="body"))
    assert [r.payload for r in await read_log(bk, "fresh")] == [f"s{i}".encode() for i in range(10)]


def _fail_once_mid_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Partition 1's first attempt fails after handing out five batches (rows already sent to the
    writer, whose Python worker Spark then kills): Spark retries the task, the job must still hold
    each row once and leave no ledger behind."""
    from pyspark import TaskContext

    context = TaskContext.get()
    fail = context is not None and context.partitionId() == 1 and context.attemptNumber() == 0
    for index, batch in enumerate(batches):
        if fail and index == 5:
            raise RuntimeError("injected task failure")
        yield batch


async def test_a_failed_task_leaves_no_duplicate_and_no_ledger(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    payloads = [f"p{i}".encode() for i in range(3000)]
    df = frame(spark, payloads, 3).mapInArrow(_fail_once_mid_partition, "id BIGINT, payload BINARY")
    # small batches, so that the failing attempt has written some rows before it fails
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    try:
        await blocking(spark, lambda: save(df, cluster, "retried"))
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    records = await read_log(bk, "retried")
    assert sorted(r.payload for r in records) == sorted(payloads)
    assert len((await describe_log(bk, "retried")).ledgers) == 3
    await assert_no_orphans(bk, ["retried"])


@pytest.mark.slow
async def test_a_failed_job_leaves_the_log_as_it_was(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    async with await open_log_writer(bk, "kept", password=b"pw") as writer:
        await writer.append(b"before")

    def always_fail(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        for index, batch in enumerate(batches):
            if context is not None and context.partitionId() == 0 and index == 1:
                raise RuntimeError("injected job failure")
            yield batch

    payloads = [f"q{i}".encode() for i in range(1000)]
    df = frame(spark, payloads, 2).mapInArrow(always_fail, "id BIGINT, payload BINARY")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    try:
        with pytest.raises(PySparkException, match="injected job failure"):
            await blocking(spark, lambda: save(df, cluster, "kept"))
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    assert [r.payload for r in await read_log(bk, "kept")] == [b"before"]
    await assert_no_orphans(bk, ["kept"])


async def test_bad_frames_are_named(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    # the checks themselves: tests/unit/spark/test_write_checks.py; here, that the user sees them
    await cluster.start(3)
    numbers = spark.createDataFrame([(1, 2)], "payload INT, other INT")
    with pytest.raises(PySparkException, match=r"column 'payload': must be BINARY or STRING .*, got int"):
        await blocking(spark, lambda: save(numbers, cluster, "bad"))
    nulls = spark.createDataFrame([(b"a",), (None,)], "payload BINARY").coalesce(1)
    with pytest.raises(PySparkException, match="column 'payload': a null payload"):
        await blocking(spark, lambda: save(nulls, cluster, "bad"))
    assert {ledger_id async for ledger_id in bk.list_ledgers()} == set()  # the failed task's: deleted
