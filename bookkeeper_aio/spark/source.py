"""The ``bookkeeper`` data source: Spark's entry point, handing each mode to its module.

Spark instantiates the class on the driver with the job's options, asks it for a schema and a
reader or writer, pickles those to the executors and calls them there. Each holds only plain data
(URL, log name, positions): clients and event loops are made per call (``runtime``).
"""

from __future__ import annotations

from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from bookkeeper_aio.spark.reader import READ_SCHEMA, BookKeeperBatchReader, check_read_schema
from bookkeeper_aio.spark.stream import BookKeeperStreamReader
from bookkeeper_aio.spark.stream_writer import BookKeeperStreamWriter
from bookkeeper_aio.spark.writer import BookKeeperBatchWriter

NAME = "bookkeeper"


class BookKeeperDataSource(DataSource):
    """``spark.read.format("bookkeeper")`` / ``df.write.format("bookkeeper")`` (docs/spark.md)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return READ_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        check_read_schema(schema)
        return BookKeeperBatchReader(self.options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return BookKeeperBatchWriter(self.options, schema, overwrite)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        check_read_schema(schema)
        return BookKeeperStreamReader(self.options)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return BookKeeperStreamWriter(self.options, schema, overwrite)


def register(spark: SparkSession) -> None:
    """Make ``format("bookkeeper")`` known to ``spark`` (the documented way: Spark's automatic
    discovery of ``pyspark_*`` modules skips every data source silently if one fails to import)."""
    spark.dataSource.register(BookKeeperDataSource)
