"""Truncation against stale views and stale cursors, and bad positions: a writer truncating after
an operator's cut, a cursor committed below the log's start, positions that are not positions."""

from __future__ import annotations

from typing import Any

import pytest

from bookkeeper_aio import (
    BKInterfaceError,
    LogPosition,
    LogTruncated,
    commit_cursor,
    describe_log,
    open_log_reader,
    open_log_writer,
    read_cursors,
    truncate_log,
)
from tests.unit.log.fakes import world


async def test_a_sequenced_writer_truncates_after_an_operator_cut_it_did_not_see() -> None:
    """The writer's list still names ledgers an operator's `truncate_log` removed and deleted: its
    plan must not read their records (NoSuchLedger) but start from the list as it is."""
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "sq", sequenced=True)
        for sequence in range(1, 5):
            await writer.append(b"x", sequence=sequence)
            await writer.roll()
        ids = writer.ledger_ids
        await truncate_log(other, "sq", LogPosition(ids[2], 0))  # drops and deletes the first two
        assert await writer.truncate_before(LogPosition(ids[2], 0)) == LogPosition(ids[2], 0)
        assert await writer.truncate_before(LogPosition(ids[3], 0)) == LogPosition(ids[3], 0)
        info = await describe_log(bk, "sq")
        assert [e.ledger_id for e in info.ledgers] == list(ids[3:])
        await writer.close()
        reopened = await open_log_writer(other, "sq")
        assert reopened.last_sequence == 4
        await reopened.close()


async def test_a_cursor_below_the_start_is_refused_and_a_stored_one_holds_nothing_back() -> None:
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg", retention_bytes=1)
        first = await writer.append(b"a" * 10)
        for _ in range(3):
            await writer.roll()
            await writer.append(b"b" * 10)
        assert first is not None
        assert (await describe_log(bk, "lg")).truncated_before > first.ledger_id
        with pytest.raises(LogTruncated):
            await commit_cursor(other, "lg", "slow", first)
        assert await read_cursors(other, "lg") == {}  # refused before it was written
        # One committed while a truncation removed its ledger (between the check and the write):
        await writer._manager.write_cursor("lg", "raced", first.ledger_id, first.entry_id)
        for _ in range(3):
            await writer.roll()
            await writer.append(b"c" * 10)
        info = await describe_log(bk, "lg")
        assert [e.ledger_id for e in info.ledgers] == [writer.ledger_id]  # retention went on
        await writer.append(b"d")
        await writer.roll()
        assert await truncate_log(other, "lg", LogPosition(writer.ledger_id, 0)) == LogPosition(
            writer.ledger_id, 0
        )
        await writer.close()


BAD_POSITIONS: list[Any] = [
    LogPosition("1", 0),  # type: ignore[arg-type]
    LogPosition(None, 0),  # type: ignore[arg-type]
    LogPosition(True, 0),  # type: ignore[arg-type]
    LogPosition(1, "0"),  # type: ignore[arg-type]
    LogPosition(1, 0.0),  # type: ignore[arg-type]
    LogPosition(-1, 0),
    LogPosition(1, -5),
    LogPosition(2**63, 0),
    (1, 0),
]


@pytest.mark.parametrize("bad", BAD_POSITIONS, ids=repr)
async def test_a_bad_position_is_an_interface_error_everywhere(bad: Any) -> None:
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        with pytest.raises(BKInterfaceError):
            await open_log_reader(other, "lg", start=bad)
        with pytest.raises(BKInterfaceError):
            await open_log_reader(other, "lg", end=bad)
        with pytest.raises(BKInterfaceError):
            await truncate_log(other, "lg", bad)
        with pytest.raises(BKInterfaceError):
            await writer.truncate_before(bad)
        if bad != LogPosition(1, -5):  # -1 is a cursor that consumed nothing of its ledger
            with pytest.raises(BKInterfaceError):
                await commit_cursor(other, "lg", "c", bad)
        await writer.append(b"b")  # the writer goes on
        await writer.close()


async def test_truncate_log_with_nothing_to_cut_does_not_write_the_list() -> None:
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        before = (await describe_log(bk, "lg")).version
        assert await truncate_log(other, "lg", LogPosition(0, 0)) == LogPosition(writer.ledger_id, 0)
        assert await truncate_log(other, "lg", LogPosition(writer.ledger_id, 5)) == LogPosition(
            writer.ledger_id, 0
        )
        assert (await describe_log(bk, "lg")).version == before
        await writer.close()


async def test_a_cut_before_a_ledger_the_log_does_not_list_is_refused_unless_forced() -> None:
    """An id past the last ledger (a typo) would drop every ledger but the last: refused by the
    API and the writer alike, the list untouched; ``force=True`` cuts below it as asked."""
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        for _ in range(3):
            await writer.append(b"a")
            await writer.roll()
        other_ledger = await bk.create_ledger(3, 2, 2)  # a ledger, but not the log's
        await writer.roll()
        ids = writer.ledger_ids
        assert ids[-2] < other_ledger.id < ids[-1]
        version = (await describe_log(bk, "lg")).version
        for stray in (ids[-1] + 999_999, other_ledger.id):
            with pytest.raises(BKInterfaceError, match=f"ledger {stray} is not in the log"):
                await truncate_log(other, "lg", LogPosition(stray, 0))
            with pytest.raises(BKInterfaceError, match="force=True"):
                await writer.truncate_before(LogPosition(stray, 0))
        info = await describe_log(bk, "lg")
        assert (info.version, [e.ledger_id for e in info.ledgers]) == (version, list(ids))
        assert await truncate_log(other, "lg", LogPosition(0, 0)) == LogPosition(ids[0], 0)  # below
        assert await truncate_log(other, "lg", LogPosition(ids[1], 0)) == LogPosition(ids[1], 0)
        assert await writer.truncate_before(LogPosition(ids[-1] + 5, 0), force=True) == LogPosition(
            ids[-1], 0
        )
        assert [e.ledger_id for e in (await describe_log(bk, "lg")).ledgers] == [ids[-1]]
        await writer.close()


async def test_a_cursor_outside_the_log_is_refused() -> None:
    """A cursor names a record the log holds: a ledger it does not list, or an entry past the end
    of a ledger it closed, raises BKInterfaceError and stores nothing; an open ledger's entries
    are not checked (its end still moves), and -1 (none of a ledger consumed) is a position."""
    async with world() as w:
        bk, other = w.clients
        writer = await open_log_writer(bk, "lg")
        await writer.append(b"a")
        await writer.append(b"b")
        closed = writer.ledger_id
        await writer.roll()
        for bad, match in (
            (LogPosition(writer.ledger_id + 99_999, 0), "is not in the log"),
            (LogPosition(closed, 2), "closed at entry 1"),
            (LogPosition(closed, 99_999), "closed at entry 1"),
        ):
            with pytest.raises(BKInterfaceError, match=match):
                await commit_cursor(other, "lg", "c", bad)
        assert await read_cursors(other, "lg") == {}
        for good in (LogPosition(closed, 1), LogPosition(closed, -1), LogPosition(writer.ledger_id, 50)):
            await commit_cursor(other, "lg", "c", good)
            assert await read_cursors(other, "lg") == {"c": good}
        await writer.close()
