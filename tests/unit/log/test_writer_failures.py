"""The log writer under its own close, failed closes of a rolled ledger, lost roll answers with an
unreadable list, and a log deleted under a roll: the writer never fences itself, never leaves a
ledger OPEN behind it while it lives, and never leaks a ledger."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    LogFenced,
    LogWriter,
    delete_log,
    describe_log,
    open_log_reader,
    open_log_writer,
)
from bookkeeper_aio.client import ledger as ledger_module
from bookkeeper_aio.log import _common as common_module
from bookkeeper_aio.log import writer as writer_module
from metadata.errors import CasResultUnknown, MetadataUnavailable
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogMetadata
from tests.unit.client.conftest import FAST, ROOT
from tests.unit.log.fakes import world


async def _states(bk: BookKeeper, name: str) -> list[str]:
    return [e.state for e in (await describe_log(bk, name)).ledgers]


async def test_close_with_appends_waiting_for_a_slot_closes_the_ledger_and_does_not_fence() -> None:
    """close() releases appends waiting for a window slot: they were never sent, so they fail as
    appends on a closed writer (nothing written), the sent ones complete, and the ledger is closed."""
    async with world(dataclasses.replace(FAST, add_window_max=2)) as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"first")
        tasks = [asyncio.create_task(writer.append(b"x%d" % i)) for i in range(6)]
        for _ in range(3):
            await asyncio.sleep(0)
        await writer.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[:2] == [(writer.ledger_id, 1), (writer.ledger_id, 2)]  # the window's two, sent
        for refused in results[2:]:
            assert isinstance(refused, BKInterfaceError), refused
            assert not refused.outcome_unknown
        assert await _states(bk, "lg") == ["closed"]
        ledger = await other.open_ledger(writer.ledger_id)
        assert ledger.is_closed
        assert ledger.last_add_confirmed == 2
        got = [r.payload async for r in await open_log_reader(other, "lg")]
        assert got == [b"first", b"x0", b"x1"]


class _DeleteFirst(LogManager):
    """Deletes the log (through another client) just before the first CAS of the list."""

    def __init__(self, store: object, root: str, other: BookKeeper) -> None:
        super().__init__(store, root)  # type: ignore[arg-type]
        self.other: BookKeeper | None = other

    async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
        if self.other is not None:
            other, self.other = self.other, None
            await delete_log(other, metadata.name)
        return await super().write(metadata, expected_version)


async def test_a_roll_racing_delete_log_raises_log_fenced_and_deletes_its_new_ledger() -> None:
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        first = writer.ledger_id
        writer._manager = _DeleteFirst(w.store, ROOT, other)
        with pytest.raises(LogFenced, match="deleted"):
            await writer.roll()
        assert not await bk.context.ledgers.exists(first)  # delete_log's
        assert not await bk.context.ledgers.exists(first + 1)  # the roll's new ledger, not listed
        with pytest.raises(LogFenced):
            await writer.append(b"b")


async def test_an_open_racing_delete_log_deletes_its_new_ledger_and_starts_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The log is deleted between the open's ledger creation and its CAS: the ledger is not listed
    anywhere, so it is deleted, and the open starts over (``create=True``: on a new log)."""
    async with world() as w:
        bk, other = w.clients
        old = await open_log_writer(other, "lg")
        await old.append(b"a")
        manager = _DeleteFirst(w.store, ROOT, other)
        monkeypatch.setattr(writer_module, "log_manager", lambda client: manager)
        writer = await open_log_writer(bk, "lg")
        info = await describe_log(bk, "lg")
        assert [e.ledger_id for e in info.ledgers] == [writer.ledger_id]
        for ledger_id in range(1, writer.ledger_id):  # the old writer's and the lost open's
            assert not await bk.context.ledgers.exists(ledger_id)
        await writer.append(b"b")
        await writer.close()
        assert [r.payload async for r in await open_log_reader(other, "lg")] == [b"b"]


def _close_fails_once(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ledger_module.close_in_metadata
    failed: list[bool] = []

    async def flaky(*args: object, **kwargs: object) -> object:
        if not failed:
            failed.append(True)
            raise MetadataUnavailable("etcd blip")
        return await original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger_module, "close_in_metadata", flaky)


async def _rolled_with_a_failed_close(bk: BookKeeper, monkeypatch: pytest.MonkeyPatch) -> LogWriter:
    """A writer of log "lg" that wrote b"a", then rolled: the roll's close of that ledger failed."""
    writer = await open_log_writer(bk, "lg")
    await writer.append(b"a")
    _close_fails_once(monkeypatch)
    with pytest.raises(MetadataUnavailable):
        await writer.roll()
    return writer


async def test_a_rolled_ledger_whose_close_failed_is_closed_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers stop at an OPEN ledger: the writer closes it again in the background, without
    waiting for another roll."""
    monkeypatch.setattr(writer_module, "ROLL_RETRY_S", 0.05)
    async with world() as w:
        bk, other = w.clients
        writer = await _rolled_with_a_failed_close(bk, monkeypatch)
        await writer.append(b"b")  # on the new ledger
        for _ in range(100):
            if await _states(bk, "lg") == ["closed", "open"]:
                break
            await asyncio.sleep(0.02)
        assert await _states(bk, "lg") == ["closed", "open"]
        assert [r.payload async for r in await open_log_reader(other, "lg")][:1] == [b"a"]
        await writer.close()
        assert [r.payload async for r in await open_log_reader(other, "lg")] == [b"a", b"b"]


async def test_close_closes_a_rolled_ledger_whose_close_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "ROLL_RETRY_S", 3600.0)  # no background try: close() does it
    async with world() as w:
        bk, other = w.clients
        writer = await _rolled_with_a_failed_close(bk, monkeypatch)
        await writer.append(b"b")
        await writer.close()
        assert await _states(bk, "lg") == ["closed", "closed"]
        assert [r.payload async for r in await open_log_reader(other, "lg")] == [b"a", b"b"]


class _LostAndUnreadable(LogManager):
    """The first CAS applies but its answer is lost, and the reads fail for longer than the CAS
    answer's settling tries (`cas_log`'s read-back, then each of `settle_cas`'s)."""

    lost = True
    unreadable = 0

    async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
        written = await super().write(metadata, expected_version)
        if self.lost:
            self.lost = False
            self.unreadable = 1 + common_module.SETTLE_ATTEMPTS_MAX
            raise CasResultUnknown(self.keys.log(metadata.name), "deadline exceeded")
        return written

    async def read(self, name: str) -> VersionedLog:
        if self.unreadable:
            self.unreadable -= 1
            raise MetadataUnavailable("etcd blip")
        return await super().read(name)


@pytest.mark.parametrize("repair", ["background", "next roll"])
async def test_a_lost_roll_answer_with_the_list_unreadable_is_settled_without_fencing(
    monkeypatch: pytest.MonkeyPatch, repair: str
) -> None:
    monkeypatch.setattr(writer_module, "ROLL_RETRY_S", 0.05 if repair == "background" else 3600.0)
    monkeypatch.setattr(common_module, "SETTLE_RETRY_S", 0.001)
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        first = writer.ledger_id
        writer._manager = _LostAndUnreadable(w.store, ROOT)
        with pytest.raises(CasResultUnknown):
            await writer.roll()
        appended = await writer.append(b"b")  # the writer goes on, on the old ledger until it knows
        assert appended is not None
        assert appended.ledger_id == first or repair == "background"
        if repair == "background":
            for _ in range(100):
                if writer.ledger_id != first:
                    break
                await asyncio.sleep(0.02)
            assert await _states(bk, "lg") == ["closed", "open"]
        else:
            await writer.roll()  # the listed ledger first, then a new one
            assert await _states(bk, "lg") == ["closed", "closed", "open"]
        await writer.append(b"c")
        await writer.close()
        assert [r.payload async for r in await open_log_reader(other, "lg")] == [b"a", b"b", b"c"]
