"""A record's position in a log: (ledger id, entry id), ordered as the log's ledger list is."""

from __future__ import annotations

from typing import NamedTuple


class LogPosition(NamedTuple):
    """Where an append landed. Ledger ids grow along a log's list, so tuple order is log order."""

    ledger_id: int
    entry_id: int


class LogRecord(NamedTuple):
    """A record as a reader hands it out; ``sequence`` is the writer-supplied number of a
    sequenced log (None otherwise)."""

    position: LogPosition
    payload: bytes
    sequence: int | None = None
