"""A list CAS whose answer is lost while the list still shows the version it expected may yet be
applied (an etcd txn that timed out can commit after a later read): a roll or an open settles it by
sending the CAS again at that version before it decides, and never deletes a ledger the late CAS
could still list. The late request is held by a `LogManager` wrapper and lands the moment the
ledger it lists is deleted (the worst time), or at the end, where it must find the list moved on.
A truncation whose answer is lost with the list unreadable for a while settles it the same way,
and deletes the ledgers it dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper, LogPosition, open_log_reader, open_log_writer, truncate_log
from bookkeeper_aio.log import _common as common_module
from bookkeeper_aio.log import truncation as truncation_module
from bookkeeper_aio.log import writer as writer_module
from metadata import MemoryStore
from metadata.errors import BadVersion, CasResultUnknown, MetadataUnavailable
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogMetadata
from tests.unit.client.conftest import ROOT
from tests.unit.log.fakes import world


class _LandsLate(LogManager):
    """The write ``armed`` picks is not applied and its answer is lost; then ``unreadable`` reads
    fail (so `cas_log` cannot tell). `land` applies that request later, at the version it expected."""

    def __init__(self, store: MemoryStore, unreadable: int) -> None:
        super().__init__(store, ROOT)
        self.armed: Callable[[LogMetadata], bool] | None = None
        self.held: tuple[LogMetadata, int] | None = None
        self.unreadable_after = unreadable
        self.unreadable = 0

    async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
        if self.armed is not None and self.armed(metadata):
            self.armed = None
            self.held = (metadata, expected_version)
            self.unreadable = self.unreadable_after
            raise CasResultUnknown(self.keys.log(metadata.name), "deadline exceeded")
        return await super().write(metadata, expected_version)

    async def read(self, name: str) -> VersionedLog:
        if self.unreadable:
            self.unreadable -= 1
            raise MetadataUnavailable("etcd blip")
        return await super().read(name)

    def held_ledger(self) -> int | None:
        return None if self.held is None else self.held[0].ledger_ids[-1]

    async def land(self) -> bool:
        """The held request reaches the store now: whether it applied (False: shut out)."""
        assert self.held is not None
        (metadata, version), self.held = self.held, None
        try:
            await super().write(metadata, version)
        except BadVersion:
            return False
        return True


def _land_on_delete(monkeypatch: pytest.MonkeyPatch, bk: BookKeeper, manager: _LandsLate) -> list[int]:
    """The held request lands just after the ledger it lists is deleted; returns what was landed."""
    landed: list[int] = []
    delete = bk.delete_ledger

    async def delete_then_land(ledger_id: int, **kwargs: Any) -> None:
        await delete(ledger_id, **kwargs)
        if ledger_id == manager.held_ledger() and await manager.land():
            landed.append(ledger_id)

    monkeypatch.setattr(bk, "delete_ledger", delete_then_land)
    return landed


async def _every_listed_ledger_exists(bk: BookKeeper, name: str) -> tuple[int, ...]:
    ids = (await LogManager(bk.context.ledgers.store, ROOT).read(name)).metadata.ledger_ids
    for ledger_id in ids:
        assert await bk.context.ledgers.exists(ledger_id), f"listed ledger {ledger_id} was deleted"
    return ids


@pytest.mark.parametrize("settled", ["in the roll", "by the next roll"])
async def test_a_roll_never_deletes_a_ledger_its_lost_cas_may_still_list(
    monkeypatch: pytest.MonkeyPatch, settled: str
) -> None:
    """In the roll: the list reads back at the expected version at once. By the next roll: it
    stays unreadable past the roll's settling tries, and the next roll settles it first."""
    monkeypatch.setattr(common_module, "SETTLE_RETRY_S", 0.001)
    monkeypatch.setattr(writer_module, "ROLL_RETRY_S", 3600.0)  # no background repair
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        first = writer.ledger_id
        unreadable = 1 if settled == "in the roll" else 1 + common_module.SETTLE_ATTEMPTS_MAX
        manager = _LandsLate(w.store, unreadable)
        landed = _land_on_delete(monkeypatch, bk, manager)
        writer._manager = manager
        manager.armed = lambda md: len(md.ledgers) == 2
        if settled == "in the roll":
            rolled = await writer.roll()  # the CAS sent again at its version applied
        else:
            with pytest.raises(CasResultUnknown):
                await writer.roll()
            assert manager.held is not None
            assert writer.ledger_id == first  # appends stay on the old ledger until it is settled
            await writer.append(b"b")
            third = await writer.roll()  # settles the lost one first: listed, then a third ledger
            rolled = (await _every_listed_ledger_exists(bk, "lg"))[1]
            assert rolled < third
        assert not landed
        assert not await manager.land()  # the late request is shut out
        ids = await _every_listed_ledger_exists(bk, "lg")
        assert ids[:2] == (first, rolled)
        await writer.append(b"c")
        await writer.close()
        taker = await open_log_writer(other, "lg")  # the log stays openable
        await taker.append(b"d")
        await taker.close()
        expected = [b"a", b"c", b"d"] if settled == "in the roll" else [b"a", b"b", b"c", b"d"]
        assert [r.payload async for r in await open_log_reader(other, "lg")] == expected


async def test_an_open_never_deletes_a_ledger_its_lost_cas_may_still_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with world() as w:
        bk, other = w.clients
        previous = await open_log_writer(other, "lg")  # its process then dies
        await previous.append(b"a")
        manager = _LandsLate(w.store, unreadable=1)
        manager.armed = lambda md: len(md.ledgers) == 2
        landed = _land_on_delete(monkeypatch, bk, manager)
        monkeypatch.setattr(writer_module, "log_manager", lambda client: manager)
        writer = await open_log_writer(bk, "lg")
        assert not landed
        assert not await manager.land()
        assert await _every_listed_ledger_exists(bk, "lg") == (previous.ledger_id, writer.ledger_id)
        await writer.append(b"b")
        await writer.close()
        taker = await open_log_writer(other, "lg")
        await taker.close()
        assert [r.payload async for r in await open_log_reader(other, "lg")] == [b"a", b"b"]


class _AnswerLostListUnreadable(LogManager):
    """The write ``armed`` picks is applied (or not) and its answer lost; then ``unreadable`` reads
    fail: `cas_log`'s read-back and the first of the settling ones."""

    def __init__(self, store: MemoryStore, *, applied: bool, unreadable: int = 3) -> None:
        super().__init__(store, ROOT)
        self.applied = applied
        self.unreadable_after = unreadable
        self.unreadable = 0
        self.armed: Callable[[LogMetadata], bool] | None = None

    async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
        if self.armed is None or not self.armed(metadata):
            return await super().write(metadata, expected_version)
        self.armed = None
        if self.applied:
            await super().write(metadata, expected_version)
        self.unreadable = self.unreadable_after
        raise CasResultUnknown(self.keys.log(metadata.name), "deadline exceeded")

    async def read(self, name: str) -> VersionedLog:
        if self.unreadable:
            self.unreadable -= 1
            raise MetadataUnavailable("etcd blip")
        return await super().read(name)


@pytest.mark.parametrize("applied", [True, False])
@pytest.mark.parametrize("by", ["truncate_log", "writer"])
async def test_a_truncation_whose_answer_and_settling_read_are_lost_deletes_what_it_dropped(
    monkeypatch: pytest.MonkeyPatch, by: str, applied: bool
) -> None:
    """The settling reads are tried again (with backoff) until the list tells: the cut is in (the
    lost CAS applied, or its second sending at the same version did) and the dropped ledgers are
    deleted, not left as orphans that a retry (planning from the list as it is then) never finds."""
    monkeypatch.setattr(common_module, "SETTLE_RETRY_S", 0.001)
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg", password=b"pw")
        ids = [writer.ledger_id]
        for i in range(2):
            await writer.append(b"r%d" % i)
            ids.append(await writer.roll())
        await writer.append(b"r2")
        manager = _AnswerLostListUnreadable(w.store, applied=applied)
        manager.armed = lambda md: md.truncated_before == ids[2]
        monkeypatch.setattr(truncation_module, "log_manager", lambda client: manager)
        writer._manager = manager
        if by == "writer":
            first = await writer.truncate_before(LogPosition(ids[2], 0))
        else:
            first = await truncate_log(bk, "lg", LogPosition(ids[2], 0), password=b"pw")
        assert manager.armed is None  # the answer was lost
        assert first == LogPosition(ids[2], 0)
        assert await _every_listed_ledger_exists(bk, "lg") == (ids[2],)
        for dropped in ids[:2]:
            assert not await bk.context.ledgers.exists(dropped), f"ledger {dropped} orphaned"
        await writer.append(b"after")
        await writer.close()
        got = [r.payload async for r in await open_log_reader(other, "lg", password=b"pw")]
        assert got == [b"r2", b"after"]


async def test_an_import_whose_lost_cas_cannot_be_settled_raises_it_and_its_ledgers_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An import's CAS answer lost and the list unreadable past the settling budget: the import
    raises the lost CAS (its outcome unknown), never a plain unavailability that tells its caller
    (Spark's commit) to delete the ledgers; the late CAS then lists them, and they exist."""
    from bookkeeper_aio import append_ledgers
    from bookkeeper_aio.log import admin as admin_module

    monkeypatch.setattr(common_module, "SETTLE_RETRY_S", 0.001)
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        await writer.close()
        handle = await bk.create_ledger(3, 2, 2, after_ledger_id=writer.ledger_id)
        await handle.append(b"imported")
        await handle.close()
        manager = _LandsLate(w.store, unreadable=1 + common_module.SETTLE_ATTEMPTS_MAX)
        manager.armed = lambda md: handle.id in md.ledger_ids
        monkeypatch.setattr(admin_module, "log_manager", lambda client: manager)
        with pytest.raises(CasResultUnknown):
            await append_ledgers(bk, "lg", [handle.id], commit=("job", 0))
        assert manager.held is not None
        assert await manager.land()  # the late CAS lists the ledger
        assert await _every_listed_ledger_exists(bk, "lg") == (writer.ledger_id, handle.id)
        assert [r.payload async for r in await open_log_reader(other, "lg")] == [b"a", b"imported"]
