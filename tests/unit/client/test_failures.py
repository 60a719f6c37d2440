"""Bookie failures on the write path: ensemble change (docs/replication.md §2), fencing, slow bookies,
backpressure."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper, ClientConfig, LedgerFenced, NotEnoughBookies, Unauthorized
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.harness.fake_bookie import LedgerState as FakeLedger
from tests.unit.client.conftest import make_client


class EventLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __call__(self, event: str, value: int) -> None:
        self.events.append((event, value))

    def assert_no_ack_during_change(self) -> int:
        changing = False
        changes = 0
        for event, _ in self.events:
            if event == "ensemble_change.started":
                changing = True
                changes += 1
            elif event == "ensemble_change.finished":
                changing = False
            elif event == "add.completed":
                assert not changing, "an add completed while an ensemble change was in flight"
        return changes


async def read_all(bk: BookKeeper, ledger_id: int, password: bytes = b"") -> list[bytes]:
    rh = await bk.open_ledger(ledger_id, password=password)
    return [e.payload async for e in rh.read()]


async def test_ensemble_change__killed_bookie_is_replaced_at_lac_plus_one(
    bk: BookKeeper, cluster: FakeCluster, ledgers: LedgerManager
) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    events = EventLog()
    lh.set_event_listener(events)
    for i in range(50):
        await lh.append(b"%d" % i)
    victim = cluster.by_id(lh.metadata.current_ensemble[0])
    futures = [await lh.append_async(b"%d" % i) for i in range(50, 100)]
    await victim.kill()
    futures += [await lh.append_async(b"%d" % i) for i in range(100, 300)]
    assert await asyncio.gather(*futures) == list(range(50, 300))
    assert events.assert_no_ack_during_change() >= 1
    md = (await ledgers.read(lh.id)).metadata
    assert len(md.ensembles) == 2
    first, bookies = md.ensembles[1]
    started = [v for e, v in events.events if e == "ensemble_change.started"]
    assert first == started[0] + 1  # the new fragment starts at LAC+1 as of the change
    assert victim.id not in bookies
    await lh.close()
    assert await read_all(bk, lh.id) == [b"%d" % i for i in range(300)]


async def test_ensemble_change__error_status_replaces_bookie_and_ignores_its_late_acks(
    bk: BookKeeper, cluster: FakeCluster, ledgers: LedgerManager
) -> None:
    lh = await bk.create_ledger(3, 3, 2)
    await lh.append(b"0")
    victim = cluster.by_id(lh.metadata.current_ensemble[1])
    victim.script = lambda req: Reply.error(StatusCode.EIO) if isinstance(req, m.AddEntryRequest) else None
    assert await lh.append(b"1") == 1
    for i in range(2, 10):
        await lh.append(b"%d" % i)
    md = (await ledgers.read(lh.id)).metadata
    assert victim.id not in md.current_ensemble
    assert lh.ensemble_changes == 1
    await lh.close()
    assert await read_all(bk, lh.id) == [b"%d" % i for i in range(10)]


async def test_ensemble_change__no_replacement_fails_with_not_enough_bookies(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    directory = StaticDirectory(cluster.ids[:3])
    bk = make_client(ledgers, directory)
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    await cluster.by_id(lh.metadata.current_ensemble[0]).kill()
    with pytest.raises(NotEnoughBookies):
        await asyncio.gather(*[await lh.append_async(b"b") for _ in range(5)])
    await bk.close()


async def test_ensemble_change__cas_conflict_with_recovery_fails_outstanding_adds_as_fenced(
    bk: BookKeeper, cluster: FakeCluster, ledgers: LedgerManager
) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.in_recovery(), current.version)  # a recoverer got there first
    await cluster.by_id(lh.metadata.current_ensemble[1]).kill()
    with pytest.raises(LedgerFenced):
        await asyncio.gather(*[await lh.append_async(b"b") for _ in range(5)])
    with pytest.raises(LedgerFenced):
        await lh.close()


async def test_fenced_bookie__fails_the_handle_with_ledger_fenced(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    await lh.append(b"a")
    for bookie in cluster.bookies:
        if lh.id in bookie.ledgers:
            bookie.ledgers[lh.id].fenced = True
    with pytest.raises(LedgerFenced):
        await lh.append(b"b")
    with pytest.raises(LedgerFenced):
        await lh.append(b"c")


async def test_wrong_master_key_on_bookie__unauthorized(bk: BookKeeper, cluster: FakeCluster) -> None:
    lh = await bk.create_ledger(3, 2, 2, password=b"right")
    for bookie in cluster.bookies:
        bookie.ledgers[lh.id] = FakeLedger(master_key=b"someone else's key")
    with pytest.raises(Unauthorized):
        await lh.append(b"a")


async def test_slow_bookie__times_out_is_replaced_and_its_late_answers_are_ignored(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    config = ClientConfig(
        add_timeout_s=0.3,
        read_timeout_s=1.0,
        reconnect_backoff_initial_s=0.01,
        explicit_lac_interval_ms=20,
    )
    bk = make_client(ledgers, StaticDirectory(cluster.ids), config)
    lh = await bk.create_ledger(3, 2, 2)
    events = EventLog()
    lh.set_event_listener(events)
    for i in range(20):
        await lh.append(b"%d" % i)
    stalled = cluster.by_id(lh.metadata.current_ensemble[2])
    stalled.pause()
    futures = [await lh.append_async(b"%d" % i) for i in range(20, 200)]
    results = await asyncio.gather(*futures)
    assert results == list(range(20, 200))
    stalled.resume()  # its held (late) answers arrive now
    await asyncio.sleep(0.05)
    for i in range(200, 250):
        assert await lh.append(b"%d" % i) == i
    completed = [v for e, v in events.events if e == "add.completed"]
    assert completed == list(range(250))  # no duplicates, no reordering
    events.assert_no_ack_during_change()
    assert stalled.id not in lh.metadata.current_ensemble
    await lh.close()
    assert await read_all(bk, lh.id) == [b"%d" % i for i in range(250)]
    await bk.close()


async def test_backpressure__append_waits_for_a_window_slot_and_cancel_leaves_handle_usable(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    config = ClientConfig(add_window_max=4, add_timeout_s=5.0, explicit_lac_interval_ms=0)
    bk = make_client(ledgers, StaticDirectory(cluster.ids), config)
    lh = await bk.create_ledger(2, 2, 2)
    for bookie_id in lh.metadata.current_ensemble:
        cluster.by_id(bookie_id).pause()
    futures = [await lh.append_async(b"x") for _ in range(4)]
    assert lh.pending_adds == 4
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await lh.append_async(b"x")  # window full: waits, then cancelled by the timeout
    assert lh.pending_adds == 4
    waiter = asyncio.ensure_future(lh.append_async(b"y"))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    for bookie_id in lh.metadata.current_ensemble:
        cluster.by_id(bookie_id).resume()
    assert await asyncio.gather(*futures) == [0, 1, 2, 3]
    assert await (await waiter) == 4
    assert await lh.append(b"z") == 5  # usable after the cancelled wait
    await lh.close()
    await bk.close()


async def test_cas_failpoint_metadata_unknown_result_is_resolved_by_reading_back(
    bk: BookKeeper, cluster: FakeCluster, ledgers: LedgerManager, store
) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    store.lose_next_write_result(applied=True)
    await cluster.by_id(lh.metadata.current_ensemble[0]).kill()
    for i in range(1, 10):
        assert await lh.append(b"b") == i
    md = (await ledgers.read(lh.id)).metadata
    assert md.state is LedgerState.OPEN
    assert len(md.ensembles) == 2
    await lh.close()


async def test_connection_closed_while_idle__next_add_goes_to_the_pools_new_connection(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    """The handle keeps each write set's connections; one that closed while no add was pending
    (nothing failed, no ensemble change) is looked up again: the add reaches the bookie."""
    lh = await bk.create_ledger(3, 3, 3)
    assert await lh.append(b"0") == 0
    bookie_id = lh.metadata.current_ensemble[0]
    old = bk.context.pool.connection(bookie_id)
    old.abort()
    assert await lh.append(b"1") == 1
    new = bk.context.pool.connection(bookie_id)
    assert new is not old
    assert cluster.by_id(bookie_id).entry(lh.id, 1) is not None
    assert lh.ensemble_changes == 0
    await lh.close()


async def test_ensemble_change__an_add_reaching_qa_while_the_change_is_in_flight_waits_for_it(
    bk: BookKeeper, cluster: FakeCluster, store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entry 0 (write set A, B) gets its second ack while the change replacing C (failed on entry 1)
    is still writing the metadata: it must complete only after that CAS (docs/replication.md §2:
    no add is acknowledged while a change is in flight). `make mutants` removes the guard."""
    lh = await bk.create_ledger(3, 2, 2)
    a, b, c = (cluster.by_id(bookie) for bookie in lh.metadata.current_ensemble)
    release_b, cas_entered, cas_gate = asyncio.Event(), asyncio.Event(), asyncio.Event()
    b.script = lambda req: Reply.hold(release_b) if isinstance(req, m.AddEntryRequest) else None
    entry0 = await lh.append_async(b"0")  # write set {A, B}: A acks, B holds
    real_cas = store.compare_and_set

    async def gated_cas(key: str, value: bytes, expected_version: int, **kwargs: Any) -> int:
        cas_entered.set()
        await cas_gate.wait()
        return await real_cas(key, value, expected_version, **kwargs)

    monkeypatch.setattr(store, "compare_and_set", gated_cas)
    c.script = lambda req: Reply.error(StatusCode.EIO) if isinstance(req, m.AddEntryRequest) else None
    entry1 = await lh.append_async(b"1")  # write set {B, C}: C fails, the change starts
    await asyncio.wait_for(cas_entered.wait(), 5)
    release_b.set()  # entry 0 now has Qa acks (A, B), while the change's CAS is held
    await asyncio.sleep(0.2)
    assert not entry0.done(), "an add completed while an ensemble change was in flight"
    cas_gate.set()
    assert await asyncio.gather(entry0, entry1) == [0, 1]
    assert c.id not in lh.metadata.current_ensemble
    assert a.id in lh.metadata.current_ensemble
    await lh.close()
