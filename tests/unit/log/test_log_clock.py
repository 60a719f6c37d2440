"""What a log's list records as wall-clock time comes from its `LogManager`'s clock (the ledger
manager's, so the simulation's virtual one there), never ``time.time()``."""

from __future__ import annotations

from bookkeeper_aio.log._common import taken_over
from metadata import MemoryStore
from metadata.log_manager import LogManager
from metadata.log_metadata import LogLedgerState, LogMetadata


def test_recovered_ledgers_close_at_the_time_given() -> None:
    md = LogMetadata("orders", (), 5).with_ledger_appended(7).with_ledger_appended(9)
    md = md.with_closed(7, last_entry_id=4, length=50, closed_ms=6)
    recovered = taken_over(md, {7: (4, 50), 9: (2, 20)}, 1234)
    assert [(e.state, e.closed_ms) for e in recovered.ledgers] == [
        (LogLedgerState.CLOSED, 6),  # already closed: its close time stays
        (LogLedgerState.CLOSED, 1234),
    ]


async def test_the_manager_clock_dates_the_list() -> None:
    manager = LogManager(MemoryStore(), "/bookkeeper/test", now_ms=lambda: 77)
    assert manager.now_ms() == 77
    assert (await manager.create("orders")).metadata.ctime_ms == 77
