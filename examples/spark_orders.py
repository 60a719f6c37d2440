"""An example pipeline on Spark: read a log of JSON orders, total them per customer, write Parquet.

Against the sandbox (`make run` writes JSON orders into the log `demo-orders`, password
`sandbox-demo`, and prints the metadata URL):

    python examples/spark_orders.py --metadata etcd://127.0.0.1:PORT/bookkeeper/sandbox \
        --out order-totals.parquet

``--seed N`` first appends N orders of the same shape to the log (created if need be), so it also
runs against an empty cluster. Prints the totals and the number of orders read. docs/spark.md
explains the options and the guarantees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from bookkeeper_aio import BookKeeper, open_log_writer

ORDER_SCHEMA = "order BIGINT, customer STRING, amount_cents BIGINT"


def order_record(index: int) -> bytes:
    """The sandbox demo's orders: ``{"order": 7, "customer": "c07", "amount_cents": 359}``."""
    order = {"order": index, "customer": f"c{index % 17:02d}", "amount_cents": 100 + (index * 37) % 9_900}
    return json.dumps(order, separators=(",", ":")).encode()


async def seed(metadata: str, log: str, password: bytes, count: int) -> None:
    async with BookKeeper.connect(metadata) as bk:
        writer = await open_log_writer(bk, log, password=password)
        async with writer:
            futures = [await writer.append_async(order_record(i)) for i in range(count)]
            for future in futures:
                await future


def spark_session(master: str) -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors need bookkeeper_aio too
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from bookkeeper_aio.spark import register

    spark = SparkSession.builder.master(master).config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def totals_per_customer(spark: Any, metadata: str, log: str, password: str) -> Any:
    from pyspark.sql import functions as F

    orders = (
        spark.read.format("bookkeeper").option("metadata", metadata).option("password", password).load(log)
    )
    decoded = orders.select(F.from_json(F.col("payload").cast("string"), ORDER_SCHEMA).alias("o"))
    return (
        decoded.groupBy(F.col("o.customer").alias("customer"))
        .agg(F.count("*").alias("orders"), F.sum("o.amount_cents").alias("amount_cents"))
        .orderBy("customer")
    )


def run(metadata: str, log: str, password: str, out: str, master: str = "local[2]") -> list[Any]:
    """The pipeline: the totals it wrote to ``out`` (Parquet), as rows."""
    spark = spark_session(master)
    totals = totals_per_customer(spark, metadata, log, password)
    totals.write.mode("overwrite").parquet(out)
    return spark.read.parquet(out).orderBy("customer").collect()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--metadata", default=os.environ.get("BKAIO_METADATA"), help="etcd://host:port/root")
    parser.add_argument("--log", default="demo-orders")
    parser.add_argument("--password", default="sandbox-demo")
    parser.add_argument("--out", required=True, help="directory for the Parquet output")
    parser.add_argument("--seed", type=int, default=0, help="append this many orders to the log first")
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    if not args.metadata:
        parser.error("--metadata (or $BKAIO_METADATA) is required: `make run` prints the sandbox's URL")
    if args.seed:
        asyncio.run(seed(args.metadata, args.log, args.password.encode(), args.seed))
    rows = run(args.metadata, args.log, args.password, args.out, args.master)
    for row in rows:
        print(f"{row.customer}  orders={row.orders}  amount_cents={row.amount_cents}")
    print(f"{sum(row.orders for row in rows)} orders from log {args.log!r}, totals in {args.out}")


if __name__ == "__main__":
    main()
