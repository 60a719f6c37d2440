"""Recovery end to end on fake bookies: the plain cases and the old writer's fate."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from bookkeeper_aio import LedgerFenced
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, ReadFlag
from metadata.ledger_metadata import LedgerState
from tests.unit.recovery.conftest import PASSWORD, World, payload


async def test_recovery__writer_crashed_after_acks_closes_at_last_acked(world: World) -> None:
    writer = world.client()
    lh = await writer.create_ledger(3, 2, 2, password=PASSWORD)
    for i in range(20):
        await lh.append(payload(i))
    lh.abort()  # the writer "crashes": metadata stays OPEN
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD, recovery=True)
    assert rh.is_closed
    assert rh.last_add_confirmed == 19
    assert rh.metadata.state is LedgerState.CLOSED
    assert rh.length == sum(len(payload(i)) for i in range(20))
    assert [e.payload async for e in rh.read()] == [payload(i) for i in range(20)]


async def test_recovery__empty_ledger_closes_at_minus_one(world: World) -> None:
    lh = await world.client().create_ledger(3, 3, 2, password=PASSWORD)
    lh.abort()
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD, recovery=True)
    assert rh.metadata.last_entry_id == -1
    assert rh.length == 0


async def test_recovery__closed_ledger_is_returned_untouched(world: World) -> None:
    lh = await world.client().create_ledger(3, 2, 2, password=PASSWORD)
    await lh.append(b"x")
    await lh.close()
    before = sum(len(b.requests) for b in world.cluster.bookies)
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 0
    fences = [
        r
        for b in world.cluster.bookies
        for r in b.requests[before:]
        if isinstance(r, m.ReadEntryRequest) and r.flags & ReadFlag.FENCE_LEDGER
    ]
    assert fences == []


async def test_recovery__old_writer_gets_fenced_and_its_acked_entries_survive(world: World) -> None:
    writer = world.client()
    lh = await writer.create_ledger(3, 3, 2, password=PASSWORD)
    acked = [await lh.append(payload(i)) for i in range(5)]
    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD, recovery=True)
    with pytest.raises(LedgerFenced):
        await lh.append(b"after the fence")
    assert max(acked) <= rh.last_add_confirmed
    # Seed 000: closing finds CLOSED at the entry it acked last -> success, nothing changes.
    await lh.close()
    assert (await world.ledgers.read(lh.id)).metadata.last_entry_id == rh.last_add_confirmed


async def test_recovery__entries_in_flight_are_written_back_to_the_whole_write_set(world: World) -> None:
    """Ledger E=3 Qw=3 Qa=2; entries 0..3 on all bookies, 4..6 only on bookie 0; 3..6 were in flight
    when the writer died (sent with LAC 2): recovery reads from 3, rewrites 3..6 everywhere, closes
    at 6."""
    v = await world.ledger([(0, [0, 1, 2])], 3, 2, {0: range(7), 1: range(4), 2: range(4)}, in_flight_from=3)
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 6
    for bookie in world.cluster.bookies[:3]:
        assert sorted(bookie.ledgers[v.ledger_id].entries) == list(range(7))
    adds = [r for r in world.cluster.bookies[1].requests if isinstance(r, m.AddEntryRequest)]
    assert adds
    assert all(r.flags & AddFlag.RECOVERY_ADD for r in adds)
    assert sorted(r.entry_id for r in adds) == [3, 4, 5, 6]  # from the LAC on, nothing before it
    # Entries a fenced bookie reported storing are asked of that bookie first, and only of it once
    # it answers with the body; the end (7 on) is asked of the whole write set.
    reads = [
        r.entry_id
        for r in world.cluster.bookies[1].requests
        if isinstance(r, m.ReadEntryRequest) and r.flags & ReadFlag.FENCE_LEDGER and r.entry_id >= 0
    ]
    assert reads
    assert min(reads) == 7


async def test_recovery__concurrent_recoverers_converge(world: World) -> None:
    v = await world.ledger(
        [(0, [0, 1, 2])], 3, 2, {0: range(30), 1: range(25), 2: range(20)}, in_flight_from=20
    )
    clients = [world.client(seed=s) for s in range(3)]
    handles = await asyncio.gather(
        *(c.open_ledger(v.ledger_id, password=PASSWORD, recovery=True) for c in clients)
    )
    assert {h.last_add_confirmed for h in handles} == {29}
    stored = await world.ledgers.read(v.ledger_id)
    assert stored.metadata.last_entry_id == 29


async def test_recovery__an_earlier_fragment_healed_meanwhile_does_not_void_it(world: World) -> None:
    """An autorecovery worker re-replicating an earlier fragment while a recovery runs (its CAS
    lands before the recovery's close) leaves the recovery's decisions standing — they are all in
    the last fragment — and the close keeps the healed fragment."""
    ids = world.cluster.ids
    v = await world.ledger(
        [(0, [0, 1, 2]), (5, [0, 1, 3])], 2, 2, {0: range(9), 1: range(9), 2: range(5), 3: range(5, 9)}
    )
    healed = (ids[0], ids[1], ids[4])
    update = world.ledgers.update
    calls = 0

    async def worker_first(ledger_id: int, transform: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # after IN_RECOVERY: the worker's CAS (bookie 2 -> 4) lands before the close
            await update(
                ledger_id, lambda md: dataclasses.replace(md, ensembles=((0, healed), *md.ensembles[1:]))
            )
        return await update(ledger_id, transform, *args, **kwargs)

    world.ledgers.update = worker_first  # type: ignore[method-assign]
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 8
    stored = (await world.ledgers.read(v.ledger_id)).metadata
    assert stored.state is LedgerState.CLOSED
    assert stored.ensembles == ((0, healed), (5, (ids[0], ids[1], ids[3])))
