"""Streaming offsets: a batch's end never passes an open ledger, and honours the row limit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bookkeeper_aio import LogPosition, LogTruncated
from bookkeeper_aio.spark.plan import EntryRange, LedgerExtent, plan_ranges
from bookkeeper_aio.spark.stream import check_not_truncated, from_offset, last_before, stable_end, to_offset

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
