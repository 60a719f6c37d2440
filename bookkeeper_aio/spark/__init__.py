"""The PySpark data source and sink ``bookkeeper`` (optional extra ``bookkeeper-aio[spark]``).

    from bookkeeper_aio.spark import register
    register(spark)
    df = spark.read.format("bookkeeper").option("metadata", "etcd://host:2379/bookkeeper").load("orders")

docs/spark.md has the options, the schema and the guarantees of each mode.

Floor 4 (docs/internals.md), and stricter: it uses only the public client API, the names
:mod:`bookkeeper_aio` re-exports (the log API among them), so that what Spark users get is what
every application gets. ``make lint`` holds it to that.
"""

from __future__ import annotations

try:
    import pyarrow  # noqa: F401
    import pyspark  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"bookkeeper_aio.spark needs PySpark and PyArrow ({error}): pip install 'bookkeeper-aio[spark]'"
    ) from error

from bookkeeper_aio.spark.options import SparkColumnError, SparkOptionError
from bookkeeper_aio.spark.source import NAME, BookKeeperDataSource, register

__all__ = ["NAME", "BookKeeperDataSource", "SparkColumnError", "SparkOptionError", "register"]
