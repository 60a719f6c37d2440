"""The rows' schema: Spark's and Arrow's agree, and a different one asked for is refused."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, StructField, StructType

from bookkeeper_aio.spark.options import SparkOptionError
from bookkeeper_aio.spark.reader import ARROW_SCHEMA, READ_SCHEMA, check_read_schema

ARROW_OF = {"string": pa.string(), "bigint": pa.int64(), "binary": pa.binary()}


def test_spark_and_arrow_agree() -> None:
    assert READ_SCHEMA.fieldNames() == ARROW_SCHEMA.names
    for field in READ_SCHEMA.fields:
        assert ARROW_SCHEMA.field(field.name).type == ARROW_OF[field.dataType.simpleString()]
        assert field.nullable
        assert ARROW_SCHEMA.field(field.name).nullable


def test_another_schema_is_refused() -> None:
    check_read_schema(READ_SCHEMA)
    with pytest.raises(SparkOptionError, match=r"got \(struct<payload:binary>\)") as caught:
        check_read_schema(StructType([StructField("payload", BinaryType())]))
    assert caught.value.option == "schema"
