"""Streaming writes through Spark, exactly once: a batch replayed after its commit reached the log
(the driver died before Spark's own commit log) is recognised, and its new ledgers deleted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession

from bookkeeper_aio import BookKeeper, describe_log, open_log_reader, open_log_writer
from tests.integration.spark.conftest import Cluster, blocking

pytestmark = pytest.mark.etcd


def pipe(spark: SparkSession, cluster: Cluster, checkpoint: Path, start: str, **options: str):  # type: ignore[no-untyped-def]
    """src -> dst from ``start``, 60 entries a batch, until the end of src seen at start (AvailableNow)."""
    source = (
        spark.readStream.format("bookkeeper")
        .option("metadata", cluster.url)
        .option("password", "pw")
        .option("startingPosition", start)
        .option("maxEntriesPerTrigger", "60")
        .load("src")
    )
    return (
        source.select("payload")
        .writeStream.format("bookkeeper")
        .option("metadata", cluster.url)
        .option("password", "pw")
        .option("checkpointLocation", str(checkpoint))
        .options(**options)
        .trigger(availableNow=True)
    )


async def run(
    spark: SparkSession, cluster: Cluster, checkpoint: Path, start: str = "earliest", **options: str
) -> list[tuple[int, int]]:
    """(batch id, input rows) of each batch the query ran."""
    query = await blocking(spark, lambda: pipe(spark, cluster, checkpoint, start, **options).start("dst"))
    await blocking(spark, query.awaitTermination)
    return [(p["batchId"], p["numInputRows"]) for p in query.recentProgress if p["numInputRows"]]


async def test_a_replayed_batch_is_skipped(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper, tmp_path: Path
) -> None:
    await cluster.start(3)
    payloads = [f"m{i}".encode() for i in range(150)]
    async with await open_log_writer(bk, "src", write_quorum=3, password=b"pw") as writer:
        for payload in payloads:
            await writer.append(payload)
    checkpoint = tmp_path / "checkpoint"
    assert await run(spark, cluster, checkpoint) == [(0, 60), (1, 60), (2, 30)]
    first = await describe_log(bk, "dst")
    assert len(first.commits) == 1
    [(writer_id, last_batch)] = first.commits.items()
    assert writer_id.startswith("spark-query-")
    assert last_batch == 2

    # the driver "died" after batch 2's CAS and before Spark recorded the batch as committed
    (checkpoint / "commits" / "2").unlink()
    (checkpoint / "commits" / ".2.crc").unlink(missing_ok=True)
    assert await run(spark, cluster, checkpoint) == [(2, 30)]  # replayed: same offsets, new ledger

    records = [r async for r in await open_log_reader(bk, "dst", password=b"pw")]
    assert [r.payload for r in records] == payloads  # each once, in order (one task per batch)
    after = await describe_log(bk, "dst")
    assert after.ledgers == first.ledgers
    assert dict(after.commits) == {writer_id: 2}
    source = await describe_log(bk, "src")
    listed = {x.ledger_id for x in after.ledgers} | {x.ledger_id for x in source.ledgers}
    assert {ledger_id async for ledger_id in bk.list_ledgers()} == listed  # the replay's ledgers: gone

    # the same writer id from a new checkpoint: batch ids start at 0 again, below the committed 2;
    # dropping them as replays would lose every row: the query fails, naming the option
    with pytest.raises(StreamingQueryException, match=r"option 'writerId'.*already committed batch 2"):
        await run(spark, cluster, tmp_path / "new-checkpoint", writerId=writer_id)
    assert (await describe_log(bk, "dst")).ledgers == first.ledgers
    assert {ledger_id async for ledger_id in bk.list_ledgers()} == listed  # its ledgers: deleted


async def test_a_writer_id_reused_at_the_committed_batch_id_fails_and_its_own_replay_is_skipped(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper, tmp_path: Path
) -> None:
    """Two queries (two checkpoints) with one writerId: the second one's batch 0 meets the token
    (writerId, 0) of the first. The token carries the first query's id: the batch is refused, not
    taken for a replay (its rows deleted, the query reporting success). The first query's own
    replay of batch 0 is still skipped."""
    await cluster.start(3)
    async with await open_log_writer(bk, "src", write_quorum=3, password=b"pw") as writer:
        for i in range(5):
            await writer.append(b"first-%d" % i)
    first = tmp_path / "first"
    assert await run(spark, cluster, first, writerId="orders-sink") == [(0, 5)]
    committed = await describe_log(bk, "dst")
    assert dict(committed.commits) == {"orders-sink": 0}
    async with await open_log_writer(bk, "src", write_quorum=3, password=b"pw") as writer:
        second = writer.ledger_id
        for i in range(5):
            await writer.append(b"second-%d" % i)
    start = json.dumps({"ledger_id": second, "entry_id": 0})
    with pytest.raises(
        StreamingQueryException, match=r"option 'writerId'.*already committed batch 0.*another query"
    ):
        await run(spark, cluster, tmp_path / "second", start, writerId="orders-sink")
    assert (await describe_log(bk, "dst")).version == committed.version

    (first / "commits" / "0").unlink()  # the first query's driver "died" after batch 0's CAS
    (first / "commits" / ".0.crc").unlink(missing_ok=True)
    # restarted: batch 0 replayed (skipped: its token and query id are in the list), then batch 1
    assert await run(spark, cluster, first, writerId="orders-sink") == [(0, 5), (1, 5)]
    records = [r.payload async for r in await open_log_reader(bk, "dst", password=b"pw")]
    assert records == [b"first-%d" % i for i in range(5)] + [b"second-%d" % i for i in range(5)]
    after = await describe_log(bk, "dst")
    assert after.ledgers[: len(committed.ledgers)] == committed.ledgers
    assert len(after.ledgers) == len(committed.ledgers) + 1
    assert dict(after.commits) == {"orders-sink": 1}
    source = await describe_log(bk, "src")
    listed = {x.ledger_id for x in after.ledgers} | {x.ledger_id for x in source.ledgers}
    assert {ledger_id async for ledger_id in bk.list_ledgers()} == listed  # refused and replayed: deleted
