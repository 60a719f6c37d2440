"""Against real bookie processes and a real etcd: listing ledgers, reading one chosen replica,
the replaced-bookies history, ``LedgerState`` from the package, and ``outcome_unknown`` on an add
the writer sent after a reader recovered its ledger."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import (
    BKError,
    BKInterfaceError,
    BKTimeout,
    BookieConnectionLost,
    BookKeeper,
    LedgerFenced,
    LedgerState,
)
from tests.integration.client.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd


async def test_list_ledgers_pages_through_every_ledger_id(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    ids = []
    for _ in range(5):
        lh = await bk.create_ledger(3, 2, 2)
        await lh.close()
        ids.append(lh.id)
    assert [i async for i in bk.list_ledgers(page_size=2)] == sorted(ids)
    await bk.delete_ledger(ids[2])
    assert [i async for i in bk.list_ledgers()] == sorted(ids[:2] + ids[3:])
    with pytest.raises(BKInterfaceError, match="page_size"):
        bk.list_ledgers(page_size=0)


async def test_read_from_reads_each_replica_and_refuses_a_bookie_outside_the_write_set(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    for i in range(6):
        await lh.append(b"entry-%d" % i)
    await lh.close()
    rh = await bk.open_ledger(lh.id, password=b"pw")
    assert rh.metadata.state is LedgerState.CLOSED  # the enum comes from bookkeeper_aio too
    for entry_id in range(6):
        replicas = rh.replicas(entry_id)
        assert len(replicas) == 2
        for bookie_id in replicas:
            entry = await rh.read_from(bookie_id, entry_id)
            assert (entry.entry_id, entry.payload) == (entry_id, b"entry-%d" % entry_id)
        (outsider,) = set(rh.metadata.current_ensemble) - set(replicas)
        with pytest.raises(BKInterfaceError, match=rf"not in the write set of entry {entry_id}"):
            await rh.read_from(outsider, entry_id)
    with pytest.raises(BKInterfaceError, match="beyond the last add confirmed"):
        await rh.read_from(rh.replicas(6)[0], 6)
    victim = rh.replicas(0)[0]
    await cluster.kill(victim)
    with pytest.raises((BookieConnectionLost, BKTimeout)):
        await rh.read_from(victim, 0)
    assert (await rh.read_entry(0)).payload == b"entry-0"  # the normal read uses the other replica


async def test_change_at_entry_0_is_kept_in_the_replaced_bookies_history(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(4)
    lh = await bk.create_ledger(3, 3, 2)
    victim = lh.metadata.current_ensemble[1]
    await cluster.kill(victim)
    for i in range(5):
        await lh.append(b"%d" % i)
    await lh.close()
    rh = await bk.open_ledger(lh.id)
    md = rh.metadata
    assert len(md.ensembles) == 1  # replaced in place: the fragments no longer name the victim
    assert victim not in md.current_ensemble
    (record,) = md.replaced_bookies
    assert (record.first_entry, record.bookie) == (0, victim)
    assert record.replacement == md.current_ensemble[1]
    assert [e.payload async for e in rh.read()] == [b"%d" % i for i in range(5)]


async def test_add_sent_after_the_ledger_was_recovered_has_unknown_outcome(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    writer = await bk.create_ledger(3, 2, 2, password=b"pw")
    await writer.append(b"kept")
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        recovered = await other.open_ledger(writer.id, password=b"pw", recovery=True)
    assert recovered.last_add_confirmed == 0
    future = await writer.append_async(b"late")  # handed to the bookies, which are fenced
    with pytest.raises(LedgerFenced) as sent:
        await asyncio.wait_for(future, 10)
    assert sent.value.outcome_unknown is True
    with pytest.raises(BKError) as refused:  # the handle failed: refused before sending
        await writer.append(b"later")
    assert isinstance(refused.value, LedgerFenced)
    assert refused.value.outcome_unknown is False
