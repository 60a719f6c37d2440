"""Batch reads through Spark (local[2]) from real bookies and etcd: exact rows, bad input named."""

from __future__ import annotations

import hashlib

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession

from bookkeeper_aio import BookKeeper
from tests.integration.spark.conftest import Cluster, blocking

pytestmark = pytest.mark.etcd

QUORUM = {"ensemble": 3, "write_quorum": 3, "ack_quorum": 2}

# Spark calls block: they run in a thread, so that the test's loop keeps the bookies' registration
# leases alive (a 5 s block loses them and the executors could no longer find the bookies).


async def _ledger(bk: BookKeeper, payloads: list[bytes], *, close: bool = True) -> int:
    handle = await bk.create_ledger(**QUORUM, password=b"pw")
    for future in [await handle.append_async(p) for p in payloads]:
        await future
    if close:
        await handle.close()
    return handle.id


def _reader(spark: SparkSession, cluster: Cluster, **options: str):  # type: ignore[no-untyped-def]
    reader = spark.read.format("bookkeeper").option("metadata", cluster.url).option("password", "pw")
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader


async def test_read_explicit_ledgers_exactly(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    first = [f"a{i}".encode() * (i % 7 + 1) for i in range(25)]
    second = [bytes([i]) * 1000 for i in range(10)]
    ids = [await _ledger(bk, first), await _ledger(bk, second), await _ledger(bk, [])]
    df = _reader(spark, cluster, ledgers=",".join(map(str, ids)), maxEntriesPerPartition="7").load()
    assert df.columns == ["log", "ledger_id", "entry_id", "payload", "offset"]
    assert df.rdd.getNumPartitions() == 4 + 2  # 25 entries in 7s, 10 in 7s, the empty ledger none
    rows = sorted(await blocking(spark, df.collect), key=lambda r: (r.ledger_id, r.entry_id))
    expected = [(ids[0], i, p) for i, p in enumerate(first)] + [(ids[1], i, p) for i, p in enumerate(second)]
    assert [(r.ledger_id, r.entry_id, bytes(r.payload)) for r in rows] == expected
    assert {(r.log, r.offset) for r in rows} == {(None, None)}


@pytest.mark.slow
async def test_read_an_open_ledger_up_to_its_lac(
    spark: SparkSession, cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    payloads = [f"open-{i}".encode() for i in range(12)]
    handle = await bk.create_ledger(**QUORUM, password=b"pw")
    for p in payloads:
        await handle.append(p)
    # the LAC readers see trails the last ack by one entry until the next add or explicit LAC
    df = _reader(spark, cluster, ledgers=str(handle.id)).load()
    rows = sorted(await blocking(spark, df.collect), key=lambda r: r.entry_id)
    got = [bytes(r.payload) for r in rows]
    assert got == payloads[: len(got)]
    assert len(got) >= len(payloads) - 1
    await handle.close()


@pytest.mark.slow
async def test_positions_bound_the_read(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    a = await _ledger(bk, [f"a{i}".encode() for i in range(10)])
    b = await _ledger(bk, [f"b{i}".encode() for i in range(10)])
    df = _reader(
        spark,
        cluster,
        ledgers=f"{a},{b}",
        startingPosition=f'{{"ledger_id": {a}, "entry_id": 7}}',
        endingPosition=f'{{"ledger_id": {b}, "entry_id": 3}}',
    ).load()
    rows = sorted(await blocking(spark, df.collect), key=lambda r: (r.ledger_id, r.entry_id))
    got = [(r.ledger_id, r.entry_id, bytes(r.payload)) for r in rows]
    assert got == [(a, 7, b"a7"), (a, 8, b"a8"), (a, 9, b"a9"), (b, 0, b"b0"), (b, 1, b"b1"), (b, 2, b"b2")]


@pytest.mark.slow
async def test_checksum_matches_the_client(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    payloads = [hashlib.sha256(str(i).encode()).digest() * 32 for i in range(3000)]
    ids = [await _ledger(bk, payloads[:1800]), await _ledger(bk, payloads[1800:])]
    expected = hashlib.sha256()
    for ledger_id in ids:
        handle = await bk.open_ledger(ledger_id, password=b"pw")
        async for entry in handle.read():
            expected.update(f"{ledger_id}:{entry.entry_id}:".encode() + entry.payload)
    df = _reader(spark, cluster, ledgers=f"{ids[0]},{ids[1]}", maxEntriesPerPartition="500").load()
    got = hashlib.sha256()
    for r in sorted(await blocking(spark, df.collect), key=lambda r: (r.ledger_id, r.entry_id)):
        got.update(f"{r.ledger_id}:{r.entry_id}:".encode() + bytes(r.payload))
    assert got.hexdigest() == expected.hexdigest()


# Each case costs a planning round trip (~2 s): the parsing itself is covered by
# tests/unit/spark/test_options.py; here, that Spark hands the named error to the user.
BAD_OPTIONS = [
    ({"endingPosition": "{bad json"}, "'endingPosition': expected"),
    ({"maxEntriesPerPartiton": "5"}, "'maxentriesperpartiton': unknown option"),  # Spark lower-cases
]


def test_bad_options_are_named(spark: SparkSession) -> None:
    # refused while planning, before any connection: no cluster needed
    for options, named in BAD_OPTIONS:
        reader = spark.read.format("bookkeeper").option("metadata", "etcd://127.0.0.1:1/x")
        reader = reader.option("ledgers", "1").options(**options)
        with pytest.raises(PySparkException, match=named):
            reader.load().collect()
    typed = (
        spark.read.format("bookkeeper").schema("payload BINARY").option("metadata", "etcd://127.0.0.1:1/x")
    )
    with pytest.raises(PySparkException, match="'schema': the bookkeeper source's rows are"):
        typed.option("ledgers", "1").load().collect()


@pytest.mark.slow
async def test_what_is_not_there_is_named(spark: SparkSession, cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    ledger_id = await _ledger(bk, [b"x"])
    cases = [
        ({"ledgers": "999999"}, "'ledgers': ledger 999999 does not exist"),
        ({"endingPosition": f'{{"ledger_id": {ledger_id + 1}, "entry_id": 0}}'}, "'endingPosition': ledger"),
        ({"startingPosition": '{"ledger_id": 424242, "entry_id": 0}'}, "'startingPosition': ledger 424242"),
    ]
    for options, named in cases:
        options = {"ledgers": str(ledger_id), **options}
        with pytest.raises(PySparkException, match=named):
            await blocking(spark, lambda o=options: _reader(spark, cluster, **o).load().collect())


@pytest.mark.slow  # waits out the client's 5 s metadata timeout
def test_unreachable_metadata_is_named(spark: SparkSession) -> None:
    reader = spark.read.format("bookkeeper").option("metadata", "etcd://127.0.0.1:1/bookkeeper/none")
    with pytest.raises(PySparkException, match="'metadata': cannot read the cluster's metadata"):
        reader.option("ledgers", "1").load().collect()
