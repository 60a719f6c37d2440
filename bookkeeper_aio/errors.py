"""One error model for the client (STYLE habit 5).

``BKError`` is the root. Every wire status has exactly one class, registered by its code;
:func:`error_for_status` is the only mapping from a status to an exception. ``retriable`` says
whether the same operation may succeed when tried again (after backoff, another replica or a new
ensemble). Misuse of the API is :class:`BKInterfaceError` (also a ``ValueError``); a broken
invariant inside the library is :class:`BKInternalError`.
"""

from __future__ import annotations

from typing import ClassVar

from bookkeeper_aio.protocol.codes import StatusCode


class BKError(Exception):
    """Root of every error bookkeeper-aio raises on purpose."""

    code: ClassVar[int | None] = None
    retriable: ClassVar[bool] = False


_BY_CODE: dict[int, type[BKError]] = {}


def _register(cls: type[BKError]) -> type[BKError]:
    code = cls.__dict__.get("code")
    if code is None:
        raise TypeError(f"{cls.__name__} has no status code")
    if code in _BY_CODE:
        raise TypeError(f"status {code} registered twice: {_BY_CODE[code].__name__} and {cls.__name__}")
    _BY_CODE[code] = cls
    return cls


class BKInterfaceError(BKError, ValueError):
    """The API was called wrongly (bad arguments, wrong state): fix the calling code."""


class BKInternalError(BKError):
    """An invariant of the library itself broke: a bug, please report it with the log."""


class BKIllegalOperation(BKError):
    """The operation is not allowed in the ledger's current state (e.g. add on a closed handle)."""


# ---------------------------------------------------------------- one class per wire status
@_register
class NoSuchLedger(BKError):
    code = int(StatusCode.ENOLEDGER)


@_register
class NoSuchEntry(BKError):
    code = int(StatusCode.ENOENTRY)


@_register
class BadRequest(BKError):
    code = int(StatusCode.EBADREQ)


@_register
class BookieIOError(BKError):
    code = int(StatusCode.EIO)
    retriable = True


@_register
class Unauthorized(BKError):
    """Wrong ledger password (the bookie's master key check failed)."""

    code = int(StatusCode.EUA)


@_register
class ProtocolVersionMismatch(BKError):
    code = int(StatusCode.EBADVERSION)


@_register
class LedgerFenced(BKError):
    """The ledger was fenced by a recovering reader. For an add this is like a timeout: the entry
    may or may not be in the ledger; only the recovered ledger's last entry tells."""

    code = int(StatusCode.EFENCED)


@_register
class BookieReadOnly(BKError):
    code = int(StatusCode.EREADONLY)
    retriable = True


@_register
class TooManyRequests(BKError):
    code = int(StatusCode.ETOOMANYREQUESTS)
    retriable = True


@_register
class UnknownLedgerState(BKError):
    """The bookie cannot say whether it has the entry (corruption, unclean state): never read as
    "absent"."""

    code = int(StatusCode.EUNKNOWNLEDGERSTATE)
    retriable = True


# ---------------------------------------------------------------- client-side conditions
class BKTimeout(BKError):
    retriable = True


class BookieConnectionLost(BKError):
    """The connection to a bookie broke; every request pending on it fails with this."""

    retriable = True


class DigestError(BKError):
    """An entry failed digest verification: the replica is corrupt (it is never returned)."""

    retriable = True


class NotEnoughBookies(BKError):
    """Fewer writable bookies than the ensemble needs. Start more bookies or lower E."""

    retriable = True


class LedgerClosed(BKError):
    """The ledger is closed (by us or by a recovering reader): no more adds."""


class LedgerRecoveryError(BKError):
    """Recovery could not decide an entry (replies unknown): retry the open."""

    retriable = True


class MetadataConflict(BKError):
    """Ledger metadata changed in a way that contradicts this handle (e.g. closed elsewhere with
    another last entry)."""


def error_for_status(status: int, message: str | None = None) -> BKError:
    """The exception for a non-EOK wire status."""
    cls = _BY_CODE.get(status)
    text = message or (StatusCode(status).name if status in StatusCode._value2member_map_ else str(status))
    if cls is None:
        return BadRequest(f"unknown status {status}: {text}")
    return cls(text)
