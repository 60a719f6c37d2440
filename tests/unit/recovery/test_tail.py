"""Tailing readers on fake bookies: live writer, explicit LAC, close, ensemble change, recovery."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from bookkeeper_aio import LedgerEntry, NoSuchLedger, ReadHandle
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import ReadFlag, StatusCode
from tests.harness.fake_bookie import Reply
from tests.unit.recovery.conftest import PASSWORD, World, payload


async def _collect(handle: ReadHandle, from_entry: int = 0) -> list[LedgerEntry]:
    return [entry async for entry in handle.tail(from_entry)]


async def test_tail__sees_every_entry_in_order_and_stops_at_close(world: World) -> None:
    lh = await world.client().create_ledger(3, 2, 2, password=PASSWORD)
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    reader = asyncio.create_task(_collect(rh))
    for i in range(50):
        await lh.append(payload(i))
        if i % 10 == 0:
            await asyncio.sleep(0.01)
    await lh.close()
    got = await asyncio.wait_for(reader, 5)
    assert [e.entry_id for e in got] == list(range(50))
    assert [e.payload for e in got] == [payload(i) for i in range(50)]


async def test_tail__last_entry_visible_without_a_following_write(world: World) -> None:
    """The writer goes idle after entry 4: the explicit LAC (WRITE_LAC) wakes the long poll."""
    lh = await world.client().create_ledger(3, 3, 2, password=PASSWORD)
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    seen: list[int] = []
    all_five = asyncio.Event()

    async def follow() -> None:
        async with contextlib.aclosing(rh.tail(0)) as entries:
            async for entry in entries:
                seen.append(entry.entry_id)
                if entry.entry_id == 4:
                    all_five.set()

    reader = asyncio.create_task(follow())
    for i in range(5):
        await lh.append(payload(i))
    await asyncio.wait_for(all_five.wait(), 2)  # no sixth write, no close
    assert seen == [0, 1, 2, 3, 4]
    write_lacs = [r for b in world.cluster.bookies for r in b.requests if isinstance(r, m.WriteLacRequest)]
    assert write_lacs
    await lh.close()
    await asyncio.wait_for(reader, 2)


async def test_tail__piggybacked_entries_avoid_extra_reads(world: World) -> None:
    lh = await world.client().create_ledger(3, 3, 2, password=PASSWORD)
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    reader = asyncio.create_task(_collect(rh))
    await asyncio.sleep(0.05)  # the reader is waiting in a long poll
    for i in range(20):
        await lh.append(payload(i))
        await asyncio.sleep(0.002)
    await lh.close()
    assert len(await asyncio.wait_for(reader, 5)) == 20
    plain_reads = [
        r
        for b in world.cluster.bookies
        for r in b.requests
        if isinstance(r, m.ReadEntryRequest) and not r.flags & ReadFlag.LONG_POLL and r.entry_id >= 0
    ]
    assert len(plain_reads) < 10  # most entries came piggybacked on the long poll


async def test_tail__closed_ledger_is_read_to_its_last_entry_and_ends(world: World) -> None:
    lh = await world.client().create_ledger(3, 2, 2, password=PASSWORD)
    for i in range(7):
        await lh.append(payload(i))
    await lh.close()
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    got = await asyncio.wait_for(_collect(rh, 3), 2)
    assert [e.entry_id for e in got] == [3, 4, 5, 6]


async def test_tail__striped_ledger_and_bookies_without_the_ledger_yet(world: World) -> None:
    """E=5 Qw=2: bookies of the ensemble have not seen the ledger when the tail starts (ENOLEDGER to
    the long poll) — that is "nothing yet", not an end."""
    lh = await world.client().create_ledger(5, 2, 2, password=PASSWORD)
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    reader = asyncio.create_task(_collect(rh))
    await asyncio.sleep(0.05)
    for i in range(23):
        await lh.append(payload(i))
    await lh.close()
    assert [e.entry_id for e in await asyncio.wait_for(reader, 5)] == list(range(23))


async def test_tail__follows_an_ensemble_change(world: World) -> None:
    lh = await world.client().create_ledger(3, 3, 2, password=PASSWORD)
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    reader = asyncio.create_task(_collect(rh))
    for i in range(10):
        await lh.append(payload(i))
    victim = world.cluster.by_id(lh.metadata.current_ensemble[1])
    victim.script = lambda req: Reply.error(StatusCode.EIO) if isinstance(req, m.AddEntryRequest) else None
    for i in range(10, 30):
        await lh.append(payload(i))
    assert lh.ensemble_changes == 1
    await lh.close()
    assert [e.entry_id for e in await asyncio.wait_for(reader, 5)] == list(range(30))


async def test_tail__ends_at_the_recovered_last_entry_when_another_client_recovers(world: World) -> None:
    lh = await world.client().create_ledger(3, 3, 2, password=PASSWORD)
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    reader = asyncio.create_task(_collect(rh))
    for i in range(12):
        await lh.append(payload(i))
    lh.abort()  # the writer dies; a new owner recovers
    recovered = await world.client(seed=9).open_ledger(lh.id, password=PASSWORD, recovery=True)
    got = await asyncio.wait_for(reader, 5)
    assert [e.entry_id for e in got] == list(range(recovered.last_add_confirmed + 1))
    assert recovered.last_add_confirmed == 11


async def test_tail__deleted_ledger_raises(world: World) -> None:
    bk = world.client()
    lh = await bk.create_ledger(3, 2, 2, password=PASSWORD)
    await lh.append(payload(0))
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    reader = asyncio.create_task(_collect(rh))
    await asyncio.sleep(0.05)
    lh.abort()
    await bk.delete_ledger(lh.id, password=PASSWORD)
    with pytest.raises(NoSuchLedger):
        await asyncio.wait_for(reader, 2)


async def test_tail__early_exit_cancels_the_watch(world: World) -> None:
    lh = await world.client().create_ledger(3, 2, 2, password=PASSWORD)
    for i in range(5):
        await lh.append(payload(i))
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    tasks_before = len(asyncio.all_tasks())
    async with contextlib.aclosing(rh.tail(0)) as entries:
        async for entry in entries:
            if entry.entry_id == 2:
                break
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == tasks_before
    await lh.close()


async def test_tail__a_cancel_arriving_while_closing_is_not_swallowed(world: World) -> None:
    """The caller is cancelled just as it leaves the loop: closing the tail awaits its metadata watch,
    where the cancel lands; it must reach the caller, not end the watch's clean-up quietly."""
    lh = await world.client().create_ledger(3, 2, 2, password=PASSWORD)
    for i in range(5):
        await lh.append(payload(i))
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD)
    after_loop: list[str] = []

    async def follow() -> None:
        async with contextlib.aclosing(rh.tail(0)) as entries:
            async for entry in entries:
                if entry.entry_id == 2:
                    asyncio.current_task().cancel()  # type: ignore[union-attr]
                    break
        after_loop.append("ran on after a cancel")

    task = asyncio.create_task(follow())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert after_loop == []
    await lh.close()
