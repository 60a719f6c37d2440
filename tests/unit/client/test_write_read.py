"""The happy path against fake bookies: create, pipelined appends, close, open, read back."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import BookKeeper, HandleState, LedgerClosed
from bookkeeper_aio.protocol import messages as m
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from tests.harness.fake_bookie import FakeCluster


async def test_write__pipelined_entries_read_back_in_order(bk: BookKeeper, ledgers: LedgerManager) -> None:
    lh = await bk.create_ledger(3, 2, 2, password=b"pw", custom_metadata={"app": b"x"})
    futures = [await lh.append_async(b"e%d" % i) for i in range(2000)]
    assert await asyncio.gather(*futures) == list(range(2000))
    assert lh.last_add_confirmed == 1999
    await lh.close()
    stored = (await ledgers.read(lh.id)).metadata
    assert stored.state is LedgerState.CLOSED
    assert stored.last_entry_id == 1999
    assert stored.length == sum(len(b"e%d" % i) for i in range(2000))
    assert stored.custom_metadata["app"] == b"x"

    rh = await bk.open_ledger(lh.id, password=b"pw")
    assert rh.last_add_confirmed == 1999
    got = [(e.entry_id, e.payload) async for e in rh.read()]
    assert got == [(i, b"e%d" % i) for i in range(2000)]


async def test_write__each_entry_goes_to_its_striped_write_set(bk: BookKeeper, cluster: FakeCluster) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    for i in range(6):
        assert await lh.append(b"x") == i
    ensemble = lh.metadata.current_ensemble
    for entry_id in range(6):
        holders = {b.id for b in cluster.bookies if b.entry(lh.id, entry_id) is not None}
        assert holders == {ensemble[entry_id % 3], ensemble[(entry_id + 1) % 3]}
    await lh.close()


async def test_write__lac_is_piggybacked_and_explicit_lac_follows_idle(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 3, 2)
    for _ in range(3):
        await lh.append(b"x")
    # entry 2 carried LAC 1; after the idle interval WRITE_LAC(2) reaches the ensemble
    await asyncio.sleep(0.2)
    for bookie in cluster.bookies:
        if bookie.id in lh.metadata.current_ensemble:
            lacs = [r.lac for r in bookie.requests if isinstance(r, m.WriteLacRequest)]
            assert lacs == [2]
            assert bookie.ledgers[lh.id].lac == 2
    rh = await bk.open_ledger(lh.id)
    assert rh.last_add_confirmed == 2
    assert [e.payload async for e in rh.read()] == [b"x"] * 3
    await lh.close()


async def test_write__open_without_recovery_reads_up_to_lac_while_writer_continues(bk: BookKeeper) -> None:
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    for i in range(10):
        await lh.append(b"%d" % i)
    rh = await bk.open_ledger(lh.id, password=b"pw")
    assert rh.last_add_confirmed >= 8  # entry 9 carried LAC 8
    await lh.append(b"10")
    assert lh.state is HandleState.WRITABLE
    await lh.close()


async def test_close__is_idempotent_and_appends_after_close_fail(bk: BookKeeper) -> None:
    lh = await bk.create_ledger(2, 2, 2)
    await lh.append(b"a")
    await lh.close()
    await lh.close()
    with pytest.raises(LedgerClosed):
        await lh.append(b"b")


async def test_close__empty_ledger_closes_at_minus_one(bk: BookKeeper, ledgers: LedgerManager) -> None:
    async with await bk.create_ledger(3, 2, 2) as lh:
        pass
    stored = (await ledgers.read(lh.id)).metadata
    assert stored.state is LedgerState.CLOSED
    assert stored.last_entry_id == -1
    rh = await bk.open_ledger(lh.id)
    assert [e async for e in rh.read()] == []


async def test_delete__removes_metadata(bk: BookKeeper, ledgers: LedgerManager) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    await lh.close()
    await bk.delete_ledger(lh.id)
    assert not await ledgers.exists(lh.id)
