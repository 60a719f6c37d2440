"""Per-ledger index: entry id -> where the entry's journal record lives.

A location is ``(segment_id, offset, length)`` of the whole journal record (header included), so a
read can verify the record's CRC before handing the entry out. The index only ever holds entries
whose records are durable: the journal's completion callback inserts them.

Storage: entry ids of a ledger on one bookie are dense (consecutive, or every E/Qw-th with striping),
so locations live in two flat arrays indexed by ``entry_id - base``: ``segment_id << 32 | offset``
(int64, -1 = absent) and the record length (int32). 12 bytes per entry instead of ~150 for a dict
of tuples, and, more important, arrays hold no Python objects: the cyclic GC never walks them (a
dict of tuples made full collections take 25-65 ms at 500k entries, which was the add path's p99).
An entry id far from the dense range (more than :data:`DENSE_GAP_MAX` past its end, or below
``base``) goes to a small overflow dict, so a hostile id cannot make us allocate a huge array.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple

DENSE_GAP_MAX = 1 << 16
"""How far past the dense range an entry id may land and still grow the arrays (holes cost 12 B)."""
_OFFSET_BITS = 32
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
SEGMENT_OFFSET_MAX = _OFFSET_MASK
"""Offsets within a segment must fit in 32 bits: segments are at most 4 GiB."""


_ABSENT = array("q", [-1] * 1024)


class Location(NamedTuple):
    segment_id: int
    offset: int
    length: int


def split_position(position: int) -> tuple[int, int]:
    """``(segment_id, offset)`` of a position as :meth:`LedgerIndex.run` gives it."""
    return position >> _OFFSET_BITS, position & _OFFSET_MASK


def segment_position(segment_id: int, offset: int) -> int:
    """The position of ``offset`` in segment ``segment_id``: positions of one segment compare as
    their offsets do, and lie below those of the next segment."""
    return segment_id << _OFFSET_BITS | offset


class LedgerIndex:
    """Entry locations of one ledger, plus the highest entry id seen."""

    __slots__ = ("_base", "_lengths", "_overflow", "_positions", "count", "last_entry_id")

    def __init__(self) -> None:
        self._base = -1  # entry id of slot 0, fixed by the first insert
        self._positions = array("q")
        self._lengths = array("i")
        self._overflow: dict[int, tuple[int, int, int]] = {}
        self.count = 0
        self.last_entry_id = -1

    def __len__(self) -> int:
        return self.count

    def put(self, entry_id: int, segment_id: int, offset: int, length: int) -> None:
        """Insert or replace (a rewritten entry, e.g. by recovery, points at its newest copy)."""
        slot = entry_id - self._base
        positions = self._positions
        if 0 <= slot < len(positions):
            # An entry lives in exactly one place: one that went to the overflow before the arrays
            # grew over its id moves into them now.
            if positions[slot] < 0 and (not self._overflow or self._overflow.pop(entry_id, None) is None):
                self.count += 1
            positions[slot] = segment_id << _OFFSET_BITS | offset
            self._lengths[slot] = length
        else:
            self._put_slow(entry_id, segment_id, offset, length)
        if entry_id > self.last_entry_id:
            self.last_entry_id = entry_id

    def put_run(self, segment_id: int, offset: int, entry_ids: list[int], lengths: list[int]) -> None:
        """:meth:`put` for records that lie back to back in segment ``segment_id`` from ``offset``,
        of ``lengths``, holding ``entry_ids``: a journal group's adds of this ledger, inserted in
        one loop instead of a call each."""
        positions = self._positions
        lengths_at = self._lengths
        base = self._base
        size = len(positions)
        overflow = self._overflow
        last = self.last_entry_id
        position = segment_id << _OFFSET_BITS | offset
        added = 0
        for entry_id, length in zip(entry_ids, lengths, strict=True):
            slot = entry_id - base
            if 0 <= slot < size and (not overflow or positions[slot] >= 0):
                # The fast case of put(): inside the dense range, and no overflow copy to move.
                if positions[slot] < 0:
                    added += 1
                positions[slot] = position
                lengths_at[slot] = length
                if entry_id > last:
                    last = entry_id
            else:
                self.count += added
                self.last_entry_id = last
                added = 0
                self.put(entry_id, segment_id, position & _OFFSET_MASK, length)
                positions, lengths_at, base = self._positions, self._lengths, self._base  # may have grown
                size = len(positions)
                last = self.last_entry_id
            position += length
        self.count += added
        self.last_entry_id = last

    def _put_slow(self, entry_id: int, segment_id: int, offset: int, length: int) -> None:
        if self._base < 0 and not self._overflow:
            self._base = entry_id
        slot = entry_id - self._base
        size = len(self._positions)
        gap = slot - size
        if 0 <= gap <= DENSE_GAP_MAX:
            grow = max(gap + 1, size // 2, 1024)  # amortised: appends mostly land on the fast path
            self._positions.extend(_ABSENT * (grow // len(_ABSENT) + 1))
            del self._positions[size + grow :]
            self._lengths.extend(array("i", bytes(4 * grow)))
            self.put(entry_id, segment_id, offset, length)
            return
        if entry_id not in self._overflow:
            self.count += 1
        self._overflow[entry_id] = (segment_id, offset, length)

    def __contains__(self, entry_id: int) -> bool:
        slot = entry_id - self._base
        if 0 <= slot < len(self._positions) and self._positions[slot] >= 0:
            return True
        return entry_id in self._overflow

    def get(self, entry_id: int) -> Location | None:
        slot = entry_id - self._base
        if 0 <= slot < len(self._positions):
            position = self._positions[slot]
            if position >= 0:
                return Location(position >> _OFFSET_BITS, position & _OFFSET_MASK, self._lengths[slot])
        found = self._overflow.get(entry_id)
        return None if found is None else Location._make(found)

    def run(self, first: int, count_max: int, step: int = 1) -> tuple[Sequence[int], Sequence[int]]:
        """Where entries ``first``, ``first + step``, ... lie, up to ``count_max`` of them and
        stopping before the first one absent: ``(positions, lengths)``, a position being
        ``segment_id << 32 | offset`` (:func:`split_position`). What a batch read asks; in the dense
        range it is two array slices (C), with no object per entry."""
        slot = first - self._base
        positions = self._positions
        if not self._overflow and 0 <= slot < len(positions):
            stop = slot + count_max * step
            found = positions[slot:stop:step]
            with contextlib.suppress(ValueError):  # no absent slot: the run is the whole slice
                del found[found.index(-1) :]
            return found, self._lengths[slot : slot + len(found) * step : step]
        found_list: list[int] = []
        lengths: list[int] = []
        for entry_id in range(first, first + count_max * step, step):
            location = self.get(entry_id)
            if location is None:
                break
            found_list.append(location.segment_id << _OFFSET_BITS | location.offset)
            lengths.append(location.length)
        return found_list, lengths

    def entry_ids(self) -> list[int]:
        base = self._base
        dense = [base + slot for slot, position in enumerate(self._positions) if position >= 0]
        if not self._overflow:
            return dense
        return sorted(dense + list(self._overflow))  # disjoint: put() keeps each id in one place

    def to_wire(self) -> list[object]:
        """A compact, msgpack-able snapshot (arrays as raw bytes: O(n) in C, no per-entry objects)."""
        overflow = sorted(self._overflow.items())
        return [
            self._base,
            self._positions.tobytes(),
            self._lengths.tobytes(),
            [entry_id for entry_id, _ in overflow],
            [list(location) for _, location in overflow],
        ]

    @classmethod
    def from_wire(cls, fields: list[object], last_entry_id: int) -> LedgerIndex:
        """Inverse of :meth:`to_wire`; raises ValueError/TypeError on malformed input."""
        base, positions, lengths, overflow_ids, overflow_locations = fields
        if not (isinstance(base, int) and isinstance(positions, bytes) and isinstance(lengths, bytes)):
            raise TypeError("index snapshot has wrong field types")
        if not (isinstance(overflow_ids, list) and isinstance(overflow_locations, list)):
            raise TypeError("index snapshot has wrong overflow types")
        index = cls()
        index._base = base
        index._positions.frombytes(positions)
        index._lengths.frombytes(lengths)
        if len(index._positions) != len(index._lengths):
            raise ValueError("index snapshot arrays differ in length")
        for entry_id, location in zip(overflow_ids, overflow_locations, strict=True):
            segment_id, offset, length = location
            index._overflow[int(entry_id)] = (int(segment_id), int(offset), int(length))
        index.count = sum(1 for position in index._positions if position >= 0) + len(index._overflow)
        index.last_entry_id = last_entry_id
        return index

    @property
    def slots(self) -> int:
        """Size of the dense range (for callers that walk it in steps: :meth:`segment_bytes`)."""
        return len(self._positions)

    def segment_bytes(self, counts: dict[int, int], start: int = 0, stop: int | None = None) -> None:
        """Add the record bytes this ledger holds in each segment to ``counts`` (segment id ->
        bytes), for dense slots ``[start, stop)``; the overflow entries count with ``start == 0``.
        Bookie GC walks big ledgers in steps so the event loop is never held for long."""
        positions = self._positions
        end = len(positions) if stop is None else min(stop, len(positions))
        get = counts.get
        for position, length in zip(positions[start:end], self._lengths[start:end], strict=True):
            if position >= 0:
                segment_id = position >> _OFFSET_BITS
                counts[segment_id] = get(segment_id, 0) + length
        if start == 0:
            for segment_id, _, length in self._overflow.values():
                counts[segment_id] = get(segment_id, 0) + length

    def in_segments(
        self, segment_ids: frozenset[int], start: int = 0, stop: int | None = None
    ) -> list[tuple[int, Location]]:
        """``(entry id, location)`` of the entries whose record lies in one of ``segment_ids``,
        among dense slots ``[start, stop)`` (and the overflow with ``start == 0``)."""
        positions = self._positions
        lengths = self._lengths
        end = len(positions) if stop is None else min(stop, len(positions))
        base = self._base
        out = []
        for slot in range(start, end):
            position = positions[slot]
            if position >= 0 and (segment_id := position >> _OFFSET_BITS) in segment_ids:
                out.append((base + slot, Location(segment_id, position & _OFFSET_MASK, lengths[slot])))
        if start == 0:
            out += [
                (entry_id, Location._make(found))
                for entry_id, found in self._overflow.items()
                if found[0] in segment_ids
            ]
        return out

    def items(self) -> list[tuple[int, Location]]:
        out = []
        for entry_id in self.entry_ids():
            location = self.get(entry_id)
            assert location is not None
            out.append((entry_id, location))
        return out
