"""A record's position in a log: (ledger id, entry id), ordered as the log's ledger list is."""

from __future__ import annotations

from typing import NamedTuple

from bookkeeper_aio.errors import BKInterfaceError


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


_ID_MAX = 2**63 - 1


def check_position(position: object, what: str, *, entry_min: int = 0) -> None:
    """Raise BKInterfaceError unless ``position`` is a `LogPosition` of ints (not bools): a ledger
    id in ``0..2^63-1`` and an entry id in ``entry_min..2^63-1`` (-1 only where "before the
    ledger's first entry" means something: a cursor that consumed nothing of its ledger)."""
    if not isinstance(position, LogPosition):
        raise BKInterfaceError(f"{what} must be a LogPosition, got {position!r}")
    for field, value, minimum in (
        ("ledger_id", position.ledger_id, 0),
        ("entry_id", position.entry_id, entry_min),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= _ID_MAX:
            raise BKInterfaceError(f"{what}: {field} must be an int in {minimum}..2^63-1, got {value!r}")
