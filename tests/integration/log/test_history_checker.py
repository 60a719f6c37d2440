"""The log history checker (tests/harness/log_history.py) catches each violation it claims to: fed
hand-made histories and reads (no cluster), it must flag every planted fault and pass a clean run.
The acceptance runs rely on it, so a checker that cannot fail would make them prove nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bookkeeper_aio.log.position import LogPosition, LogRecord
from metadata.log_metadata import LogLedger, LogLedgerState, LogMetadata
from tests.harness.log_history import AppendRecord, LogHistory, Outcome, latest_rows, value_of

OPEN, CLOSED = LogLedgerState.OPEN, LogLedgerState.CLOSED


def _history() -> tuple[LogHistory, list[LogRecord]]:
    """A clean run: writer a in ledger 1 (0..2), b takes over in ledger 2 (0..1); a's third append
    was in flight (indeterminate, it made it), a fourth failed before sending."""
    history = LogHistory()
    rows = [
        AppendRecord("a", 0, Outcome.OK, LogPosition(1, 0)),
        AppendRecord("a", 1, Outcome.OK, LogPosition(1, 1)),
        AppendRecord("a", 2, Outcome.INDETERMINATE),
        AppendRecord("a", 3, Outcome.FAIL),
        AppendRecord("b", 0, Outcome.OK, LogPosition(2, 0)),
        AppendRecord("b", 1, Outcome.OK, LogPosition(2, 1)),
    ]
    history.extend(rows)
    for ledgers in ([(1, OPEN)], [(1, CLOSED), (2, OPEN)], [(1, CLOSED), (2, CLOSED)]):
        history.sample(LogMetadata("t", tuple(LogLedger(i, s) for i, s in ledgers)))
    read = [
        LogRecord(LogPosition(1, 0), value_of("a", 0)),
        LogRecord(LogPosition(1, 1), value_of("a", 1)),
        LogRecord(LogPosition(1, 2), value_of("a", 2)),
        LogRecord(LogPosition(2, 0), value_of("b", 0)),
        LogRecord(LogPosition(2, 1), value_of("b", 1)),
    ]
    return history, read


def _violations(history: LogHistory, read: list[LogRecord], **kwargs: int) -> list[str]:
    return history.check(read, **kwargs).violations


def test_a_clean_run_passes() -> None:
    history, read = _history()
    result = history.check(read)
    assert result.ok, result.summary()
    assert (result.acked, result.failed, result.indeterminate, result.indeterminate_read) == (4, 1, 1, 1)
    assert (result.open_max_seen, result.ledgers) == (1, 2)


def _moved(r: list[LogRecord]) -> list[LogRecord]:  # a-0 and a-1 swapped places
    return [r[1]._replace(position=LogPosition(1, 0)), r[0]._replace(position=LogPosition(1, 1)), *r[2:]]


def _writer_order(r: list[LogRecord]) -> list[LogRecord]:  # b-1 before b-0 (positions in order)
    return [*r[:3], r[4]._replace(position=LogPosition(2, 0)), r[3]._replace(position=LogPosition(2, 1))]


def test_each_planted_fault_is_flagged() -> None:
    faults: dict[str, Callable[[list[LogRecord]], list[LogRecord]]] = {
        "lost": lambda r: [r[0], *r[2:]],  # an acked record missing
        "read twice": lambda r: [*r[:2], r[1], *r[2:]],
        "never appended": lambda r: [*r, LogRecord(LogPosition(2, 2), b"ghost-0")],
        "failed but read": lambda r: [*r, LogRecord(LogPosition(2, 2), value_of("a", 3))],
        "moved": _moved,
        "out of order": lambda r: [r[1], r[0], *r[2:]],
        "writer order": _writer_order,
        "unlisted ledger": lambda r: [*r[:4], r[4]._replace(position=LogPosition(3, 0))],
    }
    for what, plant in faults.items():
        history, read = _history()
        assert _violations(history, plant(read)), what


def _samples(*lists: list[tuple[int, LogLedgerState]]) -> LogHistory:
    """Raw samples: LogMetadata itself refuses some of these lists (ids must grow)."""
    history = LogHistory()
    history.samples.extend(tuple(ledgers) for ledgers in lists)
    return history


def test_list_faults_are_flagged() -> None:
    two_open = _samples([(1, OPEN)], [(1, OPEN), (2, OPEN)], [(1, CLOSED), (2, OPEN)])
    assert any("2 OPEN" in v for v in _violations(two_open, []))  # open_max=1
    assert not _violations(two_open, [], open_max=2)  # a roll under way
    reordered = _samples([(1, CLOSED), (2, OPEN)], [(2, OPEN), (1, CLOSED)])
    assert any("grown at its end" in v for v in _violations(reordered, [], open_max=2))
    inserted = _samples([(1, CLOSED), (3, OPEN)], [(1, CLOSED), (2, CLOSED), (3, OPEN)])
    assert any("grown at its end" in v for v in _violations(inserted, []))
    truncated = _samples([(1, CLOSED), (2, CLOSED), (3, OPEN)], [(3, OPEN)], [(3, CLOSED), (4, OPEN)])
    assert not _violations(truncated, [])  # dropped at the front, grown at the end
    reopened = _samples([(1, CLOSED), (2, OPEN)], [(1, OPEN), (2, OPEN)])
    found = _violations(reopened, [], open_max=2)
    assert any("OPEN again" in v for v in found)
    gap = _samples([(1, OPEN), (2, CLOSED)])
    assert any("OPEN ledger before a CLOSED" in v for v in _violations(gap, []))


def test_truncated_acks_are_exempt_and_only_those() -> None:
    history, read = _history()
    history.sample(LogMetadata("t", (LogLedger(2, CLOSED),), truncated_before=2))  # ledger 1 cut
    assert not _violations(history, read[3:], truncated_before=2)
    assert _violations(history, read[4:], truncated_before=2)  # b-0 in ledger 2 is still required


def test_latest_rows_keeps_the_last_row_of_each_append() -> None:
    started = AppendRecord("k", 7, Outcome.INDETERMINATE)
    done = AppendRecord("k", 7, Outcome.OK, LogPosition(4, 2))
    other = AppendRecord("k", 8, Outcome.INDETERMINATE)
    rows = latest_rows("\n".join(r.to_json() for r in (started, other, done)) + "\n")
    assert rows == [done, other]


def test_latest_rows_leaves_out_a_last_row_cut_short() -> None:
    started = AppendRecord("k", 7, Outcome.INDETERMINATE)
    done = AppendRecord("k", 7, Outcome.OK, LogPosition(4, 2))
    cut = done.to_json()[:20]  # read while the worker wrote it, or killed mid-write
    assert latest_rows(started.to_json() + "\n" + cut) == [started]
    with pytest.raises(ValueError):  # a damaged row before the last is the checker's business
        latest_rows(cut + "\n" + started.to_json() + "\n")
