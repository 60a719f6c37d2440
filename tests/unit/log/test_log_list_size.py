"""The ledger list's size cap: a list without room for another ledger refuses it with `LogFull`
before creating anything (no orphan per refused roll), the writer still closes, and truncation makes
room again. The cap is made small here (4 KiB) so the list fills in a few dozen ledgers."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    LogFull,
    LogPosition,
    LogWriter,
    append_ledgers,
    describe_log,
    open_log_writer,
    truncate_log,
)
from bookkeeper_aio.log import writer as writer_module
from bookkeeper_aio.log._common import log_manager
from metadata import log_metadata
from metadata.log_metadata import LogLedger, LogLedgerState, LogMetadata, encode, encoded_size, has_room
from tests.unit.log.fakes import world

CAP = 4096


async def _ledger_ids(bk: BookKeeper) -> list[int]:
    return [ledger_id for ledger_id in range(1, 200) if await bk.context.ledgers.exists(ledger_id)]


async def roll_until_full(writer: LogWriter) -> None:
    """Append and roll until the list refuses a roll (LogFull)."""
    for _ in range(200):
        await writer.append(b"x")
        try:
            await writer.roll()
        except LogFull:
            return
    pytest.fail("the list never filled")


async def _closed_ledger(bk: BookKeeper, after_ledger_id: int) -> int:
    """A new ledger for the log, one entry written, closed: ready to import."""
    ledger = await bk.create_ledger(3, 2, 2, after_ledger_id=after_ledger_id)
    await ledger.append(b"x")
    await ledger.close()
    return ledger.id


@pytest.mark.parametrize("spare", [False, True], ids=["roll", "spare"])
async def test_a_full_list_refuses_a_roll_before_creating_its_ledger(
    monkeypatch: pytest.MonkeyPatch, spare: bool
) -> None:
    monkeypatch.setattr(log_metadata, "ENCODED_BYTES_MAX", CAP)
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg", roll_entries_max=2 if spare else None)
        await roll_until_full(writer)
        listed = list(writer.ledger_ids)
        for _ in range(3):  # refused again: still nothing created
            with pytest.raises(LogFull, match="truncate"):
                await writer.roll()
        await writer.append(b"y")
        await writer.close()  # the close's mark still fits
        assert [e.state for e in (await describe_log(bk, "lg")).ledgers] == ["closed"] * len(listed)
        assert await _ledger_ids(bk) == listed  # no orphan, no spare left
        with pytest.raises(LogFull):  # a takeover needs the room of a roll too
            await open_log_writer(other, "lg")
        assert await _ledger_ids(bk) == listed
        await truncate_log(other, "lg", LogPosition(listed[-10], 0))
        reopened = await open_log_writer(other, "lg")
        await reopened.append(b"z")
        await reopened.roll()
        await reopened.close()


async def test_an_import_into_a_full_list_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_metadata, "ENCODED_BYTES_MAX", CAP)
    async with world() as w:
        bk, _ = w.clients
        imported: list[int] = []
        for _ in range(200):
            ledger_id = await _closed_ledger(bk, max(imported, default=0))
            try:
                await append_ledgers(bk, "lg", [ledger_id])
            except LogFull:
                break
            imported.append(ledger_id)
        else:
            pytest.fail("the list never filled")
        assert list((await describe_log(bk, "lg")).ledgers)[-1].ledger_id == imported[-1]


async def test_an_import_whose_commit_token_does_not_fit_is_refused_before_fencing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The room an import checks counts its commit token (an importer id of up to 256 bytes):
    LogFull before the log's last ledgers are fenced, not InvalidMetadata after."""
    monkeypatch.setattr(log_metadata, "ENCODED_BYTES_MAX", CAP)
    async with world() as w:
        bk, _ = w.clients
        imported: list[int] = []
        for _ in range(200):
            ledger_id = await _closed_ledger(bk, max(imported, default=0))
            md = (await log_manager(bk).read("lg")).metadata if imported else None
            if md is not None and has_room(md, 1) and not has_room(md, 2):
                with pytest.raises(LogFull):
                    await append_ledgers(bk, "lg", [ledger_id], commit=("importer-" + "x" * 240, 1))
                assert (await log_manager(bk).read("lg")).metadata == md  # nothing changed
                return
            await append_ledgers(bk, "lg", [ledger_id])
            imported.append(ledger_id)
        pytest.fail("the list never reached one ledger's room")


async def test_a_closed_writers_roll_is_misuse_not_a_fencing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A roll after close() on a full list with retention set: BKInterfaceError, and the writer is
    not marked fenced (retention used to run first and take the closed last ledger for a takeover)."""
    monkeypatch.setattr(log_metadata, "ENCODED_BYTES_MAX", CAP)
    async with world() as w:
        bk, _ = w.clients
        writer = await open_log_writer(bk, "lg", retention_age_s=100)
        await roll_until_full(writer)
        await writer.close()
        now_ms = writer._manager.now_ms
        monkeypatch.setattr(writer._manager, "now_ms", lambda: now_ms() + 10_000_000)
        with pytest.raises(BKInterfaceError, match="closed"):
            await writer.roll()
        assert writer._fenced is None


def test_the_documented_bounds_hold() -> None:
    """`LEDGER_BYTES_MAX` is what the largest ledger takes; a list that `has_room` filled with such
    ledgers holds ~19,700 and still encodes after its last ledger's close and a spare."""
    biggest = 2**63 - 1
    assert len(msgpack.packb([biggest, "closed", *[biggest] * 4])) == log_metadata.LEDGER_BYTES_MAX
    assert len(msgpack.packb([0, "open", None, None, None, None])) == log_metadata.LEDGER_BYTES_MIN
    big = 2**40  # every number a 9-byte uint64
    entries = 2**33 + 1

    def full_sized(count: int) -> LogMetadata:
        ledgers = (
            LogLedger(2**62 + i, LogLedgerState.CLOSED, big + i * entries, entries - 1, big, big)
            for i in range(count)
        )
        return LogMetadata("lg", tuple(ledgers), truncated_before=2**62)

    size = encoded_size(full_sized(19_000))  # each ledger more: 53 bytes more
    count = 19_000 + (log_metadata.ENCODED_BYTES_MAX - size - 3 * 53 - 9) // 53
    assert 19_700 < count < 19_800
    md = full_sized(count)
    assert has_room(md)
    assert not has_room(full_sized(count + 1))
    md = md.with_ledger_appended(md.last_ledger_id + 1).with_spare(md.last_ledger_id + 2)
    encode(md.with_closed(md.last_ledger_id, last_entry_id=entries - 1, length=big, closed_ms=big))


def _count_refusals(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the writer's room checks that refused (each encodes the whole list)."""
    refusals = [0]
    real = writer_module.check_room

    def counting(md: LogMetadata, ledgers: int = 1) -> None:
        try:
            real(md, ledgers)
        except LogFull:
            refusals[0] += 1
            raise

    monkeypatch.setattr(writer_module, "check_room", counting)
    return refusals


async def _append_for(writer: LogWriter, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        await writer.append(b"x")
        await asyncio.sleep(0.005)


async def test_automatic_rolls_of_a_full_list_back_off_and_a_truncation_ends_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the list is full, appends past the roll limit tried a roll (and a spare) every
    ROLL_RETRY_S, each encoding the list, until someone truncated. They back off now, doubling up
    to ROLL_FULL_RETRY_S_MAX; the writer's own truncation ends the wait at once."""
    monkeypatch.setattr(log_metadata, "ENCODED_BYTES_MAX", CAP)
    monkeypatch.setattr(writer_module, "ROLL_RETRY_S", 0.02)
    monkeypatch.setattr(writer_module, "ROLL_FULL_RETRY_S_MAX", 0.16)
    refusals = _count_refusals(monkeypatch)
    async with world() as w:
        bk, _ = w.clients
        writer = await open_log_writer(bk, "lg", roll_entries_max=2)
        await roll_until_full(writer)
        full = writer.ledger_ids
        refusals[0] = 0
        await _append_for(writer, 1.0)
        # a roll and a spare per try: every 20 ms, ~100 in the second (measured before: 87);
        # waits of 20, 40, 80, then 160 ms: about 9 tries, ~14 refusals (measured)
        assert 1 <= refusals[0] <= 24, refusals[0]
        assert writer.ledger_ids == full  # still full: nothing rolled, nothing created
        monkeypatch.setattr(writer_module, "ROLL_FULL_RETRY_S_MAX", 600.0)
        monkeypatch.setattr(writer_module, "ROLL_RETRY_S", 300.0)
        await _append_for(writer, 0.1)  # the next refusal waits 300 s
        await writer.truncate_before(LogPosition(full[-10], 0))
        await _append_for(writer, 0.5)  # ... but the truncation made room: a roll at once
        assert writer.ledger_ids[-1] > full[-1]
        await writer.close()


async def test_a_full_writer_sees_another_clients_truncation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A truncation by another client (`truncate_log`, `bkaio log truncate`) makes room too: a roll
    that finds this writer's copy of the list full reads the list again (before, it refused with
    LogFull until the writer was reopened)."""
    monkeypatch.setattr(log_metadata, "ENCODED_BYTES_MAX", CAP)
    monkeypatch.setattr(writer_module, "ROLL_RETRY_S", 0.02)
    monkeypatch.setattr(writer_module, "ROLL_FULL_RETRY_S_MAX", 0.16)
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg", roll_entries_max=2)
        await roll_until_full(writer)
        full = writer.ledger_ids
        await _append_for(writer, 0.2)  # refused and waiting
        await truncate_log(other, "lg", LogPosition(full[-10], 0))
        await _append_for(writer, 0.5)  # the next automatic roll reads the list: room
        assert writer.ledger_ids[0] == full[-10]
        assert writer.ledger_ids[-1] > full[-1]
        assert await writer.roll() > writer.ledger_ids[-2]  # and explicit rolls too
        await writer.close()
        assert (await describe_log(bk, "lg")).ledgers[-1].ledger_id == writer.ledger_ids[-1]
