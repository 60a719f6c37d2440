"""How a burst of acks completes its adds: once the acks at hand are counted, in one pass in entry
order (not one pass per entry), and a failure in the same burst still completes the adds that had
their quorum before it (they are durable: failing them would say "outcome unknown" of data known
to be stored). The acks are handed to the handle directly, as one socket read's ADD_ACKS would:
the fake bookies are told to drop the adds."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import BookKeeper, LedgerFenced
from bookkeeper_aio.client.connection import ADD_OK
from bookkeeper_aio.errors import BKTimeout
from bookkeeper_aio.protocol import messages as m
from tests.harness.fake_bookie import FakeCluster, Reply

ENTRIES = 8


def _drop_adds(request: m.Request) -> Reply | None:
    return Reply.drop() if isinstance(request, m.AddEntryRequest) else None


async def _unanswered_adds(bk: BookKeeper, cluster: FakeCluster):  # type: ignore[no-untyped-def]
    lh = await bk.create_ledger(3, 2, 2)
    for bookie_id in lh.metadata.current_ensemble:
        cluster.by_id(bookie_id).script = _drop_adds
    futures = [await lh.append_async(b"%d" % i) for i in range(ENTRIES)]
    return lh, futures, list(lh._pending)


def _ack_to_quorum(lh, ops) -> None:  # type: ignore[no-untyped-def]
    """Every bookie of each op's write set acks it, last entry first (the order acks of two bookies
    may interleave in): nothing may complete before entry 0 does."""
    for op in reversed(ops):
        for bookie_id in op.write_set:
            lh._on_add_result(op, bookie_id, ADD_OK)


async def test_a_burst_of_acks_completes_its_adds_in_one_pass_in_entry_order(
    bk: BookKeeper, cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    lh, futures, ops = await _unanswered_adds(bk, cluster)
    passes = 0
    complete_ready = type(lh)._complete_ready

    def counted(handle) -> None:  # type: ignore[no-untyped-def]
        nonlocal passes
        passes += 1
        complete_ready(handle)

    monkeypatch.setattr(type(lh), "_complete_ready", counted)
    done_order: list[int] = []
    for entry_id, future in enumerate(futures):
        future.add_done_callback(lambda _f, e=entry_id: done_order.append(e))
    _ack_to_quorum(lh, ops)
    assert not any(f.done() for f in futures)  # counted first, completed once they all are
    assert await asyncio.gather(*futures) == list(range(ENTRIES))
    assert passes == 1
    assert done_order == list(range(ENTRIES))
    assert lh.last_add_confirmed == ENTRIES - 1
    lh.abort()


async def test_a_failure_in_the_same_burst_completes_the_adds_that_had_their_quorum(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh, futures, ops = await _unanswered_adds(bk, cluster)
    _ack_to_quorum(lh, ops[:5])  # entries 0..4 reach Qa
    lh._on_add_result(ops[6], ops[6].write_set[0], ADD_OK)  # one ack: below Qa
    lh._fail(LedgerFenced("fenced in the same read"))
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert results[:5] == [0, 1, 2, 3, 4]
    assert all(isinstance(r, LedgerFenced) for r in results[5:])
    assert lh.last_add_confirmed == 4


async def test_a_bookie_failure_in_the_same_burst_completes_the_adds_that_had_their_quorum_first(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    """A bookie failure read after acks in the same burst (before the pass runs) must not hold back
    the adds whose quorum was counted: they complete before the ensemble change starts, which then
    starts its new fragment after them (not at the stale LAC, taking their acks away)."""
    lh, futures, ops = await _unanswered_adds(bk, cluster)
    events: list[tuple[str, object]] = []
    lh.set_event_listener(lambda name, arg: events.append((name, arg)))
    _ack_to_quorum(lh, ops[:5])  # entries 0..4 reach Qa
    lh._bookie_failed(ops[6].write_set[0], BKTimeout("failed in the same read"))
    assert [f.done() for f in futures[:5]] == [True] * 5
    assert await asyncio.gather(*futures[:5]) == [0, 1, 2, 3, 4]
    assert lh.last_add_confirmed == 4
    assert ("ensemble_change.started", 4) in events
    lh.abort()


async def test_batched_acks_complete_in_entry_order_and_count_only_write_set_members(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    """``_on_add_acks`` (one ADD_ACKS answer's adds of this ledger): a bookie's ack counts for the
    entries whose write set holds it, and none for the others."""
    lh, futures, ops = await _unanswered_adds(bk, cluster)
    ensemble = lh.metadata.current_ensemble
    lh._on_add_acks(ops, ensemble[0])  # counts for the entries of the write sets holding it only
    assert [op.acked.bit_count() for op in ops] == [int(ensemble[0] in op.write_set) for op in ops]
    for bookie_id in reversed(ensemble[1:]):
        lh._on_add_acks(ops, bookie_id)
    assert not any(f.done() for f in futures)  # one pass, once the read's acks are counted
    assert await asyncio.gather(*futures) == list(range(ENTRIES))
    assert [op.acked.bit_count() for op in ops] == [2] * ENTRIES
    assert lh.last_add_confirmed == ENTRIES - 1
    lh.abort()


async def test_an_add_whose_caller_cancelled_its_future_still_completes_in_order(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh, futures, ops = await _unanswered_adds(bk, cluster)
    futures[2].cancel()
    _ack_to_quorum(lh, ops)
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    assert results[:2] + results[3:] == [0, 1, 3, 4, 5, 6, 7]
    assert lh.last_add_confirmed == ENTRIES - 1
    assert not lh._pending
    lh.abort()
