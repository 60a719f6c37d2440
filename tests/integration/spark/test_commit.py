"""The driver's side of a write without Spark around it: a commit whose CAS cannot happen deletes
the job's ledgers and leaves the log as it was; a replayed token changes nothing."""

from __future__ import annotations

import dataclasses

import pytest

from bookkeeper_aio import BookKeeper, MetadataConflict, describe_log, open_log_reader, open_log_writer
from bookkeeper_aio.spark.writer import WriteSpec, commit_ledgers
from tests.integration.spark.conftest import Cluster

pytestmark = pytest.mark.etcd


def _spec(cluster: Cluster) -> WriteSpec:
    return WriteSpec(
        metadata=cluster.url,
        log="orders",
        password=b"pw",
        payload_column="payload",
        ensemble=3,
        write_quorum=2,
        ack_quorum=2,
        job_id="job-1",
    )


async def _closed_ledger(bk: BookKeeper, after: int, payload: bytes) -> int:
    handle = await bk.create_ledger(3, 2, 2, password=b"pw", after_ledger_id=after)
    await handle.append(payload)
    await handle.close()
    return handle.id


async def test_a_commit_that_cannot_happen_deletes_the_ledgers(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    async with await open_log_writer(bk, "orders", password=b"pw") as writer:
        await writer.append(b"first")
        floor = writer.ledger_id
        ours = await _closed_ledger(bk, floor, b"task")
        await writer.roll()  # the log's list now ends above the job's ledger
        await writer.append(b"second")
    before = await describe_log(bk, "orders")
    assert before.ledgers[-1].ledger_id > ours

    with pytest.raises(MetadataConflict, match="not above the log's last ledger"):
        await commit_ledgers(_spec(cluster), [ours], None)
    assert (await describe_log(bk, "orders")).ledgers == before.ledgers
    assert ours not in {ledger_id async for ledger_id in bk.list_ledgers()}
    records = await open_log_reader(bk, "orders", password=b"pw")
    assert [r.payload async for r in records] == [b"first", b"second"]


async def test_a_replayed_token_changes_nothing(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    spec = dataclasses.replace(_spec(cluster), log="tokens")
    first = await _closed_ledger(bk, 0, b"batch 7")
    assert await commit_ledgers(spec, [first], ("query-a", 7)) is True
    replay = await _closed_ledger(bk, first, b"batch 7 again")
    assert await commit_ledgers(spec, [replay], ("query-a", 7)) is False
    info = await describe_log(bk, "tokens")
    assert [x.ledger_id for x in info.ledgers] == [first]
    assert dict(info.commits) == {"query-a": 7}
    assert replay not in {ledger_id async for ledger_id in bk.list_ledgers()}
