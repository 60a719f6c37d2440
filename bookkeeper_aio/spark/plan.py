"""Input partitions for a read: which entries of which ledgers each Spark task reads (pure).

The driver knows, for every ledger it will read, the last entry readable now (a closed ledger's
last entry, an open one's last add confirmed). A read between two log positions, start inclusive
and end exclusive, takes each ledger's part of that interval and cuts it into ranges of at most
``max_entries`` entries: one input partition per range, never one across two ledgers, so a task
reads with one ledger handle and one run of batch reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from bookkeeper_aio import LogPosition


@dataclass(frozen=True, slots=True)
class LedgerExtent:
    """A ledger as the driver saw it: ``last_entry_id`` -1 when it holds nothing readable yet;
    ``first_offset`` the log-wide index of its entry 0, None when not known (or not a log);
    ``closed``: no entry will be added (else ``last_entry_id`` is the last add confirmed)."""

    ledger_id: int
    last_entry_id: int
    first_offset: int | None = None
    closed: bool = True


@dataclass(frozen=True, slots=True)
class EntryRange:
    """Entries ``first..last`` (inclusive) of one ledger: what one Spark task reads."""

    ledger_id: int
    first: int
    last: int
    first_offset: int | None = None

    @property
    def count(self) -> int:
        return self.last - self.first + 1


def plan_ranges(
    extents: Sequence[LedgerExtent],
    start: LogPosition | None,
    end: LogPosition | None,
    max_entries: int,
) -> list[EntryRange]:
    """The ranges holding every readable entry at a position ``>= start`` and ``< end`` (None: no
    bound), in log order, each at most ``max_entries`` long. ``extents`` in log order."""
    assert max_entries >= 1
    assert all(a.ledger_id < b.ledger_id for a, b in itertools.pairwise(extents))
    ranges: list[EntryRange] = []
    for extent in extents:
        first, last = 0, extent.last_entry_id
        if start is not None:
            if extent.ledger_id < start.ledger_id:
                continue
            if extent.ledger_id == start.ledger_id:
                first = max(first, start.entry_id)
        if end is not None:
            if extent.ledger_id > end.ledger_id:
                break
            if extent.ledger_id == end.ledger_id:
                last = min(last, end.entry_id - 1)
        for low in range(first, last + 1, max_entries):
            offset = None if extent.first_offset is None else extent.first_offset + low
            ranges.append(EntryRange(extent.ledger_id, low, min(last, low + max_entries - 1), offset))
    return ranges


def in_log_order(extents: Sequence[LedgerExtent]) -> list[LedgerExtent]:
    """The ledgers of a log a read may take, in log order: up to the first one that is not closed
    (included, to its last add confirmed). The ledgers after it wait until it is closed: a roll
    lists the next ledger before it closes the previous one, whose acknowledged appends may still
    lie beyond its LAC; reading on would hand out later records and skip those for good (as the log
    reader and ``stream.stable_end`` do)."""
    taken: list[LedgerExtent] = []
    for extent in extents:
        taken.append(extent)
        if not extent.closed:
            break
    return taken


def end_of(extents: Sequence[LedgerExtent]) -> LogPosition | None:
    """The position just past the last readable entry (exclusive end), None for no ledgers."""
    if not extents:
        return None
    last = extents[-1]
    return LogPosition(last.ledger_id, last.last_entry_id + 1)
