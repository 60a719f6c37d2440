"""Races of the log layer on fake bookies and MemoryStore: lost and late CAS answers, cancelled
rolls, readers between a roll's CAS and its close, concurrent sequenced producers, truncation under
a following reader, repairs of lost CLOSED marks, delete_log against a rolling writer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    LogPosition,
    LogTruncated,
    append_ledgers,
    delete_log,
    describe_log,
    list_logs,
    open_log_reader,
    open_log_writer,
    truncate_log,
)
from bookkeeper_aio.log import admin
from bookkeeper_aio.log import reader as reader_module
from bookkeeper_aio.log import writer as writer_module
from metadata.errors import CasResultUnknown, MetadataUnavailable
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogMetadata
from tests.unit.client.conftest import FAST, ROOT
from tests.unit.log.fakes import world


async def _exists(bk: BookKeeper, ledger_id: int) -> bool:
    return await bk.context.ledgers.exists(ledger_id)


async def test_a_roll_whose_lost_cas_lands_late_keeps_its_listed_ledger() -> None:
    """The answer is lost, the read-back sees the old list, then the request lands: the retry's
    conflict must not be taken as "not applied" (the ledger is listed: deleting it bricks the log)."""

    class LateApply(LogManager):
        armed = True
        pending: tuple[LogMetadata, int] | None = None

        async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
            if self.armed:
                self.armed = False
                self.pending = (metadata, expected_version)
                raise CasResultUnknown(self.keys.log(metadata.name), "deadline exceeded")
            return await super().write(metadata, expected_version)

        async def read(self, name: str) -> VersionedLog:
            current = await super().read(name)
            if self.pending is not None:
                metadata, version = self.pending
                self.pending = None
                await super().write(metadata, version)
            return current

    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        writer._manager = LateApply(w.store, ROOT)
        await writer.roll()  # the retry's conflict is read back: the list is exactly the roll's
        await writer.append(b"a2")
        info = await describe_log(bk, "lg")
        assert len(info.ledgers) == 2
        assert all([await _exists(bk, e.ledger_id) for e in info.ledgers])
        reopened = await asyncio.wait_for(open_log_writer(other, "lg"), 10)
        await reopened.append(b"b")
        await reopened.close()
        assert [r.payload async for r in await open_log_reader(other, "lg")] == [b"a", b"a2", b"b"]


async def test_a_reader_at_latest_opened_during_a_roll_sees_every_append_acknowledged_after() -> None:
    """The roll's CAS applied (the list names the new ledger), its answer is still on its way: the
    writer appends to the old ledger meanwhile. A follower from "latest" opened then starts in the
    old ledger (the first of the last two not closed), after its last confirmed record."""

    class SlowAnswer(LogManager):
        applied = asyncio.Event()
        release = asyncio.Event()

        async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
            written = await super().write(metadata, expected_version)
            if len(metadata.ledgers) == 2 and not self.applied.is_set():
                self.applied.set()
                await self.release.wait()
            return written

    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        before = await writer.append(b"before")
        manager = SlowAnswer(w.store, ROOT)
        writer._manager = manager
        roll = asyncio.create_task(writer.roll())
        await asyncio.wait_for(manager.applied.wait(), 10)
        reader = await open_log_reader(other, "lg", start="latest", follow=True)
        during = await writer.append(b"during")  # acknowledged after the reader opened
        assert during is not None
        assert before is not None
        assert during.ledger_id == before.ledger_id  # on the old ledger: the roll has not switched
        manager.release.set()
        await roll
        after = await writer.append(b"after")
        got: list[tuple[LogPosition, bytes]] = []
        async with contextlib.aclosing(reader), asyncio.timeout(10):
            async for record in reader:
                got.append((record.position, record.payload))
                if record.payload == b"after":
                    break
        # a suffix of the log (the LAC may lag the writer's last acknowledged record by one)
        assert got[-2:] == [(during, b"during"), (after, b"after")]
        assert got[:-2] in ([], [(before, b"before")])
        await writer.close()


async def test_a_reader_at_latest_passes_a_ledger_truncated_after_it_read_the_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A start at "latest" looks at the last two ledgers; the first, closed, may be truncated (and
    deleted) between the reader's read of the list and its open of the ledger."""

    class TruncatedAfterRead(LogManager):
        async def read(self, name: str) -> VersionedLog:
            current = await super().read(name)
            await truncate_log(bk, name, LogPosition(current.metadata.ledger_ids[-1], 0))
            return current

    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        await writer.roll()
        monkeypatch.setattr(reader_module, "log_manager", lambda client: TruncatedAfterRead(w.store, ROOT))
        reader = await open_log_reader(other, "lg", start="latest", follow=True)
        after = await writer.append(b"b")
        async with contextlib.aclosing(reader), asyncio.timeout(10):
            got = await anext(reader)
        assert (got.position, got.payload) == (after, b"b")
        await writer.close()


async def test_a_roll_cancelled_during_its_cas_does_not_delete_a_listed_ledger() -> None:
    class SlowAnswer(LogManager):
        async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
            written = await super().write(metadata, expected_version)
            await asyncio.sleep(0.5)
            return written

    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        writer._manager = SlowAnswer(w.store, ROOT)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(writer.roll(), 0.2)
        info = await describe_log(bk, "lg")
        assert len(info.ledgers) == 2
        assert all([await _exists(bk, e.ledger_id) for e in info.ledgers])
        reopened = await asyncio.wait_for(open_log_writer(other, "lg"), 10)
        await reopened.close()


async def test_a_reader_to_the_current_end_stops_at_a_ledger_a_roll_has_not_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between a roll's CAS and its close the old ledger's LAC may lag acked appends: reading on
    into the new ledger would hand out later records and skip those."""
    original = writer_module.LogWriter._close_old

    async def slow_close_old(self: writer_module.LogWriter, old: object) -> None:
        await asyncio.sleep(1.0)
        await original(self, old)  # type: ignore[arg-type]

    monkeypatch.setattr(writer_module.LogWriter, "_close_old", slow_close_old)
    async with world(dataclasses.replace(FAST, explicit_lac_interval_ms=100)) as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        first = writer.ledger_id
        old = [await writer.append(f"a{i}".encode()) for i in range(3)]
        roll = asyncio.create_task(writer.roll())
        while writer.ledger_id == first:  # noqa: ASYNC110 - the writer has no event for its switch
            await asyncio.sleep(0.005)
        await writer.append(b"b0")
        got = [r.position async for r in await open_log_reader(other, "lg")]
        assert got == old[: len(got)]  # a prefix of the old ledger, never a later record
        await roll
        await writer.close()
        assert len([r async for r in await open_log_reader(other, "lg")]) == 4


async def test_concurrent_sequenced_producers_keep_log_order_across_rolls() -> None:
    async with world(dataclasses.replace(FAST, add_window_max=2), clients=1) as w:
        (bk,) = w.clients
        writer = await open_log_writer(bk, "sq", sequenced=True, roll_entries_max=10)
        results: dict[int, LogPosition | None] = {}

        async def producer(sequence: int) -> None:
            results[sequence] = await writer.append(f"p{sequence}".encode(), sequence=sequence)

        tasks = []
        for sequence in range(1, 201):
            tasks.append(asyncio.create_task(producer(sequence)))
            for _ in range(sequence % 4):
                await asyncio.sleep(0)
            if sequence in (70, 140):  # producers go on while the next ledger's key is derived in
                async with asyncio.timeout(10):  # its thread, however slow a loaded machine makes it
                    while len(writer.ledger_ids) < 2 + sequence // 140:  # noqa: ASYNC110 - no event for a roll
                        await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        await writer.close()
        positions = [results[s] for s in range(1, 201)]
        assert None not in positions
        assert positions == sorted(positions)  # type: ignore[type-var]
        # rolls run beside the appends (the next ledger's key is derived in a thread meanwhile)
        assert len(writer.ledger_ids) >= 3
        seen = [r.sequence async for r in await open_log_reader(bk, "sq")]
        assert seen == list(range(1, 201))


async def test_a_sequence_advances_only_once_sent_and_survives_truncation() -> None:
    async with world(dataclasses.replace(FAST, entry_bytes_max=64), clients=1) as w:
        (bk,) = w.clients
        writer = await open_log_writer(bk, "sq", sequenced=True)
        assert await writer.append(b"one", sequence=1) is not None
        with pytest.raises(BKInterfaceError):
            await writer.append(b"x" * 100, sequence=2)  # refused before sending
        assert await writer.append(b"two", sequence=2) is not None  # not taken for a duplicate
        await writer.roll()
        await truncate_log(bk, "sq", LogPosition(writer.ledger_id, 0))  # only an empty ledger is left
        await writer.close()
        again = await open_log_writer(bk, "sq")
        assert again.last_sequence == 2  # from the truncation's record of what it removed
        assert await again.append(b"one again", sequence=1) is None
        await again.close()


async def test_a_lost_closed_mark_is_repaired_so_truncation_can_proceed() -> None:
    class FlakyOnce(LogManager):
        writes = 0

        async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
            self.writes += 1
            if self.writes == 2:  # the CAS that marks the old ledger CLOSED after the roll
                raise MetadataUnavailable("etcd blip")
            return await super().write(metadata, expected_version)

    async with world(clients=1) as w:
        (bk,) = w.clients
        writer = await open_log_writer(bk, "lg", retention_bytes=1)
        await writer.append(b"a")
        writer._manager = FlakyOnce(w.store, ROOT)
        with pytest.raises(MetadataUnavailable):
            await writer.roll()
        await writer.append(b"x" * 10)
        await writer.roll()  # carries the lost mark
        info = await describe_log(bk, "lg")
        assert [e.ledger_id for e in info.ledgers] == [writer.ledger_id]  # retention cut all the rest
        await writer.close()


async def test_a_following_reader_between_ledgers_gets_log_truncated_not_a_gap() -> None:
    async with world() as w:
        bk, other = w.clients
        first = await open_log_writer(bk, "lg")
        await first.append(b"r0")
        await first.close()
        reader = await open_log_reader(other, "lg", follow=True)
        assert (await anext(reader)).payload == b"r0"
        second = await open_log_writer(bk, "lg")
        await second.append(b"r1")
        await second.roll()
        await second.append(b"r2")
        await truncate_log(bk, "lg", LogPosition(second.ledger_id, 0))  # r1's ledger goes
        with pytest.raises(LogTruncated):
            await asyncio.wait_for(anext(reader), 5)
        await reader.aclose()
        await second.close()


async def test_delete_log_fences_the_list_a_concurrent_roll_made(monkeypatch: pytest.MonkeyPatch) -> None:
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        original = admin.recover_ledgers
        rolled: list[int] = []

        async def roll_first(
            client: BookKeeper, ids: tuple[int, ...], password: bytes
        ) -> dict[int, tuple[int, int]]:
            if not rolled:
                rolled.append(await writer.roll())  # the list changes after delete_log read it
            return await original(client, ids, password)

        monkeypatch.setattr(admin, "recover_ledgers", roll_first)
        await delete_log(other, "lg")
        assert await list_logs(other) == []
        with pytest.raises(Exception) as caught:  # the writer's ledger was fenced before the delete
            await writer.append(b"after")
        assert type(caught.value).__name__ in {"LogFenced", "NoSuchLedger"}


async def test_ledgers_cannot_be_imported_into_a_sequenced_log() -> None:
    async with world(clients=1) as w:
        (bk,) = w.clients
        writer = await open_log_writer(bk, "sq", sequenced=True)
        await writer.append(b"one", sequence=1)
        await writer.close()
        raw = await bk.create_ledger(3, 2, 2, after_ledger_id=writer.ledger_id)
        await raw.append(b"no header")
        await raw.close()
        with pytest.raises(BKInterfaceError, match="sequenced"):
            await append_ledgers(bk, "sq", [raw.id])


async def test_a_following_reader_stops_at_its_end_without_waiting_for_a_later_record() -> None:
    """``end`` in an open ledger whose last record is just before it, and in the last ledger once
    closed: the reader ends there instead of waiting for a record or a ledger that may never come."""
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        positions = [await writer.append(b"a%d" % i) for i in range(3)]
        end = LogPosition(writer.ledger_id, 2)
        reader = await open_log_reader(other, "lg", start="earliest", end=end, follow=True)
        got = await asyncio.wait_for(_positions(reader), 10)
        assert got == positions[:2]
        await writer.close()
        end = LogPosition(writer.ledger_id, 5)  # past the closed last ledger's end
        reader = await open_log_reader(other, "lg", start="earliest", end=end, follow=True)
        assert await asyncio.wait_for(_positions(reader), 10) == positions


async def _positions(reader: AsyncIterator[object]) -> list[LogPosition]:
    return [record.position async for record in reader]  # type: ignore[attr-defined]


async def test_an_automatic_roll_racing_close_logs_no_failure() -> None:
    """An append that makes a roll due schedules it; a ``close()`` right after wins the race: the
    roll (and the spare it wants) find the writer closed, which is no failure to warn about: the
    ledger is closed anyway."""
    async with world() as w:
        (bk, _) = w.clients
        writer = await open_log_writer(bk, "lg", roll_entries_max=1)
        first = writer.ledger_id
        with capture_logs() as logs:
            appended = await writer.append_async(b"a")  # the roll is due: scheduled, not started
            await writer.close()
        assert await appended == LogPosition(first, 0)
        assert not [e for e in logs if e["log_level"] == "warning"], logs
        info = await describe_log(bk, "lg")
        assert [(e.ledger_id, e.state) for e in info.ledgers] == [(first, "closed")]
