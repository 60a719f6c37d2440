"""The metadata error model: one root, one class per outcome a caller must tell apart.

Rules:
- Every store operation raises only subclasses of `MetadataError` (plus `ValueError` subclasses for
  misuse, e.g. an invalid `LedgerMetadata`).
- `retriable` says whether repeating the same call may succeed without changing its arguments.
- `CasResultUnknown` is neither success nor failure: the mutation may or may not have been applied
  (the connection was lost after the request was sent). Callers re-read to find out.
"""

from __future__ import annotations

from bookkeeper_aio.common import failpoints
from bookkeeper_aio.errors import BKError


class MetadataError(BKError):
    """Root of every error raised by the metadata package (a `BKError`, like every error we raise)."""


class MetadataUnavailable(MetadataError):
    """The store could not be reached (or had no quorum) within the operation's time budget.

    A mutation that raises this was never applied (the request was not sent, or the server answered
    that it did not apply it). When that cannot be known, `CasResultUnknown` is raised instead.
    """

    retriable = True


class CasResultUnknown(MetadataError):
    """A conditional write was sent but its outcome was lost: it may or may not have been applied."""

    retriable = False

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"outcome of the write to {key!r} is unknown: {message}")
        self.key = key


class LedgerCreateUnknown(CasResultUnknown):
    """A ledger's create was sent, its answer lost, and reading the ledger back failed as well for
    the whole budget: ledger ``ledger_id`` may exist (OPEN, no writer). The client deletes it once
    metadata answers, if nobody touched it (`BookKeeper.create_ledger`)."""

    def __init__(self, key: str, ledger_id: int, value: bytes, message: str) -> None:
        super().__init__(key, f"ledger {ledger_id} may have been created: {message}")
        self.ledger_id = ledger_id
        self.value = value
        """What the create wrote: the ledger is discarded only while it still holds exactly this."""


class BadVersion(MetadataError):
    """A compare-and-set found a different version than expected (someone else wrote first)."""

    def __init__(self, key: str, expected: int, actual: int | None) -> None:
        super().__init__(f"bad version for {key!r}: expected {expected}, found {actual}")
        self.key = key
        self.expected = expected
        self.actual = actual


class GuardFailed(MetadataError):
    """A guarded write (``guards=`` of ``compare_and_set`` / ``delete``) found a guard key gone or
    at another version: the authority the caller held when it decided (a lock bound to its lease)
    is lost, so nothing was written. Not retriable: re-take the authority first."""

    def __init__(self, key: str, guard: str, expected: int, actual: int | None) -> None:
        found = "gone" if actual is None else f"at version {actual}"
        super().__init__(
            f"write to {key!r} refused: its guard {guard!r} is {found}, not at version {expected}"
        )
        self.key = key
        self.guard = guard
        self.expected = expected
        self.actual = actual


class NodeExists(MetadataError):
    """A create found the key already present."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key already exists: {key!r}")
        self.key = key


class NoNode(MetadataError):
    """The key does not exist."""

    def __init__(self, key: str, what: str = "key") -> None:
        super().__init__(f"no such {what}: {key!r}")
        self.key = key


class NoSuchLedger(NoNode):
    """The ledger's metadata does not exist (never created, or deleted)."""

    def __init__(self, ledger_id: int, key: str) -> None:
        super().__init__(key, what=f"ledger {ledger_id}")
        self.ledger_id = ledger_id


class LeaseExpired(MetadataError):
    """The lease is gone (expired or revoked); keys bound to it were deleted by the store."""

    def __init__(self, lease_id: int) -> None:
        super().__init__(f"lease {lease_id:#x} expired or was revoked")
        self.lease_id = lease_id


class WatchCompacted(MetadataError):
    """A watch could not resume: the revisions it needs were compacted away. Re-read, then re-watch."""

    def __init__(self, key: str, compact_revision: int) -> None:
        super().__init__(
            f"watch on {key!r} cannot resume: history compacted up to revision {compact_revision}"
        )
        self.key = key
        self.compact_revision = compact_revision


class MetadataFormatError(MetadataError):
    """A stored value is not in a format we understand (garbage, or written by a newer version)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"cannot decode {key!r}: {message}")
        self.key = key


class UpdateRetriesExhausted(MetadataError):
    """A read-modify-write loop lost the CAS race more times than its bound allows."""

    retriable = True

    def __init__(self, key: str, attempts: int) -> None:
        super().__init__(f"gave up updating {key!r} after {attempts} conflicting attempts")
        self.key = key
        self.attempts = attempts


class InvalidMetadata(MetadataError, ValueError):
    """A value violates the model's invariants (e.g. E < Qw); a programming error of the caller."""


class InvalidUrl(MetadataError, ValueError):
    """A metadata service URL could not be parsed."""


def _injected_unavailable(name: str, key: str) -> MetadataUnavailable:
    return MetadataUnavailable(f"failpoint {name}: injected unavailability writing {key!r}")


def _injected_unknown(name: str, key: str) -> CasResultUnknown:
    return CasResultUnknown(key, f"failpoint {name}: injected lost answer")


failpoints.register_error("unavailable", _injected_unavailable)
failpoints.register_error("unknown", _injected_unknown)
