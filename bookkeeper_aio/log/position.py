"""A record's position in a log: (ledger id, entry id), ordered as the log's ledger list is."""

from __future__ import annotations

from typing import NamedTuple


class LogPosition(NamedTuple):
    """Where an append landed. Ledger ids grow along a log's list, so tuple order is log order."""

    ledger_id: int
    entry_id: int


class LogRecord(NamedTuple):
    position: LogPosition
    payload: bytes
