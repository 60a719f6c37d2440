"""Streaming offsets: a batch's end never passes an open ledger, and honours the row limit; a
batch's interval, once chosen, always holds the same entries (no Spark session: the driver's calls
are made directly, with the log's view given)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pyspark.sql.streaming.datasource import ReadAllAvailable

from bookkeeper_aio import LogPosition, LogTruncated
from bookkeeper_aio.spark import options as opt
from bookkeeper_aio.spark import stream
from bookkeeper_aio.spark.plan import EntryRange, LedgerExtent, plan_ranges
from bookkeeper_aio.spark.stream import (
    BookKeeperStreamReader,
    batch_extents,
    check_not_truncated,
    from_offset,
    last_before,
    stable_end,
    to_offset,
)

P = LogPosition
EXTENTS = [
    LedgerExtent(3, 4),
    LedgerExtent(5, -1),
    LedgerExtent(7, 9, closed=False),
    LedgerExtent(8, 2, closed=False),
]


def test_stops_at_the_first_open_ledger() -> None:
    assert stable_end(EXTENTS, P(0, 0), None) == P(7, 10)
    assert stable_end(EXTENTS, P(7, 10), None) == P(7, 10)  # nothing new until 7 closes


def test_row_limit() -> None:
    assert stable_end(EXTENTS, P(0, 0), 3) == P(3, 3)
    assert stable_end(EXTENTS, P(3, 3), 3) == P(7, 1)
    assert stable_end(EXTENTS, P(3, 5), 100) == P(7, 10)


def test_last_before() -> None:
    assert last_before(EXTENTS, P(7, 0)) == P(3, 4)
    assert last_before(EXTENTS, P(7, 3)) == P(7, 2)
    assert last_before(EXTENTS, P(3, 0)) is None


def test_offsets_round_trip() -> None:
    assert from_offset(to_offset(P(12, 0))) == (P(12, 0), None)
    assert from_offset(to_offset(P(12, 3), 40)) == (P(12, 3), 40)
    assert to_offset(P(12, 3), 40) == {"ledger_id": 12, "entry_id": 3, "offset": 40}


def test_a_truncation_under_unread_records_is_an_error() -> None:
    remaining = [LedgerExtent(9, 4, first_offset=20)]
    check_not_truncated("l", remaining, 9, P(9, 2), None)  # still listed
    check_not_truncated("l", remaining, 9, P(7, 5), 20)  # everything before ledger 9 was read
    check_not_truncated("l", [], 9, P(7, 5), None)  # nothing left at all
    with pytest.raises(LogTruncated, match=r"position \(7, 5\)") as caught:
        check_not_truncated("l", remaining, 9, P(7, 5), 18)  # records 18, 19 were never read
    assert caught.value.first_position == (9, 0)
    with pytest.raises(LogTruncated):
        check_not_truncated("l", remaining, 9, P(7, 5), None)  # cannot tell: refuse to skip


def test_a_query_started_on_an_empty_log_reads_its_first_ledger() -> None:
    """On an empty, never-truncated log a query starts at (0, 0) without a log offset; the first
    ledger listed later (id 5) is above it but nothing was truncated: read it, do not fail for good
    (as on every restart)."""
    start = P(0, 0)
    assert "offset" not in to_offset(start)
    extents = [LedgerExtent(5, 3, first_offset=0, closed=False)]
    check_not_truncated("l", extents, 0, start, None)
    assert stable_end(extents, start, None) == P(5, 4)
    assert plan_ranges(extents, start, P(5, 4), 100) == [EntryRange(5, 0, 3, 0)]
    # after a truncation to ledger 4 the empty log's query starts at (4, 0): still nothing missed
    check_not_truncated("l", extents, 4, P(4, 0), None)
    with pytest.raises(LogTruncated):  # but a start in a truncated ledger still fails
        check_not_truncated("l", extents, 4, P(3, 0), None)


@st.composite
def _extents(draw: st.DrawFn) -> list[LedgerExtent]:
    ids = sorted(draw(st.sets(st.integers(1, 30), max_size=5)))
    return [LedgerExtent(i, draw(st.integers(-1, 8)), closed=draw(st.booleans())) for i in ids]


@given(_extents(), st.none() | st.integers(1, 6))
def test_batches_cover_the_stable_prefix_once(extents: list[LedgerExtent], limit: int | None) -> None:
    """Batch after batch from the start: together exactly the entries up to the first open
    ledger's last add confirmed, each once, each batch within the limit."""
    start, seen = P(0, 0), []
    for _ in range(200):
        end = stable_end(extents, start, limit)
        assert end >= start
        if end == start:
            break
        ranges = plan_ranges(extents, start, end, 1000)
        batch = [P(r.ledger_id, e) for r in ranges for e in range(r.first, r.last + 1)]
        assert batch
        assert limit is None or len(batch) <= limit
        seen += batch
        start = end
    stable: list[LogPosition] = []
    for extent in extents:
        stable += [P(extent.ledger_id, e) for e in range(extent.last_entry_id + 1)]
        if not extent.closed:
            break
    assert seen == stable


class _Log:
    """What the driver's reads of the log answer, one view after another (the last one stays)."""

    def __init__(self, truncated_before: int, *views: Sequence[LedgerExtent]) -> None:
        self.info = SimpleNamespace(truncated_before=truncated_before, sequenced=False)
        self.views = list(views)

    async def extents(self, bk: Any, name: str, password: bytes) -> tuple[Any, list[LedgerExtent]]:
        view = self.views.pop(0) if len(self.views) > 1 else self.views[0]
        return self.info, list(view)


@contextlib.asynccontextmanager
async def _no_cluster(url: str, *, probe: bool = True) -> AsyncIterator[None]:
    yield None


def _reader(monkeypatch: pytest.MonkeyPatch, log: _Log) -> BookKeeperStreamReader:
    monkeypatch.setattr(stream, "connect", _no_cluster)
    monkeypatch.setattr(stream, "log_extents", log.extents)
    return BookKeeperStreamReader({"metadata": "etcd://127.0.0.1:2379/unused", "path": "l"})


def _planned(partitions: Sequence[Any]) -> list[tuple[int, int, int]]:
    return [(p.entries.ledger_id, p.entries.first, p.entries.last) for p in partitions]


def test_latest_on_a_log_truncated_up_to_its_empty_new_ledger_starts_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default start ("latest") when no listed ledger holds a readable entry yet (the writer
    just rolled, retention removed every ledger before the new one): at the new ledger's entry 0,
    not at (0, 0), which every later batch (and every restart) refused as truncated for good."""
    log = _Log(5, [LedgerExtent(5, -1, first_offset=40, closed=False)])
    reader = _reader(monkeypatch, log)
    start = reader.initialOffset()
    assert from_offset(start) == (P(5, 0), 40)
    assert reader.latestOffset(start, ReadAllAvailable()) == start  # nothing yet, and no error
    log.views = [[LedgerExtent(5, 2, first_offset=40, closed=False)]]  # three records appended
    end = reader.latestOffset(start, ReadAllAvailable())
    assert from_offset(end) == (P(5, 3), 43)
    assert _planned(reader.partitions(start, end)) == [(5, 0, 2)]
    # also when the listed ledgers are a closed empty one and the open one after it
    log.views = [[LedgerExtent(6, -1, first_offset=40), LedgerExtent(7, -1, first_offset=40, closed=False)]]
    log.info.truncated_before = 6
    assert from_offset(reader.initialOffset()) == (P(6, 0), 40)


def test_a_batch_holds_its_interval_though_a_later_lac_read_answers_lower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """latestOffset saw LAC 100 and Spark checkpointed [(5, 0), (5, 101)); the LAC read of
    partitions() (or of a driver replaying the batch) answers 95 (another set of bookies covered
    the ensemble): the batch still plans every entry up to 100 (the next batch starts at 101)."""
    log = _Log(
        0, [LedgerExtent(5, 100, first_offset=0, closed=False)], [LedgerExtent(5, 95, 0, closed=False)]
    )
    reader = _reader(monkeypatch, log)
    reader.max_entries = 1000
    start = {"ledger_id": 5, "entry_id": 0}
    end = reader.latestOffset(start, ReadAllAvailable())
    assert from_offset(end)[0] == P(5, 101)
    assert _planned(reader.partitions(start, end)) == [(5, 0, 100)]
    # across a roll: ledger 5 closed at 9, the batch ends in ledger 7 (LAC 3), read again as LAC 1
    log.views = [[LedgerExtent(5, 9, 0), LedgerExtent(7, 1, 10, closed=False)]]
    assert _planned(reader.partitions(start, to_offset(P(7, 4)))) == [(5, 0, 9), (7, 0, 3)]
    # and Spark's commit of that batch moves a cursor to its last record, (7, 3), not to (7, 1)
    committed: list[tuple[str, LogPosition]] = []

    async def commit_cursor(bk: Any, name: str, cursor: str, position: LogPosition) -> None:
        committed.append((cursor, position))

    monkeypatch.setattr(stream, "commit_cursor", commit_cursor)
    reader.cursor = "c"
    reader.commit(to_offset(P(7, 4)))
    assert committed == [("c", P(7, 3))]


def test_a_batch_whose_ledger_is_no_longer_listed_is_an_error() -> None:
    with pytest.raises(LogTruncated, match="ledger 7"):
        batch_extents("l", [LedgerExtent(9, 4, first_offset=20)], P(7, 3))
    assert batch_extents("l", [LedgerExtent(9, 4)], P(7, 0)) == [LedgerExtent(9, 4)]


@st.composite
def _regressed(draw: st.DrawFn, extents: list[LedgerExtent]) -> list[LedgerExtent]:
    """The same ledgers read again: an open ledger's LAC may answer lower (or it closed since, at
    its LAC or past it); a closed one never changes."""
    again = []
    for extent in extents:
        if extent.closed:
            again.append(extent)
        elif draw(st.booleans()):
            again.append(
                LedgerExtent(extent.ledger_id, draw(st.integers(-1, extent.last_entry_id)), closed=False)
            )
        else:
            last = draw(st.integers(extent.last_entry_id, extent.last_entry_id + 3))
            again.append(LedgerExtent(extent.ledger_id, last, closed=True))
    return again


@given(st.data(), _extents(), st.none() | st.integers(1, 6))
def test_a_batch_planned_again_holds_the_same_entries(
    data: st.DataObject, extents: list[LedgerExtent], limit: int | None
) -> None:
    """Whatever a later read of the log answers, the batch [start, end) chosen from an earlier one
    is planned to the same entries (every entry once across batches, none lost)."""
    start = P(0, 0)
    for _ in range(50):
        end = stable_end(extents, start, limit)
        if end == start:
            break
        chosen = plan_ranges(extents, start, end, 1000)
        again = data.draw(_regressed(extents))
        assert plan_ranges(batch_extents("l", again, end), start, end, 1000) == chosen
        start = end


def test_a_starting_position_outside_the_log_is_an_error_naming_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As for a batch read: a streaming query told to start in a ledger the log does not list
    fails at once (it would otherwise read nothing, or what it was not asked to, unseen)."""
    log = _Log(5, [LedgerExtent(5, 4, first_offset=40), LedgerExtent(7, 2, first_offset=45, closed=False)])
    reader = _reader(monkeypatch, log)
    reader.starting = P(99_999_999, 0)
    with pytest.raises(opt.SparkOptionError, match=r"startingPosition.*ledger 99999999 is not in log 'l'"):
        reader.initialOffset()
    reader.starting = P(3, 0)
    with pytest.raises(opt.SparkOptionError, match=r"startingPosition.*ledger 3 of log 'l' was truncated"):
        reader.initialOffset()
    reader.starting = P(7, 1)  # a listed ledger: taken as is
    assert from_offset(reader.initialOffset()) == (P(7, 1), 46)
