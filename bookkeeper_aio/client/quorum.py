"""Quorum arithmetic for striped ledgers: write sets, ack counting, quorum and ensemble coverage.

Pure (no I/O, no asyncio). Seeds 000/001 define the striping; seed 002 the coverage rules:

- The write set of entry ``e`` is the ``Qw`` ensemble positions starting at ``e mod E`` (wrapping).
  There are only ``E`` distinct write sets; they are precomputed.
- An entry is *acknowledged* when ``Qa`` bookies of its write set acked it.
- *Quorum coverage* (QC) of a write set: enough definite answers that no ``Qa`` bookies of the set
  are left unanswered, i.e. at least ``Qw - Qa + 1`` answers. Then no write could still reach
  ``Qa`` acks without one of the answering bookies.
- *Ensemble coverage* (EC): quorum coverage of **every** write set of the ensemble (what fencing and
  a coverage-checked LAC read need). For ``Qw == E`` that is ``E - Qa + 1`` answers.

Positions are ensemble indices (``0 .. E-1``), not bookie ids, so the same schedule serves every
fragment of a ledger. The recovery engine reuses :class:`DistributionSchedule` as is.
"""

from __future__ import annotations

from collections.abc import Iterable


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

    def has_ack_quorum(self, acked: int) -> bool:
        return acked >= self.ack_quorum

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
