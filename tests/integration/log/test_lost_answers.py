"""A log writer's roll or open whose caller is cancelled half way, or whose CAS answer is lost after
the list moved on: the roll still closes the ledger before the one it listed (readers would stop at
it for good), and no ledger is orphaned (a spare taken out of the list, a ledger the CAS never
listed). The faults are injected at a step boundary (a wrapper around the step: a held drain, a
`LogManager` whose answer is lost). Real bookies, real etcd."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper, open_log_reader, open_log_writer
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.log.position import LogPosition
from bookkeeper_aio.log.truncation import truncate_log
from bookkeeper_aio.log.writer import LogWriter
from metadata.errors import CasResultUnknown
from metadata.ledger_metadata import LedgerState
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogLedgerState, LogMetadata
from tests.integration.log.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd

QUORUM: dict[str, Any] = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}
ROLL = 20
"""Roll limit of the spare tests: half of it makes the spare, no test appends the other half."""


async def _list(cluster: Cluster, name: str) -> LogMetadata:
    return (await LogManager(cluster.meta.store, cluster.root).read(name)).metadata


async def _payloads(bk: BookKeeper, name: str) -> list[bytes]:
    reader = await open_log_reader(bk, name, password=b"pw")
    return [record.payload async for record in reader]


def _hold_drain(monkeypatch: pytest.MonkeyPatch, ledger_id: int) -> tuple[asyncio.Event, asyncio.Event]:
    """Holds a roll's switch at the drain of ledger ``ledger_id`` (the old one): (entered, release)."""
    entered, release = asyncio.Event(), asyncio.Event()
    drain = LedgerHandle.wait_for_adds

    async def held(handle: LedgerHandle) -> None:
        if handle.id == ledger_id:
            entered.set()
            await release.wait()
        await drain(handle)

    monkeypatch.setattr(LedgerHandle, "wait_for_adds", held)
    return entered, release


async def _closed_in_list(cluster: Cluster, name: str, ledger_id: int) -> bool:
    """Waits (up to 10 s) until the list marks ``ledger_id`` CLOSED."""
    for _ in range(1000):
        md = await _list(cluster, name)
        index = md.index_of(ledger_id)
        if index is not None and md.ledgers[index].state is LogLedgerState.CLOSED:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_roll_cancelled_during_its_switch_still_closes_the_old_ledger(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "cancel-roll", **QUORUM)
    await writer.append(b"a0")
    old = writer.ledger_id
    entered, release = _hold_drain(monkeypatch, old)
    roll = asyncio.create_task(writer.roll())
    await asyncio.wait_for(entered.wait(), 10)  # listed, switching: as `wait_for(roll(), t)` times out
    roll.cancel()
    with pytest.raises(asyncio.CancelledError):
        await roll
    release.set()
    positions = [await writer.append(f"b{i}".encode()) for i in range(3)]
    assert all(p is not None and p.ledger_id != old for p in positions)  # the switch happened
    assert await _closed_in_list(cluster, "cancel-roll", old)  # while the writer lives
    assert (await bk.context.ledgers.read(old)).metadata.state is LedgerState.CLOSED
    # a reader passes the old ledger (the last append is beyond the new one's LAC until the close)
    assert (await _payloads(bk, "cancel-roll"))[:3] == [b"a0", b"b0", b"b1"]
    await writer.close()
    assert await _payloads(bk, "cancel-roll") == [b"a0", b"b0", b"b1", b"b2"]
    assert all(e.state is LogLedgerState.CLOSED for e in (await _list(cluster, "cancel-roll")).ledgers)


async def test_a_cancelled_close_during_an_automatic_roll_leaves_the_roll_to_finish(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "cancel-close", roll_entries_max=4, **QUORUM)
    old = writer.ledger_id
    entered, release = _hold_drain(monkeypatch, old)
    for i in range(4):
        await writer.append(f"a{i}".encode())  # the fourth starts the automatic roll
    await asyncio.wait_for(entered.wait(), 10)
    closing = asyncio.create_task(writer.close())
    for _ in range(3):
        await asyncio.sleep(0)  # close() now waits for the roll
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    release.set()
    await writer.close()  # again: it waits for the roll, then closes the new ledger
    md = await _list(cluster, "cancel-close")
    assert len(md.ledger_ids) == 2
    assert md.ledger_ids[0] == old
    assert all(e.state is LogLedgerState.CLOSED for e in md.ledgers)
    assert (await bk.context.ledgers.read(old)).metadata.state is LedgerState.CLOSED
    assert await _payloads(bk, "cancel-close") == [f"a{i}".encode() for i in range(4)]


class _LostAnswer(LogManager):
    """Loses the answer of the first CAS ``armed`` accepts, after someone else's change (a cursor
    commit, an importer's mark) landed: before that CAS (``applied=False``: it then conflicts) or
    after it (``applied=True``)."""

    def __init__(self, cluster: Cluster, *, applied: bool) -> None:
        super().__init__(cluster.meta.store, cluster.root)
        self.applied = applied
        self.armed: Any = None  # a predicate of the proposed list
        self.lost: list[LogMetadata] = []

    async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
        if self.armed is None or not self.armed(metadata):
            return await super().write(metadata, expected_version)
        self.armed = None
        self.lost.append(metadata)
        if self.applied:
            written = await super().write(metadata, expected_version)
            await super().write(written.metadata.with_commit("other", 1), written.version)
        else:
            current = await self.read(metadata.name)
            await super().write(current.metadata.with_commit("other", 1), current.version)
        raise CasResultUnknown(self.keys.log(metadata.name), "deadline exceeded")


async def _writer_with_spare(bk: BookKeeper, cluster: Cluster, name: str) -> tuple[LogWriter, int]:
    writer = await open_log_writer(bk, name, roll_entries_max=ROLL, **QUORUM)
    for i in range(ROLL // 2):
        await writer.append(f"a{i}".encode())
    for _ in range(1000):
        spare = (await _list(cluster, name)).spare
        if spare is not None:
            return writer, spare
        await asyncio.sleep(0.01)
    raise AssertionError(f"log {name!r}: no spare recorded")


@pytest.mark.parametrize("applied", [True, False])
async def test_an_open_whose_cas_answer_is_lost_deletes_what_left_the_list(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch, applied: bool
) -> None:
    """Applied: the previous writer's spare, which the CAS dropped from the list, is deleted and the
    open succeeds. Not applied: the new ledger is deleted and the open starts over."""
    await cluster.start(3)
    name = f"open-lost-{applied}"
    _, spare = await _writer_with_spare(bk, cluster, name)  # then A's process dies
    manager = _LostAnswer(cluster, applied=applied)
    manager.armed = lambda md: md.spare is None
    monkeypatch.setattr("bookkeeper_aio.log.writer.log_manager", lambda _bk: manager)
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk_b:
        writer_b = await open_log_writer(bk_b, name, **QUORUM)
        assert len(manager.lost) == 1  # the answer was lost
        lost_ledger = manager.lost[0].ledger_ids[-1]
        md = await _list(cluster, name)
        assert md.spare is None
        assert md.ledger_ids[-1] == writer_b.ledger_id
        assert (writer_b.ledger_id == lost_ledger) is applied
        assert not await bk.context.ledgers.exists(spare)  # A's spare: not orphaned
        if not applied:
            assert not await bk.context.ledgers.exists(lost_ledger)  # the unlisted one: not orphaned
        await writer_b.append(b"b")
        await writer_b.close()
    assert await _payloads(bk, name) == [*(f"a{i}".encode() for i in range(ROLL // 2)), b"b"]


async def test_a_roll_whose_lost_cas_did_not_apply_keeps_the_spare_for_the_next_roll(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.start(3)
    manager = _LostAnswer(cluster, applied=False)
    monkeypatch.setattr("bookkeeper_aio.log.writer.log_manager", lambda _bk: manager)
    writer, spare = await _writer_with_spare(bk, cluster, "roll-lost")
    first = writer.ledger_id
    manager.armed = lambda md: md.ledger_ids == (first, spare)
    with pytest.raises(CasResultUnknown):
        await writer.roll()
    md = await _list(cluster, "roll-lost")
    assert md.ledger_ids == (first,)
    assert md.spare == spare  # still recorded, still there, still this writer's
    assert await bk.context.ledgers.exists(spare)
    assert writer.ledger_id == first
    await writer.append(b"still on the first")
    assert await writer.roll() == spare  # the next roll lists it: no second spare over it
    await writer.append(b"on the spare")
    await writer.close()
    md = await _list(cluster, "roll-lost")
    assert md.ledger_ids == (first, spare)
    assert md.spare is None
    assert all(e.state is LogLedgerState.CLOSED for e in md.ledgers)
    payloads = await _payloads(bk, "roll-lost")
    assert payloads[-2:] == [b"still on the first", b"on the spare"]


async def test_a_roll_whose_lost_cas_applied_switches_to_the_listed_ledger(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not taken for a takeover: the writer goes on with the ledger its CAS listed."""
    await cluster.start(3)
    manager = _LostAnswer(cluster, applied=True)
    monkeypatch.setattr("bookkeeper_aio.log.writer.log_manager", lambda _bk: manager)
    writer, spare = await _writer_with_spare(bk, cluster, "roll-applied")
    first = writer.ledger_id
    manager.armed = lambda md: md.ledger_ids == (first, spare)
    assert await writer.roll() == spare
    assert manager.lost  # the answer was lost
    assert writer.ledger_id == spare
    await writer.append(b"on the spare")
    await writer.close()  # no LogFenced: nobody took over
    md = await _list(cluster, "roll-applied")
    assert md.ledger_ids == (first, spare)
    assert md.commits == {"other": 1}  # the other change stays
    assert all(e.state is LogLedgerState.CLOSED for e in md.ledgers)
    assert (await _payloads(bk, "roll-applied"))[-1] == b"on the spare"


async def test_a_close_whose_lost_cas_applied_is_not_taken_for_a_takeover(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The close's mark landed, its answer was lost: the close raises `CasResultUnknown`; called
    again, it finds its own mark in the list and completes (no `LogFenced`: nobody took over)."""
    await cluster.start(3)
    manager = _LostAnswer(cluster, applied=True)
    monkeypatch.setattr("bookkeeper_aio.log.writer.log_manager", lambda _bk: manager)
    writer = await open_log_writer(bk, "close-lost", **QUORUM)
    await writer.append(b"a")
    manager.armed = lambda md: md.ledgers[-1].state is LogLedgerState.CLOSED
    with pytest.raises(CasResultUnknown):
        await writer.close()
    await writer.close()
    md = await _list(cluster, "close-lost")
    assert md.ledger_ids == (writer.ledger_id,)
    assert md.ledgers[0].state is LogLedgerState.CLOSED
    assert md.commits == {"other": 1}
    assert await _payloads(bk, "close-lost") == [b"a"]


async def _log_of_three_ledgers(bk: BookKeeper, name: str) -> tuple[LogWriter, list[int]]:
    writer = await open_log_writer(bk, name, **QUORUM)
    ids = []
    for i in range(3):
        await writer.append(f"r{i}".encode())
        ids.append(writer.ledger_id)
        if i < 2:
            await writer.roll()
    return writer, ids


@pytest.mark.parametrize("applied", [True, False])
@pytest.mark.parametrize("by", ["truncate_log", "writer"])
async def test_a_truncation_whose_cas_answer_is_lost_orphans_no_ledger(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch, applied: bool, by: str
) -> None:
    """Applied: the ledgers the lost CAS dropped are deleted all the same (a retry would find them
    gone from the list and delete nothing). Not applied: the error is raised, nothing is deleted,
    and a retry cuts and deletes them."""
    await cluster.start(3)
    name = f"trunc-lost-{by}-{applied}"
    manager = _LostAnswer(cluster, applied=applied)
    monkeypatch.setattr("bookkeeper_aio.log.writer.log_manager", lambda _bk: manager)
    monkeypatch.setattr("bookkeeper_aio.log.truncation.log_manager", lambda _bk: manager)
    writer, ids = await _log_of_three_ledgers(bk, name)
    manager.armed = lambda md: md.truncated_before == ids[2]

    async def truncate() -> LogPosition | None:
        if by == "writer":
            return await writer.truncate_before(LogPosition(ids[2], 0))
        return await truncate_log(bk, name, LogPosition(ids[2], 0), password=b"pw")

    if applied:
        assert await truncate() == LogPosition(ids[2], 0)
    else:
        with pytest.raises(CasResultUnknown):
            await truncate()
        assert (await _list(cluster, name)).ledger_ids == tuple(ids)
        assert all([await bk.context.ledgers.exists(i) for i in ids])  # nothing deleted for a cut not in
        assert await truncate() == LogPosition(ids[2], 0)  # the retry
    assert manager.lost  # the answer was lost
    md = await _list(cluster, name)
    assert md.ledger_ids == (ids[2],)
    assert md.commits == {"other": 1}
    for dropped in ids[:2]:
        assert not await bk.context.ledgers.exists(dropped), f"ledger {dropped} orphaned"
    await writer.append(b"after")
    await writer.close()
    assert (await _payloads(bk, name)) == [b"r2", b"after"]
