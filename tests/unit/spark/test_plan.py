"""Input partitions: every readable entry between the positions exactly once, ranges bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bookkeeper_aio import LogPosition
from bookkeeper_aio.spark.plan import EntryRange, LedgerExtent, end_of, in_log_order, plan_ranges
from bookkeeper_aio.spark.reader import BookKeeperBatchReader

EXTENTS = [LedgerExtent(3, 9, 0), LedgerExtent(5, -1, 10), LedgerExtent(8, 4, 10)]


def test_whole_log_cut_by_size() -> None:
    assert plan_ranges(EXTENTS, None, None, 4) == [
        EntryRange(3, 0, 3, 0),
        EntryRange(3, 4, 7, 4),
        EntryRange(3, 8, 9, 8),
        EntryRange(8, 0, 3, 10),
        EntryRange(8, 4, 4, 14),
    ]


def test_start_inclusive_end_exclusive() -> None:
    assert plan_ranges(EXTENTS, LogPosition(3, 8), LogPosition(8, 2), 100) == [
        EntryRange(3, 8, 9, 8),
        EntryRange(8, 0, 1, 10),
    ]
    assert plan_ranges(EXTENTS, LogPosition(8, 0), LogPosition(8, 0), 100) == []
    assert plan_ranges(EXTENTS, LogPosition(3, 10), None, 100) == [EntryRange(8, 0, 4, 10)]


def test_unknown_offsets_stay_unknown() -> None:
    assert plan_ranges([LedgerExtent(1, 2)], None, None, 2) == [EntryRange(1, 0, 1), EntryRange(1, 2, 2)]


def test_end_of() -> None:
    assert end_of(EXTENTS) == LogPosition(8, 5)
    assert end_of([]) is None


@st.composite
def _extents(draw: st.DrawFn) -> list[LedgerExtent]:
    ids = sorted(draw(st.sets(st.integers(1, 50), max_size=6)))
    return [LedgerExtent(i, draw(st.integers(-1, 20))) for i in ids]


_positions = st.none() | st.builds(LogPosition, st.integers(0, 51), st.integers(0, 22))


@given(_extents(), _positions, _positions, st.integers(1, 7))
def test_every_entry_in_the_interval_once(
    extents: list[LedgerExtent], start: LogPosition | None, end: LogPosition | None, size: int
) -> None:
    ranges = plan_ranges(extents, start, end, size)
    planned = [LogPosition(r.ledger_id, e) for r in ranges for e in range(r.first, r.last + 1)]
    expected = [
        LogPosition(x.ledger_id, e)
        for x in extents
        for e in range(x.last_entry_id + 1)
        if (start is None or LogPosition(x.ledger_id, e) >= start)
        and (end is None or LogPosition(x.ledger_id, e) < end)
    ]
    assert planned == expected
    assert all(1 <= r.count <= size for r in ranges)


MID_ROLL = [LedgerExtent(1, 5, 0, closed=False), LedgerExtent(2, 3, None, closed=False)]
"""A roll in progress: ledger 1 still open (appends acknowledged on it may lie past its LAC 5),
ledger 2 already listed and written to."""


def _partitions(monkeypatch: pytest.MonkeyPatch, options: dict[str, str]) -> list[tuple[int, int, int]]:
    async def extents(self: BookKeeperBatchReader) -> tuple[int, bool, list[LedgerExtent]]:
        return 0, False, MID_ROLL

    monkeypatch.setattr(BookKeeperBatchReader, "_extents", extents)
    reader = BookKeeperBatchReader({"metadata": "etcd://127.0.0.1:2379/x", **options})
    return [(p.entries.ledger_id, p.entries.first, p.entries.last) for p in reader.partitions()]  # type: ignore[attr-defined]


def test_a_batch_read_of_a_log_stops_at_its_first_open_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning past ledger 1 would hand out (2, 0..3) and leave out ledger 1's acknowledged tail:
    a consumer resuming after its highest position would lose it for good."""
    assert in_log_order(MID_ROLL) == MID_ROLL[:1]
    assert in_log_order(EXTENTS) == EXTENTS
    assert _partitions(monkeypatch, {"path": "lg"}) == [(1, 0, 5)]
    ending = '{"ledger_id": 2, "entry_id": 2}'
    assert _partitions(monkeypatch, {"path": "lg", "endingposition": ending}) == [(1, 0, 5)]
    # explicit ledgers are not a log: each is read to its LAC
    assert _partitions(monkeypatch, {"ledgers": "1,2"}) == [(1, 0, 5), (2, 0, 3)]
