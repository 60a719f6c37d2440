"""One local[2] SparkSession for the whole test session (start-up is the expensive part: ~5 s),
the ``bookkeeper`` data source registered on it, and the client tests' real bookies + etcd.

``local[2,3]``: two cores, and a failed task is retried (up to 3 attempts) as on a cluster, which
the task-failure tests rely on (plain ``local[2]`` never retries a task).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import pytest

from tests.integration.client.conftest import CONFIG, Cluster, bk, cluster

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["CONFIG", "Cluster", "bk", "blocking", "cluster", "spark"]

T = TypeVar("T")


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime for Spark: install a JDK 17+ or set JAVA_HOME")
    from pyspark.sql import SparkSession

    from bookkeeper_aio.spark import register

    # Executors' Python workers must run this interpreter (it has bookkeeper_aio installed).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    session = (
        SparkSession.builder.master("local[2,3]")
        .appName("bookkeeper-aio-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    try:
        yield session
    finally:
        session.stop()


async def blocking(spark: SparkSession, call: Callable[[], T]) -> T:
    """Run a blocking Spark call in a thread, so that the test's event loop keeps the bookies'
    registration leases alive meanwhile (a 5 s block loses them: executors could no longer find
    the bookies). The thread is made the session's active one first: Spark 4.3 looks a Python data
    source up for ``df.write`` through the calling JVM thread's active session and, from a thread
    without one, fails with DATA_SOURCE_NOT_FOUND."""

    def run() -> T:
        jvm = spark._jvm  # type: ignore[attr-defined]
        jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)  # type: ignore[attr-defined]
        return call()

    return await asyncio.to_thread(run)
