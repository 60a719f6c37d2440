"""Quorum arithmetic for striped ledgers: write sets, ack counting (:class:`AckSet`), quorum and
ensemble coverage.

Pure (no I/O, no asyncio). docs/replication.md §1 defines the striping and the coverage rules:

- The write set of entry ``e`` is the ``Qw`` ensemble positions starting at ``e mod E`` (wrapping).
  There are only ``E`` distinct write sets; they are precomputed.
- An entry is *acknowledged* when ``Qa`` bookies of its write set acked it. Acks are counted in
  one place, :class:`AckSet` (the writer's pending adds and recovery's write-back are AckSets).
- *Quorum coverage* (QC) of a write set: enough definite answers that no ``Qa`` bookies of the set
  are left unanswered, i.e. at least ``Qw - Qa + 1`` answers. Then no write could still reach
  ``Qa`` acks without one of the answering bookies.
- *Ensemble coverage* (EC): quorum coverage of **every** write set of the ensemble (what fencing and
  a coverage-checked LAC read need). For ``Qw == E`` that is ``E - Qa + 1`` answers.

Positions are ensemble indices (``0 .. E-1``), not bookie ids, so the same schedule serves every
fragment of a ledger. The recovery engine reuses :class:`DistributionSchedule` as is.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TypeVar


class DistributionSchedule:
    """The striping schedule of one ledger (``E``, ``Qw``, ``Qa``)."""

    __slots__ = ("_write_sets", "ack_quorum", "ensemble_size", "write_quorum")

    def __init__(self, ensemble_size: int, write_quorum: int, ack_quorum: int) -> None:
        if not ensemble_size >= write_quorum >= ack_quorum >= 1:
            raise ValueError(
                f"need E >= Qw >= Qa >= 1, got E={ensemble_size} Qw={write_quorum} Qa={ack_quorum}"
            )
        self.ensemble_size = ensemble_size
        self.write_quorum = write_quorum
        self.ack_quorum = ack_quorum
        self._write_sets = tuple(
            tuple((start + i) % ensemble_size for i in range(write_quorum)) for start in range(ensemble_size)
        )

    @property
    def quorum_coverage(self) -> int:
        """Answers needed from one write set for quorum coverage: ``Qw - Qa + 1``."""
        return self.write_quorum - self.ack_quorum + 1

    def write_set(self, entry_id: int) -> tuple[int, ...]:
        """Ensemble positions that store ``entry_id``, in write order."""
        return self._write_sets[entry_id % self.ensemble_size]

    def write_sets(self) -> tuple[tuple[int, ...], ...]:
        """All ``E`` distinct write sets (the one starting at position ``i`` is at index ``i``)."""
        return self._write_sets

    def covers_write_set(self, entry_id: int, answered: Iterable[int]) -> bool:
        """Quorum coverage: ``answered`` (positions with a definite answer) leaves fewer than ``Qa``
        bookies of the entry's write set unanswered."""
        members = self.write_set(entry_id)
        got = set(answered)
        return sum(1 for position in members if position in got) >= self.quorum_coverage

    def covers_ensemble(self, answered: Iterable[int]) -> bool:
        """Ensemble coverage: quorum coverage of every write set of the ensemble."""
        got = set(answered)
        need = self.quorum_coverage
        return all(sum(1 for p in ws if p in got) >= need for ws in self._write_sets)

    def entries_stored_by(self, position: int, first: int, last: int) -> range | list[int]:
        """Entry ids in ``[first, last]`` whose write set includes ``position`` (for reads and
        re-replication). With ``Qw == E`` that is every entry."""
        if self.write_quorum == self.ensemble_size:
            return range(first, last + 1)
        return [e for e in range(first, last + 1) if position in self.write_set(e)]


@functools.lru_cache(maxsize=64)
def schedule_of(ensemble_size: int, write_quorum: int, ack_quorum: int) -> DistributionSchedule:
    """The schedule of (``E``, ``Qw``, ``Qa``), one shared by every ledger of that shape (it is
    never changed). Raises ValueError as :class:`DistributionSchedule` does."""
    return DistributionSchedule(ensemble_size, write_quorum, ack_quorum)


_A = TypeVar("_A", bound="AckSet")


class AckSet:
    """The bookies of one entry's write set that acked it: bit ``i`` of ``acked`` is
    ``write_set[i]`` (a bitmask: no allocation per ack on the add hot path). Subclassed by the
    per-entry state of the writer and of recovery's write-back."""

    __slots__ = ("acked", "write_set")

    def __init__(self, write_set: tuple[str, ...]) -> None:
        self.write_set = write_set
        self.acked = 0

    def ack(self, bookie_id: str) -> int:
        """Record an ack of ``bookie_id``; returns how many bookies of the write set acked, or -1
        if ``bookie_id`` is not in the write set (replaced since the send: the ack does not count)."""
        try:
            position = self.write_set.index(bookie_id)
        except ValueError:
            return -1
        acked = self.acked | (1 << position)
        self.acked = acked
        return acked.bit_count()

    @staticmethod
    def ack_each(acksets: Iterable[_A], bookie_id: str, quorum: int) -> list[_A]:
        """:meth:`ack` of ``bookie_id`` on each of ``acksets`` in one call (the acks of one
        batched answer); returns those that have ``quorum`` or more acks now, in order."""
        reached = []
        for ackset in acksets:
            try:
                position = ackset.write_set.index(bookie_id)
            except ValueError:
                continue  # replaced since the send: not counted
            acked = ackset.acked | (1 << position)
            ackset.acked = acked
            if acked.bit_count() >= quorum:
                reached.append(ackset)
        return reached

    @property
    def count(self) -> int:
        return self.acked.bit_count()

    def has_acked(self, bookie_id: str) -> bool:
        return bookie_id in self.write_set and bool(self.acked >> self.write_set.index(bookie_id) & 1)

    def move_to(self, write_set: tuple[str, ...]) -> int:
        """The entry's write set changed (an ensemble change): acks of bookies still in it move to
        their new positions, acks of replaced bookies no longer count. Returns the new count."""
        acked = 0
        for position, bookie_id in enumerate(write_set):
            if self.has_acked(bookie_id):
                acked |= 1 << position
        self.write_set = write_set
        self.acked = acked
        return acked.bit_count()
