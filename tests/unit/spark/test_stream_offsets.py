"""Streaming offsets: a batch's end never passes an open ledger, and honours the row limit."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bookkeeper_aio import LogPosition
from bookkeeper_aio.spark.plan import LedgerExtent, plan_ranges
from bookkeeper_aio.spark.stream import from_offset, last_before, stable_end, to_offset

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
    assert from_offset(to_offset(P(12, 0))) == P(12, 0)


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
