"""examples/spark_orders.py runs: JSON orders in a log -> totals per customer in Parquet."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
from pyspark.sql import SparkSession

from bookkeeper_aio import BookKeeper
from tests.integration.spark.conftest import Cluster, blocking

pytestmark = [pytest.mark.etcd, pytest.mark.slow]  # ~6 s of Spark: make test-slow runs it

EXAMPLE = Path(__file__).parents[3] / "examples" / "spark_orders.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spark_orders", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_example_pipeline(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper, tmp_path: Path
) -> None:
    await cluster.start(3)
    example = _example()
    await example.seed(cluster.url, "orders", b"pw", 500)
    out = str(tmp_path / "totals")
    rows = await blocking(spark, lambda: example.run(cluster.url, "orders", "pw", out))

    counts: Counter[str] = Counter()
    amounts: Counter[str] = Counter()
    for i in range(500):
        customer = f"c{i % 17:02d}"
        counts[customer] += 1
        amounts[customer] += 100 + (i * 37) % 9_900
    assert [(r.customer, r.orders, r.amount_cents) for r in rows] == [
        (c, counts[c], amounts[c]) for c in sorted(counts)
    ]
