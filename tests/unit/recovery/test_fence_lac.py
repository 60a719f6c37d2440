"""The fence step's LAC comes from digest-verified last-entry bodies, never the ``lac`` field.

A bookie's ``lac`` (READ_ENTRY response field) is the maximum of header LACs it never verified and
of WRITE_LAC values: no digest covers it. Recovery takes the header LAC of the verified last entry
each fenced bookie returns (BookKeeper's ReadLastConfirmedOp), -1 for a reply without a verified
body. A last entry the bookie cannot read (EOK + ``unreadable``) or that fails the digest still
proves the fence; that copy is unknown in the reads that follow, never absent.
"""

from __future__ import annotations

import pytest

from bookkeeper_aio import LedgerRecoveryError
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, ReadFlag
from metadata.ledger_metadata import LedgerState
from tests.harness.fake_bookie import FakeBookie, Reply
from tests.unit.recovery.conftest import PASSWORD, World, payload


def _recovery_adds(world: World, index: int) -> list[int]:
    return sorted(
        r.entry_id
        for r in world.cluster.bookies[index].requests
        if isinstance(r, m.AddEntryRequest) and r.flags & AddFlag.RECOVERY_ADD
    )


def _late_fence_answer(req: m.Request) -> Reply | None:
    return Reply.delay(0.2) if isinstance(req, m.ReadEntryRequest) and req.entry_id == -1 else None


@pytest.mark.parametrize("inflated", [5, 100])
async def test_fence_lac__inflated_lac_field_is_ignored(world: World, inflated: int) -> None:
    """E=Qw=3 Qa=2; entries 0..3 on every bookie, 4..6 only on b0; 3..6 were in flight (header LAC
    2 everywhere). b0's ``lac`` field says ``inflated`` (a bogus WRITE_LAC, a bad header).

    Trusting it would start the reads after 5 (entries 4 and 5 left on b0 alone, never written
    back, although the ledger closes after them) or after 100 (the ledger "ends" at 100, an entry
    that does not exist). The verified header LAC is 2: read from 3, write 3..6 back, close at 6."""
    v = await world.ledger(
        [(0, [0, 1, 2])],
        3,
        2,
        {0: range(7), 1: range(4), 2: range(4)},
        in_flight_from=3,
        lacs={0: inflated},
    )
    world.cluster.bookies[1].script = _late_fence_answer  # b0 and b2 are the covering replies
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 6
    assert rh.length == sum(len(payload(i)) for i in range(7))
    for bookie in world.cluster.bookies[:3]:
        assert sorted(bookie.ledgers[v.ledger_id].entries) == list(range(7))
    assert _recovery_adds(world, 1) == [3, 4, 5, 6]
    assert [e.payload async for e in rh.read()] == [payload(i) for i in range(7)]


async def test_fence_lac__reply_without_a_body_contributes_minus_one(world: World) -> None:
    """b2 holds nothing of the ledger but claims ``lac`` 9 (an explicit WRITE_LAC it kept): its
    fence reply has no body, so it contributes -1; b0's verified LAC is 1 (b1 answers late: b0 and
    b2 are the covering replies). Close at 3."""
    v = await world.ledger(
        [(0, [0, 1, 2])], 3, 2, {0: range(4), 1: range(4), 2: []}, in_flight_from=2, lacs={2: 9}
    )
    world.cluster.bookies[1].script = _late_fence_answer
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 3
    assert _recovery_adds(world, 2) == [2, 3]
    assert sorted(world.cluster.bookies[2].ledgers[v.ledger_id].entries) == [2, 3]


async def test_fence_lac__a_corrupt_last_entry_still_proves_the_fence(world: World) -> None:
    """E=Qw=3 Qa=2 needs 2 proven fences. b0 returns its last entry failing the digest and b1 is
    down. b0's EOK still proves its fence (the body has nothing to do with it; it contributes no
    LAC), so b0 and b2 cover; entry 4 is unknown on b0 and b1, present on b2: close at 4."""
    v = await world.ledger([(0, [0, 1, 2])], 3, 2, {i: range(5) for i in range(3)}, in_flight_from=3)
    b0, b1, b2 = world.cluster.bookies[:3]
    b0.corrupt_reads.add((v.ledger_id, 4))
    await b1.kill()
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 4
    assert b0.ledgers[v.ledger_id].fenced
    assert b2.ledgers[v.ledger_id].fenced
    assert [e.payload async for e in rh.read()] == [payload(i) for i in range(5)]


def _fence_reads(bookie: FakeBookie) -> list[m.ReadEntryRequest]:
    reads = [r for r in bookie.requests if isinstance(r, m.ReadEntryRequest)]
    return [r for r in reads if r.flags & ReadFlag.FENCE_LEDGER]


async def test_fence_lac__two_unreadable_last_entries_fence_and_close_at_the_good_copy(world: World) -> None:
    """E=Qw=3 Qa=2: entry 4 fails the record check on b0 and b1 (their last entry). Their fence
    answers are EOK + ``unreadable`` (no body): they count, so the ledger is fenced even with b2
    answering late (before, two such bookies left it unfenceable forever). Entry 4 is unknown on
    b0 and b1, never absent: it is read from b2 and recovery closes at 4, written back."""
    v = await world.ledger([(0, [0, 1, 2])], 3, 2, {i: range(5) for i in range(3)}, in_flight_from=3)
    b0, b1, b2 = world.cluster.bookies[:3]
    b0.unreadable_reads.add((v.ledger_id, 4))
    b1.unreadable_reads.add((v.ledger_id, 4))
    b2.script = _late_fence_answer
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 4
    assert rh.metadata.state is LedgerState.CLOSED
    assert all(bookie.ledgers[v.ledger_id].fenced for bookie in (b0, b1, b2))
    assert [r.entry_id for r in _fence_reads(b0) if r.entry_id >= 0][:1] == [0]  # read from the floor
    assert 4 in _recovery_adds(world, 0)
    assert 4 in _recovery_adds(world, 1)
    assert [e.payload async for e in rh.read()] == [payload(i) for i in range(5)]


@pytest.mark.parametrize("down", [False, True], ids=["all-three-unreadable", "third-down"])
async def test_fence_lac__no_good_copy_of_the_last_entry_fails_never_closes_short(
    world: World, down: bool
) -> None:
    """Entry 4 (acknowledged: b0 and b1 have it) is unreadable on b0 and b1, and b2 either cannot
    read it either or is down. Fencing succeeds, but entry 4 has no good copy anywhere reachable:
    the open fails with an error naming it, the ledger stays IN_RECOVERY (never CLOSED at 3)."""
    v = await world.ledger([(0, [0, 1, 2])], 3, 2, {i: range(5) for i in range(3)}, in_flight_from=3)
    b0, b1, b2 = world.cluster.bookies[:3]
    for bookie in (b0, b1) if down else (b0, b1, b2):
        bookie.unreadable_reads.add((v.ledger_id, 4))
    if down:
        await b2.kill()
    with pytest.raises(LedgerRecoveryError, match=r"entry 4: .*could not give an intact copy"):
        await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert (await world.ledgers.read(v.ledger_id)).metadata.state is LedgerState.IN_RECOVERY
    assert b0.ledgers[v.ledger_id].fenced
    assert b1.ledgers[v.ledger_id].fenced
