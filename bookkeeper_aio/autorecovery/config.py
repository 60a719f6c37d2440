"""The autorecovery daemon's configuration: one frozen dataclass, every duration in seconds.

Defaults suit a production cluster (Apache BookKeeper's: a lost bookie is re-replicated after a
delay, an open ledger's last fragment after a 30 s grace, every ledger checked once a day); the
sandbox and the tests pass shorter ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from bookkeeper_aio.errors import BKInterfaceError


@dataclass(frozen=True, slots=True)
class AutorecoveryConfig:
    lost_bookie_recovery_delay_s: float = 30.0
    """A bookie unregistered this long is lost: every ledger with a fragment on it is marked. Short
    enough to heal soon, long enough that a restart (or a GC pause past the lease) is not a loss."""
    open_ledger_grace_s: float = 30.0
    """An OPEN ledger's last fragment on a missing bookie is left to its writer (whose next add
    replaces the bookie) this long after the mark; then the ledger is fenced and recovered."""
    audit_interval_s: float = 1.0
    """How often the auditor compares known bookies with registered ones."""
    check_interval_s: float = 86_400.0
    """The periodic check of every ledger (first/last entry of each fragment on each replica);
    0 disables it."""
    workers: int = 2
    """Replication workers in this daemon (each heals one ledger at a time)."""
    worker_idle_poll_s: float = 1.0
    """An idle worker looks for marks this often (and at once when a mark is written)."""
    ledger_retry_s: float = 5.0
    """A ledger whose healing failed is retried by this worker no sooner than this."""
    lease_ttl_s: int = 10
    """The daemon's lease (its locks and status), and the auditor election's lease."""
    copy_window: int = 64
    """Entries of one fragment being copied at once (read from a survivor, written to the
    replacement)."""
    copy_bytes_per_s: float = 0.0
    """Bytes per second a daemon's workers copy at most, together (0: as fast as the replacement
    takes them). A limit keeps foreground adds on the replacement bookies at their latency."""
    check_window: int = 32
    """Replica reads in flight for the periodic check."""
    passwords: tuple[bytes, ...] = (b"",)
    """Passwords the workers may use: a ledger's is the one whose hash its metadata stores (the
    master key a replacement bookie needs, and the fence of an open ledger, derive from it)."""
    status_interval_s: float = 2.0
    """How often the daemon publishes its status and metrics to metadata."""

    def __post_init__(self) -> None:
        checks = {
            "lost_bookie_recovery_delay_s": self.lost_bookie_recovery_delay_s >= 0,
            "open_ledger_grace_s": self.open_ledger_grace_s >= 0,
            "audit_interval_s": self.audit_interval_s > 0,
            "check_interval_s": self.check_interval_s >= 0,
            "workers": self.workers >= 0,
            "worker_idle_poll_s": self.worker_idle_poll_s > 0,
            "ledger_retry_s": self.ledger_retry_s >= 0,
            "lease_ttl_s": 2 <= self.lease_ttl_s <= 3600,
            "copy_window": self.copy_window >= 1,
            "check_window": self.check_window >= 1,
            "copy_bytes_per_s": self.copy_bytes_per_s >= 0,
            "passwords": len(self.passwords) >= 1,
            "status_interval_s": self.status_interval_s > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = {name: getattr(self, name) for name in bad}
            raise BKInterfaceError(
                f"bad autorecovery configuration {values}: durations must be >= 0 (intervals > 0), "
                "lease_ttl_s in [2, 3600], windows >= 1, at least one password"
            )
