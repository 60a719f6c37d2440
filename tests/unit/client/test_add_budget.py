"""The client-wide budget of adds in flight (``adds_in_flight_max``, client/add_budget.py).

A backlog beyond the budget waits in the client, not in the bookies' queues: it completes with no
timeout although the bookies take longer than the add timeout for the whole of it, while a bookie
that does not answer still times out and is replaced. Permits go to the oldest waiter, are given
back by completed, failed and cancelled adds, and a waiter of a ledger that closes raises.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import pytest

from bookkeeper_aio import BKError, BookKeeper, ClientConfig, LedgerClosed
from bookkeeper_aio.client.add_budget import AddBudget
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from metadata.ledger_manager import LedgerManager
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.client.conftest import FAST, make_client
from tests.unit.client.test_failures import EventLog, read_all

TIMEOUT_S = 0.5
SERVICE_S = 0.005
"""Each fake bookie answers its adds one after another, this long each: a queue, like a journal."""
BUDGET = 8


class SerialBookies:
    """Scripts every bookie of ``cluster`` to answer adds in order, ``SERVICE_S`` apiece, and
    records the deepest queue of unanswered adds each one had."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.loop = asyncio.get_running_loop()
        self.depth_max: dict[str, int] = {}
        for bookie in cluster.bookies:
            bookie.script = self._script_for(bookie.id)

    def _script_for(self, bookie_id: str):  # type: ignore[no-untyped-def]
        answers: collections.deque[float] = collections.deque()  # when each queued add is answered

        def script(request: m.Request) -> Reply | None:
            if not isinstance(request, m.AddEntryRequest):
                return None
            now = self.loop.time()
            while answers and answers[0] <= now:
                answers.popleft()
            at = max(now, answers[-1] if answers else now) + SERVICE_S
            answers.append(at)
            self.depth_max[bookie_id] = max(self.depth_max.get(bookie_id, 0), len(answers))
            return Reply.delay(at - now)

        return script


def _config(budget: int) -> ClientConfig:
    return dataclasses.replace(
        FAST, add_timeout_s=TIMEOUT_S, adds_in_flight_max=budget, explicit_lac_interval_ms=0
    )


async def _backlog(bk: BookKeeper, ledgers: int, adds: int) -> tuple[list[object], list[EventLog]]:
    """``adds`` appends to each of ``ledgers`` ledgers (E2/Qw2/Qa2), all handed over at once."""
    handles = [await bk.create_ledger(2, 2, 2) for _ in range(ledgers)]
    logs = []
    for handle in handles:
        log = EventLog()
        handle.set_event_listener(log)
        logs.append(log)
    appends = [asyncio.ensure_future(h.append(b"e%d" % i)) for i in range(adds) for h in handles]
    results = await asyncio.gather(*appends, return_exceptions=True)
    return results, logs


async def test_backlog_beyond_the_budget__waits_in_the_client_and_completes_with_no_timeout(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    """300 adds at 5 ms apiece are 1.5 s of work for the bookies, three add timeouts: sent all at
    once they would time out in the bookies' queues. With a budget of 8 they wait in the client."""
    bk = make_client(ledgers, StaticDirectory(cluster.ids), _config(BUDGET))
    serial = SerialBookies(cluster)
    results, logs = await _backlog(bk, ledgers=30, adds=10)
    assert results == [i for i in range(10) for _ in range(30)]  # every add, none failed
    for log in logs:
        assert log.assert_no_ack_during_change() == 0  # no timeout: no bookie was replaced
        assert [v for e, v in log.events if e == "add.completed"] == list(range(10))
    assert max(serial.depth_max.values()) <= BUDGET  # what waited, waited in the client
    assert bk._ctx.add_budget.in_flight == 0
    assert bk._ctx.add_budget.waiting == 0
    await bk.close()


async def test_the_same_backlog_without_the_budget__times_out_in_the_bookies_queues(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    """The counterpart: why the budget exists (a budget above the backlog is no budget)."""
    bk = make_client(ledgers, StaticDirectory(cluster.ids), _config(100_000))
    serial = SerialBookies(cluster)
    results, logs = await _backlog(bk, ledgers=30, adds=10)
    changes = sum(log.assert_no_ack_during_change() for log in logs)
    failed = sum(isinstance(r, BaseException) for r in results)
    assert changes + failed > 0, "1.5 s of queued adds with a 0.5 s timeout and none timed out"
    assert max(serial.depth_max.values()) > BUDGET
    bk.abort()


async def test_silent_bookie_behind_a_backlog_beyond_the_budget__still_times_out_and_is_replaced(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    bk = make_client(ledgers, StaticDirectory(cluster.ids), _config(4))
    lh = await bk.create_ledger(3, 2, 2)
    log = EventLog()
    lh.set_event_listener(log)
    await lh.append(b"warm-up")
    stalled = cluster.by_id(lh.metadata.current_ensemble[1])
    stalled.pause()
    appends = [asyncio.ensure_future(lh.append(b"%d" % i)) for i in range(1, 41)]
    for _ in range(20):
        await asyncio.sleep(0)
    assert lh.pending_adds <= 4  # the rest wait for permits, in the client
    assert await asyncio.gather(*appends) == list(range(1, 41))
    assert log.assert_no_ack_during_change() == 1  # the silent bookie timed out once: replaced
    assert stalled.id not in lh.metadata.current_ensemble
    assert [v for e, v in log.events if e == "add.completed"] == list(range(41))
    stalled.resume()
    await lh.close()
    assert await read_all(bk, lh.id) == [b"warm-up"] + [b"%d" % i for i in range(1, 41)]
    await bk.close()


async def test_permits_go_to_the_oldest_waiter_across_ledgers_and_a_closing_ledgers_waiter_raises(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    bk = make_client(ledgers, StaticDirectory(cluster.ids), _config(1))
    first, second = await bk.create_ledger(2, 2, 2), await bk.create_ledger(2, 2, 2)
    for bookie in cluster.bookies:
        bookie.pause()
    held = await first.append_async(b"a")  # takes the only permit
    order: list[str] = []

    async def append(handle, name: str) -> None:  # type: ignore[no-untyped-def]
        await (await handle.append_async(name.encode()))
        order.append(name)

    later = [asyncio.ensure_future(append(h, n)) for h, n in ((second, "s0"), (first, "f1"), (second, "s1"))]
    doomed = asyncio.ensure_future(second.append_async(b"never"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert bk._ctx.add_budget.waiting == 4
    assert first.append_nowait(b"x") is None  # no barging past the waiters
    doomed.cancel()  # a cancelled waiter leaves the queue
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert bk._ctx.add_budget.waiting == 3
    for bookie in cluster.bookies:
        bookie.resume()
    assert await held == 0
    await asyncio.gather(*later)
    assert order == ["s0", "f1", "s1"]  # one permit: strictly the order they asked in
    for bookie in cluster.bookies:
        bookie.pause()
    blocker = await first.append_async(b"b")
    waiting = asyncio.ensure_future(second.append_async(b"c"))
    for _ in range(20):
        await asyncio.sleep(0)
    closing = asyncio.ensure_future(second.close())
    with pytest.raises(LedgerClosed):
        await waiting  # refused at once, not when a permit frees
    for bookie in cluster.bookies:
        bookie.resume()
    assert await blocker == 2
    await closing
    assert bk._ctx.add_budget.in_flight == 0
    assert await first.append(b"d") == 3  # usable after all of it
    await bk.close()


def test_budget__release_hands_permits_to_waiters_before_anyone_else() -> None:
    async def run() -> None:
        budget = AddBudget(2)
        budget.in_flight = 2
        loop = asyncio.get_running_loop()
        waiters = [loop.create_future() for _ in range(3)]
        tasks = [asyncio.ensure_future(budget.wait(w)) for w in waiters]
        await asyncio.sleep(0)
        assert not budget.free()
        budget.release(1)
        assert budget.in_flight == 2  # the freed permit went to the oldest waiter, still taken
        assert not budget.free()
        assert await tasks[0] is True
        budget.refuse(waiters[2])
        assert await tasks[2] is False
        assert budget.waiting == 1
        tasks[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        assert budget.waiting == 0
        budget.release(2)
        assert budget.in_flight == 0
        assert budget.free()

    asyncio.run(run())
    with pytest.raises(ValueError, match="> 0"):
        AddBudget(0)


def test_budget__a_waiter_cancelled_in_the_turn_a_permit_comes_back_takes_none_and_breaks_nothing() -> None:
    """``Task.cancel`` cancels the waiter's future at once, but its ``wait`` leaves the queue only
    when it runs again: a release in between finds the queue emptier than the count of waiters."""

    async def run() -> None:
        budget = AddBudget(1)
        budget.in_flight = 1
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        cancelled = asyncio.ensure_future(budget.wait(first))
        await asyncio.sleep(0)
        cancelled.cancel()
        budget.release(1)  # same turn: the cancelled waiter is still counted
        assert budget.in_flight == 0
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert budget.waiting == 0
        assert budget.free()
        budget.in_flight = 1
        behind = asyncio.ensure_future(budget.wait(second))  # the queue still works after it
        await asyncio.sleep(0)
        budget.release(1)
        assert await behind is True
        assert budget.in_flight == 1

    asyncio.run(run())


async def test_abort_in_the_turn_a_waiting_append_is_cancelled_fails_the_add_in_flight(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    """The shutdown pattern ``task.cancel(); handle.abort()``: the add in flight fails at once
    (before: ``abort`` raised IndexError from the budget and the add's caller waited forever)."""
    hold = asyncio.Event()
    for bookie in cluster.bookies:
        bookie.script = lambda r: Reply.hold(hold) if isinstance(r, m.AddEntryRequest) else None
    bk = make_client(ledgers, StaticDirectory(cluster.ids), _config(1))
    try:
        handle = await bk.create_ledger(3, 3, 2)
        in_flight = asyncio.ensure_future(handle.append(b"a"))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(handle.append(b"b"))  # waits for the one permit
        await asyncio.sleep(0.05)
        waiting.cancel()
        handle.abort()
        with pytest.raises(BKError):
            await asyncio.wait_for(in_flight, 2)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert bk._ctx.add_budget.in_flight == 0
        assert bk._ctx.add_budget.waiting == 0
    finally:
        hold.set()
        await bk.close()


def _write_lacs(cluster: FakeCluster, ledger_id: int) -> list[int]:
    return [
        r.lac
        for bookie in cluster.bookies
        for r in bookie.requests
        if isinstance(r, m.WriteLacRequest) and r.ledger_id == ledger_id
    ]


async def test_a_writer_whose_next_add_waits_for_a_permit_sends_no_write_lac_until_it_stops_waiting(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    """The waiting add carries the LAC once sent (as it would after a wait in a bookie's queue);
    a writer that stops waiting (cancelled) is idle again and its LAC goes out with WRITE_LAC."""
    config = dataclasses.replace(_config(1), explicit_lac_interval_ms=20, explicit_lac_interval_max_ms=20)
    bk = make_client(ledgers, StaticDirectory(cluster.ids), config)
    writer, other = await bk.create_ledger(2, 2, 2), await bk.create_ledger(2, 2, 2)
    assert await writer.append(b"e0") == 0
    gate = asyncio.Event()

    def hold_other(request: m.Request) -> Reply | None:
        if isinstance(request, m.AddEntryRequest) and request.ledger_id == other.id:
            return Reply.hold(gate)
        return None

    for bookie in cluster.bookies:
        bookie.script = hold_other
    held = await other.append_async(b"o0")  # takes the only permit until the gate opens
    waiting = asyncio.ensure_future(writer.append(b"e1"))
    await asyncio.sleep(0.2)  # ten intervals
    assert not waiting.done()
    assert _write_lacs(cluster, writer.id) == []  # e1 will carry LAC 0
    gate.set()
    assert await held == 0
    assert await waiting == 1
    sent = [r for b in cluster.bookies for r in b.requests if isinstance(r, m.AddEntryRequest)]
    assert [r.entry_id for r in sent if r.ledger_id == writer.id].count(1) == 2  # to both bookies
    # stops waiting: cancelled while the permit is taken, the writer is idle and its LAC goes out
    gate.clear()
    held = await other.append_async(b"o1")
    waiting = asyncio.ensure_future(writer.append(b"e2"))
    await asyncio.sleep(0.05)
    before = len(_write_lacs(cluster, writer.id))
    waiting.cancel()
    for _ in range(100):
        if len(_write_lacs(cluster, writer.id)) > before:
            break
        await asyncio.sleep(0.01)
    assert _write_lacs(cluster, writer.id)[before:] == [1, 1]  # LAC 1 to both bookies
    gate.set()
    assert await held == 1
    assert await writer.append(b"e2") == 2
    await bk.close()
