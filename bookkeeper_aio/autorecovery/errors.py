"""Errors of re-replication (each a BKError, each saying what to do next)."""

from __future__ import annotations

from bookkeeper_aio.errors import BKError


class ReplicationError(BKError):
    """Healing one ledger failed; its mark stays and a worker retries it later."""

    retriable = True


class EntryUnavailable(ReplicationError):
    """No surviving replica has an entry the fragment should hold: the copy stops and the mark stays
    (the data may be lost: bring the missing bookie back, its disk holds the only copy)."""


class NoPasswordForLedger(ReplicationError):
    """None of the daemon's passwords matches the ledger's: add it (``--password``) and restart."""

    retriable = False


class LockLost(ReplicationError):
    """The worker's replication lock is no longer held (its lease expired during a pause, maybe
    another worker took the ledger since): nothing was committed; the ledger is retried later
    under a new lock, if it is still marked."""
