"""Batched add answers (FEATURE_ADD_ACKS, docs/protocol.md): a bookie that agreed in HELLO answers
the EOK adds of a group in one ADD_ACKS response; the client completes exactly those adds, in entry
order, and treats an ADD_ACKS naming a request that is not an add as a broken connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from bookkeeper_aio import BookieConnectionLost, BookKeeper
from bookkeeper_aio.client.connection import ConnectionState
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.errors import ProtocolError
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.client.mangling_bookie import EventLog, mangling, mangling_cluster, raw_frame


@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    async for fakes in mangling_cluster(4, add_acks=True):
        yield fakes


async def test_pipelined_adds_complete_in_order_from_batched_answers(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    events = EventLog()
    lh.set_event_listener(events)
    futures = [await lh.append_async(b"%d" % i) for i in range(300)]
    assert await asyncio.gather(*futures) == list(range(300))
    assert [v for e, v in events.events if e == "add.completed"] == list(range(300))
    for bookie_id in lh.metadata.current_ensemble:
        assert bk.context.pool.connection(bookie_id)._add_acks
        bookie = cluster.by_id(bookie_id)
        assert 0 < bookie.add_acks_sent < 200  # 200 adds each: answered in batches
    assert lh.ensemble_changes == 0
    await lh.close()


async def test_add_acks_naming_a_read_request__closes_the_connection_and_the_read_fails_over(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 3, 2)
    await lh.append(b"entry")
    await lh.close()
    rh = await bk.open_ledger(lh.id)
    victim = mangling(cluster, rh.metadata.current_ensemble[0])
    conn = bk.context.pool.connection(victim.id)
    hold = asyncio.Event()
    victim.script = lambda req: Reply.hold(hold) if isinstance(req, m.ReadEntryRequest) else None
    for other in rh.metadata.current_ensemble[1:]:  # the others answer only after the check
        cluster.by_id(other).script = victim.script
    read = asyncio.ensure_future(rh.read_entry(0))
    await asyncio.sleep(0.05)
    read_rid = next(r.request_id for r in reversed(victim.requests) if isinstance(r, m.ReadEntryRequest))
    victim.send_raw([raw_frame([11, 0, 0, None, [read_rid]])])
    await asyncio.sleep(0.05)
    assert conn.state is ConnectionState.CLOSED
    assert isinstance(conn.error, BookieConnectionLost)
    assert isinstance(conn.error.__cause__, ProtocolError)
    hold.set()
    entry = await read
    assert entry.payload == b"entry"
    await bk.close()
