"""Scripted recovery traces, each an executable step-by-step test (as BookKeeper's LedgerRecovery2Test).

Each test builds the exact bookie state of a trace, scripts which message is lost or late, runs
recovery, and checks the protocol's promise: every entry the writer saw acked is <= the closed
last entry, and the entries up to it are readable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeGuard

import pytest

from bookkeeper_aio import ClientConfig, LedgerFenced, LedgerRecoveryError
from bookkeeper_aio.client import recovery
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, ReadFlag, StatusCode
from metadata.ledger_metadata import LedgerState
from tests.harness.fake_bookie import Reply
from tests.unit.recovery.conftest import FAST, PASSWORD, World, payload

PATIENT_WRITER = ClientConfig(
    add_timeout_s=30.0, read_timeout_s=1.0, connect_timeout_s=1.0, explicit_lac_interval_ms=0
)


def _is_fence(req: m.Request) -> TypeGuard[m.ReadEntryRequest]:
    return isinstance(req, m.ReadEntryRequest) and bool(req.flags & ReadFlag.FENCE_LEDGER)


def _is_writer_add(req: m.Request) -> bool:
    return isinstance(req, m.AddEntryRequest) and not req.flags & AddFlag.RECOVERY_ADD


async def _wait_for(predicate: Callable[[], bool], timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


async def _run_2614(world: World) -> tuple[asyncio.Future[int], int]:
    """BOOKKEEPER-2614. E=3 Qw=3 Qa=2, writer w1, bookies A B C.

    1. w1 sends e0 to A, B, C. A stores and acks it; the add to B is lost; the add to C is late.
    2. w2 marks IN_RECOVERY and fences: the fence to C is lost; A and B answer (EC = 2 reached).
    3. w2 reads e0 from A, B, C. B and C say NoSuchEntry before A's positive answer arrives:
       QC = 2 negatives -> e0 is absent -> w2 closes the ledger at -1.
    4. The late add of e0 reaches C. If C was not fenced by the recovery read it acks, w1 now
       has Qa = 2 acks and confirms e0 to its client: an acked entry beyond the closed end.
    """
    w1 = world.client(PATIENT_WRITER)
    lh = await w1.create_ledger(3, 3, 2, password=PASSWORD)
    a, b, c = (world.cluster.by_id(bookie_id) for bookie_id in lh.metadata.current_ensemble)
    late_add = asyncio.Event()
    b.script = lambda req: Reply.drop() if _is_writer_add(req) else None
    c.script = lambda req: (
        Reply.hold(late_add)
        if _is_writer_add(req)
        else Reply.drop()
        if _is_fence(req) and req.entry_id == -1
        else None
    )
    a.script = lambda req: (
        Reply.delay(0.3) if isinstance(req, m.ReadEntryRequest) and req.entry_id >= 0 else None
    )

    add = await lh.append_async(payload(0))
    await _wait_for(lambda: a.entry(lh.id, 0) is not None)

    rh = await world.client(seed=8).open_ledger(lh.id, password=PASSWORD, recovery=True)
    assert rh.metadata.state is LedgerState.CLOSED
    late_add.set()  # step 4
    await _wait_for(lambda: add.done())
    return add, rh.last_add_confirmed


async def test_recovery__2614_fence_lost_and_late_add_is_not_acked(world: World) -> None:
    add, last = await _run_2614(world)
    assert last == -1  # e0 was decided absent (both outcomes would be correct, this one is scripted)
    with pytest.raises(LedgerFenced):
        add.result()  # C was fenced by the recovery read: EFENCED, the writer never acks e0


async def test_recovery__2614_trace_loses_an_acked_entry_without_fenced_recovery_reads(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same trace with the fence flag removed from recovery reads: proves the trace is real."""
    monkeypatch.setattr(recovery, "RECOVERY_READ_FLAGS", 0)
    add, last = await _run_2614(world)
    assert add.result() == 0
    assert last == -1  # acked entry 0 lies beyond the closed end: the data loss #2614 describes


async def test_recovery__2615_current_fragment_says_lac_minus_one(world: World) -> None:
    """BOOKKEEPER-2615. Fragments 0:{b0,b1} and 5:{b2,b3}, Qw=Qa=2. Entries 0..4 acked in the first
    fragment; the writer died right after the ensemble change, so b2 and b3 hold nothing (LAC -1).
    Recovery must start at 4 (first entry of the last fragment - 1), never read, fence or rewrite
    the first fragment, and close at 4."""
    v = await world.ledger([(0, [0, 1]), (5, [2, 3])], 2, 2, {0: range(5), 1: range(5)})
    old = world.cluster.bookies[:2]
    before = {id(b): len(b.requests) for b in old}
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 4
    assert rh.length == sum(len(payload(i)) for i in range(5))
    assert rh.metadata.ensembles == v.metadata.ensembles
    for bookie in old:
        during = bookie.requests[before[id(bookie)] :]
        assert not [r for r in during if _is_fence(r) or isinstance(r, m.AddEntryRequest)]
        # Only one plain read, of entry 4, for the ledger length.
        assert [(r.entry_id, r.flags) for r in during if isinstance(r, m.ReadEntryRequest)] in ([(4, 0)], [])
    for bookie in world.cluster.bookies[2:4]:
        reads = [r.entry_id for r in bookie.requests if isinstance(r, m.ReadEntryRequest) and r.entry_id >= 0]
        assert min(reads) == 5
    assert [e.payload async for e in rh.read()] == [payload(i) for i in range(5)]


async def test_recovery__2615_ensemble_change_during_write_back_starts_in_last_fragment(world: World) -> None:
    """The #2615 failure mode itself: a write-back bookie fails, the replacement fragment must start
    at the first entry being written back (5), never at 0."""
    v = await world.ledger(
        [(0, [0, 1]), (5, [2, 3])], 2, 2, {0: range(5), 1: range(5), 2: [5]}, in_flight_from=5
    )
    failing = world.cluster.bookies[3]

    def script(req: m.Request) -> Reply | None:
        if isinstance(req, m.AddEntryRequest):
            return Reply.error(StatusCode.EIO)
        if isinstance(req, m.ReadEntryRequest) and req.entry_id >= 0:
            return Reply.delay(0.2)  # b2's positive for e5 decides first (QC = 1 here)
        return None

    failing.script = script
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 5
    fragments = rh.metadata.ensembles
    assert fragments[0] == v.metadata.ensembles[0]
    assert fragments[1][0] == 5
    assert failing.id not in fragments[1][1]
    assert [e.payload async for e in rh.read()] == [payload(i) for i in range(6)]
    replacement = world.cluster.by_id(next(b for b in fragments[1][1] if b != world.cluster.bookies[2].id))
    assert replacement.entry(v.ledger_id, 5) == world.cluster.bookies[2].entry(v.ledger_id, 5)


async def test_recovery__seed_004_closes_at_e0_when_only_b1_answers(world: World) -> None:
    """Seed 004 (E=Qw=Qa=2): b1 holds e0, b2 holds e0 and e1. Only b1 answers: e1 is absent on b1,
    and QC = 1, so the ledger closes at e0 (no ack quorum could have held e1)."""
    v = await world.ledger([(0, [0, 1])], 2, 2, {0: [0], 1: [0, 1]}, in_flight_from=0)
    await world.cluster.bookies[1].kill()
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 0
    assert [e.payload async for e in rh.read()] == [payload(0)]


async def test_recovery__seed_004_closes_at_e1_when_b2_answers_first(world: World) -> None:
    """Same ledger; b1's read answers are slow, b2 returns e1: e1 exists, is written back to b1, and
    the ledger closes at e1. Also correct: e1 is now on Qa bookies."""
    v = await world.ledger([(0, [0, 1])], 2, 2, {0: [0], 1: [0, 1]}, in_flight_from=0)
    b1 = world.cluster.bookies[0]
    b1.script = lambda req: Reply.delay(0.3) if _is_fence(req) and req.entry_id >= 0 else None
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 1
    assert b1.entry(v.ledger_id, 1) == world.cluster.bookies[1].entry(v.ledger_id, 1)
    assert [e.payload async for e in rh.read()] == [payload(0), payload(1)]


async def test_recovery__gap_at_the_tail_ends_the_ledger_before_it(world: World) -> None:
    """Entries 0..5 everywhere, 6 nowhere, 7 on one bookie (sent before 6 was acked): close at 5;
    entry 7 is ignored, not rewritten anywhere."""
    v = await world.ledger(
        [(0, [0, 1, 2])], 3, 2, {0: [*range(6), 7], 1: range(6), 2: range(6)}, in_flight_from=4
    )
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 5
    for bookie in world.cluster.bookies[1:3]:
        assert 7 not in bookie.ledgers[v.ledger_id].entries
        assert not [r for r in bookie.requests if isinstance(r, m.AddEntryRequest) and r.entry_id > 5]


async def test_recovery__corrupt_replica_is_unknown_not_missing(world: World) -> None:
    """E=Qw=3 Qa=2. Entry 3 is on bookie 0 only and that copy reads corrupt; bookie 1 says
    NoSuchEntry; bookie 2 answers EUNKNOWNLEDGERSTATE. Counting "corrupt" as missing would give
    QC = 2 negatives and truncate a possibly acked entry; it is unknown, so recovery aborts
    (retriable) and leaves the ledger IN_RECOVERY. Once bookie 2 answers, a retry closes at 3."""
    v = await world.ledger([(0, [0, 1, 2])], 3, 2, {0: range(4), 1: range(3), 2: range(3)}, in_flight_from=2)
    b0, _, b2 = world.cluster.bookies[:3]
    b0.corrupt_reads.add((v.ledger_id, 3))
    unknown = lambda req: (  # noqa: E731
        Reply.error(StatusCode.EUNKNOWNLEDGERSTATE) if _is_fence(req) and req.entry_id == 3 else None
    )
    b2.script = unknown
    bk = world.client()
    with pytest.raises(LedgerRecoveryError, match="entry 3"):
        await bk.open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert (await world.ledgers.read(v.ledger_id)).metadata.state is LedgerState.IN_RECOVERY
    # bookie 2 recovers its index and turns out to hold entry 3 after all
    b2.script = None
    b2.ledgers[v.ledger_id].entries[3] = world.body(v.ledger_id, 3, 1)
    rh = await bk.open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 3
    assert (await rh.read_entry(3)).payload == payload(3)


async def test_recovery__fence_without_coverage_aborts(world: World) -> None:
    """E=Qw=3 Qa=2 needs 2 fenced bookies; with two unreachable, recovery must not proceed."""
    v = await world.ledger([(0, [0, 1, 2])], 3, 2, {0: range(3), 1: range(3), 2: range(3)})
    await world.cluster.bookies[1].kill()
    world.cluster.bookies[2].script = lambda req: Reply.error(StatusCode.EIO) if _is_fence(req) else None
    with pytest.raises(LedgerRecoveryError, match="did not cover"):
        await world.client(FAST).open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert not [
        r for r in world.cluster.bookies[0].requests if isinstance(r, m.ReadEntryRequest) and r.entry_id >= 0
    ]
