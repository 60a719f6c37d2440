"""Recovery write-back with local ensemble changes (``recovery_writeback.WriteBack``).

The promise: when recovery closes, every entry up to the last one is on every bookie of its write
set *in the closed metadata* (or on ``Qa`` of them when the rest was given up). A replacement
fragment starts at the lowest entry not fully written, so every entry from there on — also the ones
already fully written to the old write set — must reach the replacement bookie.

End to end on fake bookies, and step by step against a stub pool whose answers the test delivers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import pytest

from bookkeeper_aio import ClientConfig, NotEnoughBookies
from bookkeeper_aio.client.context import ClientContext, StaticDirectory
from bookkeeper_aio.client.quorum import DistributionSchedule
from bookkeeper_aio.client.recovery_writeback import WriteBack
from bookkeeper_aio.errors import BKError
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, StatusCode
from metadata.ledger_metadata import LedgerMetadata
from tests.harness.fake_bookie import Reply
from tests.unit.recovery.conftest import PASSWORD, World, payload


def _is_recovery_add(req: m.Request) -> TypeGuard[m.AddEntryRequest]:
    return isinstance(req, m.AddEntryRequest) and bool(req.flags & AddFlag.RECOVERY_ADD)


def _recovery_adds(world: World, bookie_id: str) -> list[int]:
    bookie = world.cluster.by_id(bookie_id)
    return [r.entry_id for r in bookie.requests if _is_recovery_add(r)]


def _assert_fully_replicated(world: World, md: LedgerMetadata) -> None:
    """Every entry of the closed ledger is, byte-identical, on every bookie of its write set."""
    assert md.last_entry_id is not None
    for entry_id in range(md.last_entry_id + 1):
        ensemble = md.ensemble_for(entry_id)
        write_set = [ensemble[(entry_id + i) % md.ensemble_size] for i in range(md.write_quorum)]
        bodies = {world.cluster.by_id(b).entry(md.ledger_id, entry_id) for b in write_set}
        assert bodies == {world.body(md.ledger_id, entry_id, -1)}, (entry_id, write_set)


# ---------------------------------------------------------------------------------- end to end
async def test_write_back__replaced_bookie_that_acked_entries_above_the_lowest_pending_gets_them_all(
    world: World,
) -> None:
    """E=3 Qw=2 Qa=2, fragment (b0, b1, b2), entries 0..5 fully replicated but in flight (header
    LAC -1), so recovery reads and writes back all of them. b1 (position 1: entries 0, 1, 3, 4)
    acks the write-back of 1, 3 and 4 but never answers the one of 0. After the add timeout b1 is
    replaced by bX in a fragment starting at 0: bX must get 0 *and* 1, 3, 4, which were finished
    on b1 already, before recovery closes."""
    v = await world.ledger(
        [(0, [0, 1, 2])], 2, 2, {0: [0, 2, 3, 5], 1: [0, 1, 3, 4], 2: [1, 2, 4, 5]}, in_flight_from=0
    )
    b1 = world.cluster.bookies[1]
    b1.script = lambda req: Reply.drop() if _is_recovery_add(req) and req.entry_id == 0 else None
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 5
    md = rh.metadata
    assert len(md.ensembles) == 1  # the local fragment replaced the only one (both start at 0)
    assert md.ensembles[0][0] == 0
    assert b1.id not in md.ensembles[0][1]
    (bx,) = set(md.ensembles[0][1]) - set(v.metadata.ensembles[0][1])
    assert sorted(_recovery_adds(world, bx)) == [0, 1, 3, 4]
    assert sorted(_recovery_adds(world, b1.id)) == [0, 1, 3, 4]  # it did ack 1, 3, 4
    _assert_fully_replicated(world, md)
    assert [e.payload async for e in rh.read()] == [payload(i) for i in range(6)]


async def test_write_back__two_failures_in_a_row_each_replacement_gets_every_entry_above_the_mark(
    world: World,
) -> None:
    """Same ledger. b1 never answers the write-back of 0 -> replaced by bX from entry 0. bX then
    acks 0, fails 1 (EIO) and acks 3 and 4 -> replaced by bY in a fragment from the first entry not
    fully written (1 here: 0 is on b0 and bX). 3 and 4 were finished on bX and must be re-sent to
    bY as well, since the close puts them in bY's fragment."""
    v = await world.ledger(
        [(0, [0, 1, 2])], 2, 2, {0: [0, 2, 3, 5], 1: [0, 1, 3, 4], 2: [1, 2, 4, 5]}, in_flight_from=0
    )
    b1 = world.cluster.bookies[1]
    b1.script = lambda req: Reply.drop() if _is_recovery_add(req) and req.entry_id == 0 else None
    failed_once: list[str] = []

    def spare_script(bookie_id: str) -> Any:
        def script(req: m.Request) -> Reply | None:
            if _is_recovery_add(req) and req.entry_id == 1 and failed_once in ([], [bookie_id]):
                failed_once[:] = [bookie_id]  # the first spare to get entry 1 fails it
                return Reply.error(StatusCode.EIO)
            return None

        return script

    for spare in world.cluster.bookies[3:]:
        spare.script = spare_script(spare.id)
    rh = await world.client().open_ledger(v.ledger_id, password=PASSWORD, recovery=True)
    assert rh.last_add_confirmed == 5
    md = rh.metadata
    (bx,) = failed_once
    assert [first for first, _ in md.ensembles] == [0, 1]
    assert b1.id not in md.ensembles[0][1]
    assert bx in md.ensembles[0][1]  # entry 0 stays on bX, which acked it
    assert bx not in md.ensembles[1][1]
    (by,) = set(md.ensembles[1][1]) - set(md.ensembles[0][1])
    assert sorted(_recovery_adds(world, bx)) == [0, 1, 3, 4]
    assert sorted(_recovery_adds(world, by)) == [1, 3, 4]
    _assert_fully_replicated(world, md)
    assert [e.payload async for e in rh.read()] == [payload(i) for i in range(6)]


# ---------------------------------------------------------------------------------- step by step
@dataclass
class _Sent:
    bookie_id: str
    entry_id: int
    callback: Any
    context: Any


class _StubPool:
    def __init__(self) -> None:
        self.sent: list[_Sent] = []
        self._rid = 0

    def next_request_id(self) -> int:
        self._rid += 1
        return self._rid

    def reconnect_delay_s(self, bookie_id: str) -> float:
        return 0.0

    def connection(self, bookie_id: str) -> Any:
        pool = self

        class _Conn:
            def request(self, rid: int, frame: bytes, callback: Any, context: Any, timeout_s: float) -> None:
                pool.sent.append(_Sent(bookie_id, context.entry_id, callback, context))

        return _Conn()

    def take(self, bookie_id: str, entry_id: int) -> _Sent:
        (hit,) = [s for s in self.sent if (s.bookie_id, s.entry_id) == (bookie_id, entry_id)]
        self.sent.remove(hit)
        return hit

    def ack(self, bookie_id: str, entry_id: int) -> None:
        s = self.take(bookie_id, entry_id)
        s.callback(s.context, bookie_id, m.AddEntryResponse(0, StatusCode.EOK, None, 7, entry_id))

    def fail(self, bookie_id: str, entry_id: int) -> None:
        s = self.take(bookie_id, entry_id)
        s.callback(s.context, bookie_id, BKError("scripted"))

    def targets(self, entry_id: int) -> set[str]:
        return {s.bookie_id for s in self.sent if s.entry_id == entry_id}


class _StubPlacement:
    def __init__(self, replacements: dict[str, str]) -> None:
        self.replacements = replacements

    def replace_bookie(
        self, ensemble: Sequence[str], position: int, writable: Sequence[str], exclude: Collection[str] = ()
    ) -> str:
        try:
            return self.replacements[ensemble[position]]
        except KeyError:
            raise NotEnoughBookies(f"no replacement for {ensemble[position]}") from None


def _writer(ensemble: str, qw: int, qa: int, replacements: dict[str, str]) -> tuple[WriteBack, _StubPool]:
    pool = _StubPool()
    ctx = ClientContext(
        config=ClientConfig(),
        pool=cast(Any, pool),
        ledgers=cast(Any, None),  # the write-back never touches metadata
        directory=StaticDirectory(["A", "B", "C", "D", "S"]),
        placement=cast(Any, _StubPlacement(replacements)),
    )
    schedule = DistributionSchedule(len(ensemble), qw, qa)
    return WriteBack(ctx, 7, schedule, tuple(ensemble), b"key", -1), pool


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_write_back__finished_entry_is_held_and_reopened_when_its_write_set_changes() -> None:
    """The review's trace at unit level: E=3 Qw=Qa=2 (A, B, C). e1 finishes (B, C) while e0 waits
    for B; B fails e0 and is replaced by S from entry 0. e1 was held (e0 below it unfinished), is
    unfinished again with write set (S, C), and goes to S; recovery is not done until S acks."""
    writer, pool = _writer("ABC", 2, 2, {"B": "S"})
    writer.add(0, b"e0")
    writer.add(1, b"e1")
    pool.ack("A", 0)
    pool.ack("B", 1)
    pool.ack("C", 1)
    assert writer.written_through == -1
    assert writer.outstanding == 2  # e1 is finished but its body is held
    pool.fail("B", 0)
    await _settle()
    assert writer.fragments == [(0, ("A", "S", "C"))]
    assert pool.targets(0) == {"S"}
    assert pool.targets(1) == {"S"}
    drained = asyncio.ensure_future(writer.drain())
    pool.ack("S", 0)
    await _settle()
    assert writer.written_through == 0
    assert not drained.done()
    pool.ack("S", 1)
    await asyncio.wait_for(drained, 1)
    assert writer.written_through == 1
    assert writer.outstanding == 0


async def test_write_back__entries_at_or_below_the_mark_stay_in_the_old_fragment() -> None:
    """Entries finished with every lower entry finished are released and never re-sent: the new
    fragment starts right after them, even when the replaced bookie stores some of them."""
    writer, pool = _writer("ABC", 2, 2, {"A": "S"})
    for entry_id in range(3):
        writer.add(entry_id, b"e%d" % entry_id)
    for bookie_id, entry_id in [("A", 0), ("B", 0), ("B", 1), ("C", 1), ("C", 2)]:
        pool.ack(bookie_id, entry_id)
    assert writer.written_through == 1
    assert writer.outstanding == 1
    pool.fail("A", 2)
    await _settle()
    assert writer.fragments == [(2, ("S", "B", "C"))]
    assert pool.targets(0) == set()  # e0 is on (A, B) in the old fragment, where it stays
    assert pool.targets(2) == {"S"}
    pool.ack("S", 2)
    await asyncio.wait_for(writer.drain(), 1)
    assert writer.written_through == 2


async def test_write_back__replacement_and_give_up_in_one_change_reopen_before_finishing() -> None:
    """E=4 Qw=2 Qa=1 (A, B, C, D): e0 -> (A, B), e1 -> (B, C), e2 -> (C, D). e1 finishes on B and
    C; e0 waits for B (A acked); C fails e2 and B fails e0 together. B is given up (which finishes
    e0: A acked, Qa = 1), C is replaced by S from entry 0. e1's write set becomes (B, S): it must be
    reopened *before* e0's finishing moves the mark past it, or it would be released without S."""
    writer, pool = _writer("ABCD", 2, 1, {"C": "S"})
    for entry_id in range(3):
        writer.add(entry_id, b"e%d" % entry_id)
    pool.ack("A", 0)
    pool.ack("B", 1)
    pool.ack("C", 1)
    pool.ack("D", 2)
    assert writer.written_through == -1
    pool.fail("C", 2)
    pool.fail("B", 0)
    await _settle()
    assert writer.fragments == [(0, ("A", "B", "S", "D"))]
    assert writer.written_through == 0  # e0 finished (B given up), e1 reopened
    assert pool.targets(1) == {"S"}
    assert pool.targets(2) == {"S"}
    pool.ack("S", 1)
    pool.ack("S", 2)
    await asyncio.wait_for(writer.drain(), 1)
    assert writer.written_through == 2


async def test_write_back__fewer_than_qa_bookies_left_is_an_error() -> None:
    writer, pool = _writer("ABC", 2, 2, {})
    writer.add(0, b"e0")
    pool.ack("A", 0)
    pool.fail("B", 0)
    await _settle()
    with pytest.raises(NotEnoughBookies):
        await asyncio.wait_for(writer.drain(), 1)
    writer.abort()
