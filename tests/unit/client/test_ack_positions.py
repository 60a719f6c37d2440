"""Acks across an ensemble change (acks are a bitmask over write-set positions).

E=3 Qw=2 Qa=2 on four bookies: ensemble [A, B, C] plus a spare D. Entry 0's write set is (A, B).
One bookie of it acks entry 0, the other fails (on another entry) while its own answer to entry 0
is still in flight, and is replaced by D. The surviving ack must still count, at its position in
the new write set; the replaced bookie's late ack must not; exactly one more ack (D's) completes
the entry. The order of completions is read from the handle's event listener.

The client replaces a failed bookie *in place* (same ensemble position), so a survivor keeps its
position; the remapping code also handles positions that move, which the last tests drive
directly on the handle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.client.mangling_bookie import EventLog, cluster, mangling

__all__ = ["cluster"]  # the fixture: four ManglingBookies instead of conftest's plain ones


class ChangeLog(EventLog):
    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def __call__(self, event: str, value: int) -> None:
        super().__call__(event, value)
        if event == "ensemble_change.finished":
            self.changed.set()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 (state with no event to wait on)
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("failing_position", [0, 1])
async def test_surviving_ack_counts_after_the_change_and_the_replaced_bookies_late_ack_does_not(
    bk: BookKeeper, cluster: FakeCluster, failing_position: int
) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    events = ChangeLog()
    lh.set_event_listener(events)
    a, b, c = lh.metadata.current_ensemble
    (spare,) = [x for x in cluster.ids if x not in (a, b, c)]
    write_set = (a, b)  # entry 0
    failing = write_set[failing_position]
    survivor = write_set[1 - failing_position]
    victim = mangling(cluster, failing)
    late: list[bytes] = []

    def keep_entry_0(resp: m.AddEntryResponse, frame: bytes) -> list[bytes]:
        if resp.status == 0 and resp.entry_id == 0:
            late.append(frame)  # its ack to entry 0 stays in flight
            return []
        return [frame]

    victim.mangle = keep_entry_0
    # The failing bookie fails entries 1 (B, C) or 2 (C, A), whichever it stores.
    victim.script = lambda req: (
        Reply.error(StatusCode.EIO) if isinstance(req, m.AddEntryRequest) and req.entry_id != 0 else None
    )
    cluster.by_id(spare).pause()  # the replacement's answers wait until we let them go

    futures = [await lh.append_async(b"%d" % i) for i in range(3)]
    await asyncio.wait_for(events.changed.wait(), 2.0)
    assert failing not in lh.metadata.current_ensemble
    assert spare in lh.metadata.current_ensemble
    new_write_set = tuple(spare if x == failing else x for x in write_set)
    op = lh._pending[0]
    assert op.entry_id == 0
    assert op.write_set == new_write_set
    assert op.acked == 1 << new_write_set.index(survivor)  # moved with the survivor (in place here)
    assert not op.quorum
    assert not any(f.done() for f in futures)

    # The replaced bookie's late ack reaches the handle (its connection is up, the request still
    # pending there) and is ignored.
    assert late
    assert victim._conns
    conn = bk.context.pool.connection(failing)
    assert conn.pending_count >= 1
    victim.send_raw(late)
    await wait_until(lambda: conn.pending_count == 0)
    await asyncio.sleep(0.05)
    assert not futures[0].done()
    assert op.acked == 1 << new_write_set.index(survivor)

    # Exactly one more ack, the replacement's, completes it.
    cluster.by_id(spare).resume()
    assert await asyncio.gather(*futures) == [0, 1, 2]
    assert events.events == [
        ("ensemble_change.started", -1),
        ("ensemble_change.finished", 0),
        ("add.completed", 0),
        ("add.completed", 1),
        ("add.completed", 2),
    ]
    assert lh.ensemble_changes == 1
    await lh.close()


async def test_ack_during_the_change_from_a_survivor_counts_once_the_change_lands(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    """The survivor's ack arrives while the metadata CAS is in flight: it is recorded against the
    old write set, moved by the change, and with the replacement's ack completes the entry."""
    lh = await bk.create_ledger(3, 2, 2)
    events = ChangeLog()
    lh.set_event_listener(events)
    a, b, _c = lh.metadata.current_ensemble
    (spare,) = [x for x in cluster.ids if x not in lh.metadata.current_ensemble]
    survivor = mangling(cluster, a)
    held: list[bytes] = []
    survivor.mangle = lambda resp, frame: held.append(frame) or []  # type: ignore[func-returns-value]
    cluster.by_id(b).script = lambda req: (
        Reply.error(StatusCode.EIO) if isinstance(req, m.AddEntryRequest) else None
    )
    started = asyncio.Event()
    release_cas = asyncio.Event()
    ledgers = bk.context.ledgers
    real_write = ledgers.write

    async def slow_write(*args: object, **kwargs: object) -> object:
        started.set()
        await release_cas.wait()
        return await real_write(*args, **kwargs)  # type: ignore[arg-type]

    ledgers.write = slow_write  # type: ignore[method-assign]
    try:
        future = await lh.append_async(b"0")
        await asyncio.wait_for(started.wait(), 2.0)
        await wait_until(lambda: bool(held))
        survivor.mangle = None
        survivor.send_raw(held)
        await wait_until(lambda: lh._pending[0].acked != 0)
        assert lh._pending[0].write_set == (a, b)
        assert not future.done()
        release_cas.set()
        assert await asyncio.wait_for(future, 2.0) == 0
    finally:
        ledgers.write = real_write  # type: ignore[method-assign]
    assert spare in lh.metadata.current_ensemble
    assert events.events == [
        ("ensemble_change.started", -1),
        ("ensemble_change.finished", 0),
        ("add.completed", 0),
    ]
    assert cluster.by_id(spare).entry(lh.id, 0) is not None  # the one more ack came from D
    await lh.close()


def _move(lh: LedgerHandle, ensemble: tuple[str, ...]) -> None:
    """What an ensemble change does to the handle's write sets, with an arbitrary new ensemble."""
    lh._use_ensemble(ensemble)
    lh._resend_outstanding()


async def test_moved_position__survivor_ack_moves_replaced_ack_is_dropped_replacement_completes(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    events = EventLog()
    lh.set_event_listener(events)
    a, b, c = lh.metadata.current_ensemble
    (d,) = [x for x in cluster.ids if x not in (a, b, c)]
    cluster.by_id(b).pause()
    cluster.by_id(d).pause()
    future = await lh.append_async(b"0")  # write set (A, B)
    await wait_until(lambda: lh._pending[0].acked == 0b01)  # A at position 0
    op = lh._pending[0]

    _move(lh, (d, a, c))  # entry 0's write set becomes (D, A): A moves to position 1, B is gone
    assert op.write_set == (d, a)
    assert op.acked == 0b10
    assert not op.quorum
    assert d in op.sent_to  # re-sent to the new member

    cluster.by_id(b).resume()  # B's ack: from a bookie no longer in the write set
    await asyncio.sleep(0.1)
    assert not future.done()
    assert op.acked == 0b10
    cluster.by_id(d).resume()  # one more ack, from D at position 0
    assert await asyncio.wait_for(future, 2.0) == 0
    assert events.events == [("add.completed", 0)]
    lh.abort()


async def test_moved_position__acks_that_already_made_quorum_are_recounted(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    """Entry 1 (write set (B, C)) has both acks, Qa=2, but waits behind entry 0. A change that
    keeps both ackers at swapped positions keeps its quorum; one that drops an acker loses it (the
    other ack moves); nothing completes meanwhile."""
    lh = await bk.create_ledger(3, 2, 2)
    events = EventLog()
    lh.set_event_listener(events)
    a, b, c = lh.metadata.current_ensemble
    (d,) = [x for x in cluster.ids if x not in (a, b, c)]
    for x in (a, b):
        cluster.by_id(x).script = lambda req: (
            Reply.drop() if isinstance(req, m.AddEntryRequest) and req.entry_id == 0 else None
        )
    first = await lh.append_async(b"0")
    second = await lh.append_async(b"1")
    await wait_until(lambda: lh._pending[1].acked == 0b11)
    op = lh._pending[1]
    assert op.write_set == (b, c)
    assert op.quorum
    assert not second.done()

    _move(lh, (a, c, b))  # entry 1's write set (C, B): both kept, positions swapped
    assert op.write_set == (c, b)
    assert op.acked == 0b11
    assert op.quorum

    cluster.by_id(d).pause()
    _move(lh, (a, d, c))  # entry 1's write set (D, C): B's ack is gone, C's moves to position 1
    assert op.write_set == (d, c)
    assert op.acked == 0b10
    assert not op.quorum
    assert d in op.sent_to
    await asyncio.sleep(0.05)
    assert not first.done()
    assert not second.done()
    assert events.events == []
    lh.abort()
