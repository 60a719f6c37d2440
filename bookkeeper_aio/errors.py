"""One error model for the whole project: every error we raise on purpose is a `BKError`.

``BKError`` is the root. Every wire status has exactly one class, registered by its code;
:func:`error_for_status` is the only mapping from a status to an exception. ``retriable`` says
whether the same operation may succeed when tried again (after backoff, another replica or a new
ensemble). Misuse of the API is :class:`BKInterfaceError` (also a ``ValueError``); a broken
invariant inside the library is :class:`BKInternalError`. ``outcome_unknown`` is True on the error an
add fails with once the add was sent to the bookies: the entry may or may not be in the ledger (see
docs/api.md, "An add error after sending means unknown"). The metadata package's root
(``metadata.errors.MetadataError``) and the codec's ``ProtocolError`` derive from ``BKError`` too, so
``except BKError`` catches everything the project raises on purpose.
"""

from __future__ import annotations

from typing import ClassVar

from bookkeeper_aio.protocol.codes import StatusCode


class BKError(Exception):
    """Root of every error bookkeeper-aio raises on purpose.

    ``outcome_unknown`` (an instance attribute, False unless set): the error failed an add that had
    already been sent to the bookies, so the entry **may or may not be in the ledger**, whatever the
    error class (``LedgerFenced``, ``LedgerClosed``, ``NotEnoughBookies``, ``Unauthorized``, ...).
    Only reading the ledger once it is closed (recovered) tells. False: the operation did nothing
    (e.g. an add refused before it was sent), so retrying it cannot duplicate an entry.
    """

    code: ClassVar[int | None] = None
    retriable: ClassVar[bool] = False
    outcome_unknown: bool = False


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
    """Wrong ledger password (the bookie's master key check failed). On an add that was sent
    (``outcome_unknown`` True) other bookies may have stored the entry."""

    code = int(StatusCode.EUA)


@_register
class ProtocolVersionMismatch(BKError):
    code = int(StatusCode.EBADVERSION)


@_register
class LedgerFenced(BKError):
    """The ledger was fenced by a recovering reader. For an add that was sent this is like a
    timeout (``outcome_unknown`` is True): the entry may or may not be in the ledger; only the
    recovered ledger's last entry tells."""

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
    """Fewer writable bookies than the ensemble needs. Start more bookies or lower E.

    On an add that was sent (``outcome_unknown`` True: the writer found no replacement for a failed
    bookie) the entry may or may not be in the ledger: it may have reached ``Qa`` bookies, and a
    recovery keeps it. Only the recovered ledger's last entry tells."""

    retriable = True


class LedgerClosed(BKError):
    """The ledger is closed (by us or by a recovering reader): no more adds.

    On an add that was sent (``outcome_unknown`` True: e.g. a writer that resumed after a reader
    recovered and closed its ledger, or ``abort()``) the entry may or may not be in the ledger; only
    the closed ledger's last entry tells. Raised before sending (a closed handle) it is
    ``outcome_unknown`` False: nothing was written."""


class LedgerRecoveryError(BKError):
    """Recovery could not decide an entry (replies unknown): retry the open."""

    retriable = True


class MetadataConflict(BKError):
    """Ledger metadata changed in a way that contradicts this handle (e.g. closed elsewhere with
    another last entry)."""


class NoSuchLog(BKError):
    """The named log does not exist (docs/api.md "Logs")."""

    def __init__(self, name: str) -> None:
        super().__init__(f"log {name!r} does not exist")
        self.name = name


class LogFenced(BKError):
    """Another writer took the log over (it fenced this writer's ledger or changed the ledger list):
    this writer is stopped. ``outcome_unknown`` as for `LedgerFenced`: an append that was sent may
    or may not be in the log; reading the log tells."""

    def __init__(self, name: str, detail: str, *, outcome_unknown: bool = False) -> None:
        super().__init__(f"log {name!r}: fenced by another writer ({detail})")
        self.name = name
        self.outcome_unknown = outcome_unknown


class LogFull(BKError):
    """The log's ledger list has no room for another ledger: its metadata value is capped at 1 MiB
    (docs/metadata.md "Logs": about 19,700 ledgers when every number in them is large, about 30,000
    typically). Nothing was created or changed. Truncate the log (`truncate_log`, ``bkaio log
    truncate``, or retention on the writer) to make room."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(
            f"log {name!r}: the ledger list is full ({detail}); truncate the log (truncate_log, "
            "'bkaio log truncate' or retention) to make room"
        )
        self.name = name


class LogTruncated(BKError):
    """The records asked for were truncated from the log (docs/api.md "Logs": truncation).
    ``first_position`` is the log's first position now (None: the log holds no ledger)."""

    def __init__(self, name: str, detail: str, first_position: tuple[int, int] | None) -> None:
        where = "the log is empty" if first_position is None else f"it now starts at {tuple(first_position)}"
        super().__init__(f"log {name!r}: {detail} was truncated ({where}); start from 'earliest'")
        self.name = name
        self.first_position = first_position


class CommitTokenReused(BKInterfaceError):
    """An import's commit token ``(importer, batch_id)`` is below the batch id that importer already
    committed into the log, or equal to it with another tag (another producer: a Spark query that
    reused a writer id). Only the same batch id of the same producer is a replay; this is a reused
    importer id (or one whose batch ids started over): nothing was changed, and none of the batch's
    ledgers is listed. Use a new importer id."""

    def __init__(
        self,
        name: str,
        importer: str,
        batch_id: int,
        committed: int,
        *,
        tag: str | None = None,
        committed_tag: str | None = None,
    ) -> None:
        if batch_id == committed:
            what = (
                f"already committed batch {committed} from another producer (tag {committed_tag!r}, "
                f"this batch's {tag!r}): not a replay of it"
            )
        else:
            what = (
                f"already committed batch {committed}, above this batch {batch_id}: its batch ids "
                "started over"
            )
        super().__init__(
            f"log {name!r}: importer {importer!r} {what} (a reused importer id); nothing was "
            "appended: use a new importer id"
        )
        self.name = name
        self.importer = importer
        self.batch_id = batch_id
        self.committed = committed
        self.tag = tag
        self.committed_tag = committed_tag


def with_outcome_unknown(error: BKError, unknown: bool) -> BKError:
    """A copy of ``error`` (same class, message, attributes and cause) whose ``outcome_unknown`` is
    ``unknown``; ``__init__`` is not called, so classes with their own signature copy too."""
    clone = type(error).__new__(type(error), *error.args)
    clone.args = error.args
    clone.__dict__.update(error.__dict__)
    clone.outcome_unknown = unknown
    clone.__cause__ = error.__cause__
    clone.__suppress_context__ = error.__suppress_context__
    return clone


def error_for_status(status: int, message: str | None = None) -> BKError:
    """The exception for a non-EOK wire status."""
    cls = _BY_CODE.get(status)
    text = message or (StatusCode(status).name if status in StatusCode._value2member_map_ else str(status))
    if cls is None:
        return BadRequest(f"unknown status {status}: {text}")
    return cls(text)
