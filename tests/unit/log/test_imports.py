"""Imports of written ledgers (`append_ledgers`) against lost CAS answers and reused commit tokens,
and a cursor against a concurrent truncation, on fake bookies and MemoryStore."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    CommitTokenReused,
    LogPosition,
    LogTruncated,
    NoSuchLog,
    append_ledgers,
    commit_cursor,
    describe_log,
    open_log_reader,
    open_log_writer,
)
from bookkeeper_aio.log import LEDGER_LOG_KEY, admin
from bookkeeper_aio.log._common import log_manager
from bookkeeper_aio.log.truncation import plan_truncation
from metadata.errors import CasResultUnknown
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogMetadata
from tests.unit.client.conftest import ROOT
from tests.unit.log.fakes import world


async def _ledger(bk: BookKeeper, after: int, payload: bytes) -> int:
    handle = await bk.create_ledger(3, 2, 2, after_ledger_id=after)
    await handle.append(payload)
    await handle.close()
    return handle.id


async def _last(bk: BookKeeper, name: str) -> int:
    return (await describe_log(bk, name)).ledgers[-1].ledger_id


async def test_an_import_whose_cas_answer_was_lost_after_the_list_moved_on_reports_success(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CAS applied, its answer was lost and someone else changed the list before it was read
    back: the import is committed (its ledgers are listed), so it must say so, not raise (a job
    reported failed is rerun and writes every row twice)."""

    class LostThenMoved(LogManager):
        armed = True

        async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
            written = await super().write(metadata, expected_version)
            if self.armed:
                self.armed = False  # another importer commits right after ours
                await super().write(written.metadata.with_commit("other", 1), written.version)
                raise CasResultUnknown(self.keys.log(metadata.name), "deadline exceeded")
            return written

    async with world(clients=1) as w:
        (bk,) = w.clients
        writer = await open_log_writer(bk, "out", roll_entries_max=4)
        await writer.append(b"x")
        await writer.append(b"y")  # half way to the roll: the writer records a spare
        spare = await _spare(bk, "out")
        manager = LostThenMoved(w.store, ROOT)
        monkeypatch.setattr(admin, "log_manager", lambda _bk: manager)
        imported = await _ledger(bk, await _last(bk, "out"), b"job-row")
        assert await append_ledgers(bk, "out", [imported], commit=("job", 0)) is True
        assert not manager.armed
        info = await describe_log(bk, "out")
        assert imported in [ledger.ledger_id for ledger in info.ledgers]
        assert dict(info.commits) == {"job": 0, "other": 1}
        assert info.spare is None
        assert not await bk.context.ledgers.exists(spare)  # the taken-over writer's spare is gone


async def _spare(bk: BookKeeper, name: str) -> int:
    for _ in range(200):
        spare = (await describe_log(bk, name)).spare
        if spare is not None:
            return spare
        await asyncio.sleep(0.01)
    raise AssertionError(f"log {name!r}: no spare recorded")


async def test_a_batch_id_below_the_committed_one_is_refused_not_dropped_as_a_replay() -> None:
    """An importer id reused from batch 0 again (a new Spark checkpoint with the same writerId):
    returning False made the caller delete the batch's ledgers, its rows gone without an error."""
    async with world(clients=1) as w:
        (bk,) = w.clients
        for batch in range(3):
            after = await _last(bk, "out") if batch else 0
            made = await _ledger(bk, after, b"q1-%d" % batch)
            assert await append_ledgers(bk, "out", [made], commit=("enricher", batch)) is True
        version = (await describe_log(bk, "out")).version
        fresh = await _ledger(bk, await _last(bk, "out"), b"q2-0")
        with pytest.raises(
            CommitTokenReused, match=r"'enricher' already committed batch 2, above this batch 0"
        ) as caught:
            await append_ledgers(bk, "out", [fresh], commit=("enricher", 0))
        assert (caught.value.importer, caught.value.batch_id, caught.value.committed) == ("enricher", 0, 2)
        info = await describe_log(bk, "out")
        assert info.version == version
        assert fresh not in [ledger.ledger_id for ledger in info.ledgers]
        # the same batch id again is a replay: False, nothing changes
        assert await append_ledgers(bk, "out", [fresh], commit=("enricher", 2)) is False
        assert (await describe_log(bk, "out")).version == version


async def test_an_equal_batch_id_under_another_tag_is_refused_and_the_same_tag_is_a_replay() -> None:
    """The token's tag binds it to its producer (a Spark query id): a second producer reusing the
    importer id from batch 0 when the first committed batch 0 is not a replay (returning False made
    the caller delete its ledgers: rows gone without an error); the first producer's replay is."""
    async with world(clients=1) as w:
        (bk,) = w.clients
        first = await _ledger(bk, 0, b"q1-0")
        assert await append_ledgers(bk, "out", [first], commit=("sink", 0), commit_tag="query-1") is True
        info = await describe_log(bk, "out")
        fresh = await _ledger(bk, first, b"q2-0")
        with pytest.raises(
            CommitTokenReused, match=r"'sink' already committed batch 0 from another producer"
        ) as caught:
            await append_ledgers(bk, "out", [fresh], commit=("sink", 0), commit_tag="query-2")
        assert (caught.value.tag, caught.value.committed_tag) == ("query-2", "query-1")
        assert (await describe_log(bk, "out")).version == info.version
        assert await append_ledgers(bk, "out", [fresh], commit=("sink", 0), commit_tag="query-1") is False
        assert await append_ledgers(bk, "out", [fresh], commit=("sink", 0)) is False  # untagged: ids only
        assert (await describe_log(bk, "out")).version == info.version
        with pytest.raises(BKInterfaceError, match="commit_tag needs a commit token"):
            await append_ledgers(bk, "out", [fresh], commit_tag="query-1")


async def test_a_ledger_another_log_lists_is_refused() -> None:
    """A ledger in two lists: truncating (or deleting) one log deletes it, and the other can then
    be neither read nor opened. An import names the log in the ledger's custom metadata (a log
    writer's ledgers carry it from creation); a ledger naming another log is refused."""
    async with world(clients=1) as w:
        (bk,) = w.clients
        shared = await _ledger(bk, 0, b"shared")
        assert await append_ledgers(bk, "a", [shared]) is True
        tagged = (await bk.open_ledger(shared)).metadata.custom_metadata
        assert tagged[LEDGER_LOG_KEY] == b"a"
        with pytest.raises(BKInterfaceError, match=rf"ledger {shared} belongs to log 'a'"):
            await append_ledgers(bk, "b", [shared])
        assert await append_ledgers(bk, "a", [shared]) is True  # a retry into its own log: listed

        writer = await open_log_writer(bk, "c")
        await writer.append(b"c-0")
        await writer.close()
        with pytest.raises(BKInterfaceError, match=rf"ledger {writer.ledger_id} belongs to log 'c'"):
            await append_ledgers(bk, "b", [writer.ledger_id])
        with pytest.raises(NoSuchLog):  # refused before anything changed
            await describe_log(bk, "b")
        assert [ledger.ledger_id for ledger in (await describe_log(bk, "a")).ledgers] == [shared]


async def test_a_cursor_committed_between_a_truncations_plan_and_its_cas_is_cut_and_readers_say_so() -> None:
    """What docs/api.md says: the cursor is stored and its ledger still removed; a reader resuming
    after it gets LogTruncated, not the records after a gap."""
    async with world(clients=1) as w:
        (bk,) = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        await writer.roll()
        await writer.append(b"b")
        await writer.roll()
        first, _, last = writer.ledger_ids
        manager = log_manager(bk)
        current = await manager.read("lg")
        change, _ = await plan_truncation(bk, manager, current.metadata, last, b"")  # no cursor yet
        await commit_cursor(bk, "lg", "c", LogPosition(first, 0))  # returns: nothing truncated yet
        await manager.update("lg", change, current=current)
        assert (await manager.read("lg")).metadata.truncated_before > first
        with pytest.raises(LogTruncated):
            await open_log_reader(bk, "lg", start=LogPosition(first, 1))
        with pytest.raises(LogTruncated):
            await commit_cursor(bk, "lg", "c", LogPosition(first, 0))
        await writer.close()
