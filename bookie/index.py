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
``base``), or one that would leave the arrays sparser than one entry in :data:`DENSITY_MIN` slots
(past :data:`SPARSE_SLOTS_MAX`), goes to a small overflow dict, so hostile ids cannot make us
allocate huge arrays: ids each 65,535 past the last made them grow by half at every add (25 adds of
100 bytes: 16 GiB, kept by checkpoints and replay); now they hold at most 16 slots per entry.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from itertools import islice
from operator import lt as _lt
from typing import NamedTuple

DENSE_GAP_MAX = 1 << 16
"""How far past the dense range an entry id may land and still grow the arrays (holes cost 12 B)."""
DENSITY_MIN = 16
"""The arrays hold at most this many slots per entry held (a bookie of a striped ledger holds one
entry in E/Qw: 16 admits E = 16 with Qw = 1)."""
SPARSE_SLOTS_MAX = 1024
"""Below this many slots the arrays may be as sparse as they like (12 KiB)."""
_OFFSET_BITS = 32
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
SEGMENT_OFFSET_MAX = _OFFSET_MASK
"""Offsets within a segment must fit in 32 bits: segments are at most 4 GiB."""


_LITTLE = sys.byteorder == "little"
_ABSENT = array("q", [-1] * 1024)
_NO_POSITIONS = array("q")
_NO_LENGTHS = array("i")
_NO_OVERFLOW: dict[int, tuple[int, int, int]] = {}
"""What an index that holds no entry shares with every other (most ledgers of a bookie with many
hold none: 224 bytes saved on each). Never changed in place: the first insert replaces them."""


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


def _rising(ids: list[int]) -> bool:
    """Whether ``ids`` rise strictly, each compare in C (no Python step per id)."""
    return all(map(_lt, ids, islice(ids, 1, None)))


class LedgerIndex:
    """Entry locations of one ledger, plus the highest entry id seen (``last_entry_id``: no entry
    above it is held, which :meth:`put_run` relies on)."""

    __slots__ = ("_base", "_lengths", "_overflow", "_positions", "count", "last_entry_id")

    def __init__(self) -> None:
        self._base = -1  # entry id of slot 0, fixed by the first insert
        self._positions = _NO_POSITIONS
        self._lengths = _NO_LENGTHS
        self._overflow = _NO_OVERFLOW
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
        if (
            entry_ids
            and not overflow
            and (first := entry_ids[0]) > last
            and first >= base
            and (top := entry_ids[-1]) - base < size
            and _rising(entry_ids)
        ):
            # A writer's run: rising, all past the last entry held (so all absent: each one is new)
            # and inside the dense range, with no overflow. No test per entry; the stores go
            # through memoryviews (released before anything can resize the arrays): an array's
            # own item store parses its value with PyArg_Parse, ~150 instructions more (callgrind).
            with memoryview(positions) as positions_view, memoryview(lengths_at) as lengths_view:
                for entry_id, length in zip(entry_ids, lengths, strict=True):
                    slot = entry_id - base
                    positions_view[slot] = position
                    lengths_view[slot] = length
                    position += length
            self.count += len(entry_ids)
            self.last_entry_id = top
            return
        if entry_ids and not overflow and min(entry_ids) >= base and (top := max(entry_ids)) - base < size:
            # Every slot inside the dense range and no overflow (most runs: the arrays grow by half):
            # the fast case below without its tests per entry.
            for entry_id, length in zip(entry_ids, lengths, strict=True):
                slot = entry_id - base
                if positions[slot] < 0:
                    added += 1
                positions[slot] = position
                lengths_at[slot] = length
                position += length
            self.count += added
            if top > last:
                self.last_entry_id = top
            return
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
        dense_max = max(SPARSE_SLOTS_MAX, (self.count + 1) * DENSITY_MIN)
        if 0 <= gap <= DENSE_GAP_MAX and slot < dense_max:
            if not size:  # the shared empty arrays: this index gets its own
                self._positions, self._lengths = array("q"), array("i")
            # amortised (it grows by half, within the density bound): appends land on the fast path
            grow = max(gap + 1, min(size // 2, dense_max - size), 16)
            self._positions.extend(_ABSENT * (grow // len(_ABSENT) + 1))
            del self._positions[size + grow :]
            self._lengths.extend(array("i", bytes(4 * grow)))
            self.put(entry_id, segment_id, offset, length)
            return
        if self._overflow is _NO_OVERFLOW:
            self._overflow = {}
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
            if -1 in found:  # stop before the first absent slot (none: the run is the whole slice)
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

    def snapshot(self) -> tuple[int, array, array, array]:  # type: ignore[type-arg]
        """``(base, positions, lengths, overflow)`` for a checkpoint (bookie/checkpoint.py): the
        dense arrays themselves (not copies: read them before the index changes again) and the
        overflow as a flat int64 array of (entry id, segment id, offset, length), by entry id."""
        overflow = array("q")
        for entry_id, (segment_id, offset, length) in sorted(self._overflow.items()):
            overflow.extend((entry_id, segment_id, offset, length))
        return self._base, self._positions, self._lengths, overflow

    @classmethod
    def from_arrays(
        cls,
        base: int,
        positions: array | None,  # type: ignore[type-arg]
        lengths: array | None,  # type: ignore[type-arg]
        overflow: array | None,  # type: ignore[type-arg]
        last_entry_id: int,
    ) -> LedgerIndex:
        """Inverse of :meth:`snapshot` (None for an empty array); the arrays are taken over, not
        copied. Raises ValueError on arrays that cannot be an index."""
        index = cls()
        index._base = base
        index.last_entry_id = last_entry_id
        if positions or lengths:
            if positions is None or lengths is None or positions.typecode != "q" or lengths.typecode != "i":
                raise ValueError("index snapshot arrays have the wrong types")
            if len(positions) != len(lengths):
                raise ValueError("index snapshot arrays differ in length")
            index._positions, index._lengths = positions, lengths
            index.count = len(positions) - positions.count(-1)
        if overflow:
            if len(overflow) % 4:
                raise ValueError("index snapshot overflow is not whole (entry, segment, offset, length) rows")
            index._overflow = {
                overflow[i]: (overflow[i + 1], overflow[i + 2], overflow[i + 3])
                for i in range(0, len(overflow), 4)
            }
            index.count += len(index._overflow)
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

    def segment_ids(self) -> set[int]:
        """The journal segments this ledger's entries lie in. The dense range is read as the high
        halves of its positions (absent slots give -1), in C: no Python step per entry (a restart
        checks this for every ledger)."""
        ids: set[int] = set()
        if self._positions:
            halves = memoryview(self._positions).cast("B").cast("i")
            ids.update(halves[1::2] if _LITTLE else halves[0::2])
            ids.discard(-1)
        ids.update(segment_id for segment_id, _, _ in self._overflow.values())
        return ids

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
