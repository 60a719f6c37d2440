"""What a write refuses before touching the cluster: the payload column, the mode, the quorums."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    StringType,
    StructField,
    StructType,
)

from bookkeeper_aio.spark.options import WRITE_OPTIONS, SparkColumnError, SparkOptionError
from bookkeeper_aio.spark.writer import _payloads, check_payload_column, parse_write_spec

URL = "etcd://127.0.0.1:2379/bookkeeper/x"


def schema(**columns: DataType) -> StructType:
    return StructType([StructField(name, data_type) for name, data_type in columns.items()])


def test_payload_column_types() -> None:
    check_payload_column(schema(id=IntegerType(), payload=BinaryType()), "payload")
    check_payload_column(schema(body=StringType()), "body")
    with pytest.raises(SparkColumnError, match=r"must be BINARY or STRING .*got int") as caught:
        check_payload_column(schema(payload=IntegerType()), "payload")
    assert caught.value.column == "payload"
    with pytest.raises(SparkColumnError, match=r"no column 'value' \(its columns: \['payload'\]\)") as caught:
        check_payload_column(schema(payload=BinaryType()), "value")
    assert caught.value.column == "value"
    with pytest.raises(SparkColumnError, match="got array<binary>"):
        check_payload_column(schema(payload=ArrayType(BinaryType())), "payload")


def test_payloads_from_arrow() -> None:
    batch = pa.RecordBatch.from_pydict({"id": [1, 2], "payload": [b"a", b"\x00b"]})
    assert _payloads(batch, "payload") == [b"a", b"\x00b"]
    text = pa.RecordBatch.from_pydict({"body": ["é", "x"]})
    assert _payloads(text, "body") == ["é".encode(), b"x"]
    nulls = pa.RecordBatch.from_pydict({"payload": [b"a", None, b"c"]})
    with pytest.raises(SparkColumnError, match=r"column 'payload': a null payload \(row 1"):
        _payloads(nulls, "payload")


def test_write_options() -> None:
    binary = schema(payload=BinaryType())
    spec = parse_write_spec({"metadata": URL, "path": "orders", "ensemble": "4"}, binary, WRITE_OPTIONS, "w")
    assert (spec.log, spec.ensemble, spec.write_quorum, spec.ack_quorum) == ("orders", 4, 2, 2)
    with pytest.raises(SparkOptionError, match="need ensemble >= writeQuorum >= ackQuorum") as caught:
        parse_write_spec({"metadata": URL, "path": "o", "writequorum": "4"}, binary, WRITE_OPTIONS, "w")
    assert caught.value.option == "writeQuorum"
    with pytest.raises(SparkOptionError, match="'ledgers': not used by a w"):
        parse_write_spec({"metadata": URL, "ledgers": "1"}, binary, WRITE_OPTIONS, "w")
    with pytest.raises(SparkOptionError, match="not used by a w") as caught:
        parse_write_spec({"metadata": URL, "path": "o", "startingposition": "x"}, binary, WRITE_OPTIONS, "w")
    assert caught.value.option == "startingPosition"
