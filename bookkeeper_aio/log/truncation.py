"""Truncation and retention (docs/api.md "Logs"): whole ledgers leave the front of the list.

A cut is asked for before a ledger of the list (`check_cut`): an id the log does not list, above
its first ledger, is refused unless forced, as a typo there (an id past the last ledger) would drop
every ledger but the last.

A cut never removes the last ledger, an OPEN ledger or anything after one, nor the ledger a named
cursor points into (or anything after it): the slowest cursor bounds it. A cursor below the
log's start (``truncated_before``: committed while a truncation removed its ledger) bounds nothing.
The list changes first (one CAS: the metadata then records ``truncated_before``, so a reader asking
for a truncated position gets `LogTruncated`, never a silent gap), then the dropped ledgers are
deleted; with nothing to cut the list is not written.

A lost CAS answer (`CasResultUnknown`) is settled by reading the list once that CAS can no longer
land (`settle_cas`: a list still at the version the CAS expected gets the CAS again, and an
unreadable list is read again with backoff, for about 7 s): every planned ledger it no longer lists,
below its ``truncated_before``, left it (by this cut or a later one: deleting twice is harmless) and
is deleted; if the cut is not in (it never will be), the error is raised: try again. Only a list
unreadable for the whole budget leaves the cut undecided (the error is raised; should the lost CAS
land after all, its ledgers stay as orphans for `bkaio ledger delete`).
"""

from __future__ import annotations

from collections.abc import Callable

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.errors import BKInterfaceError, MetadataConflict, NoSuchLedger
from bookkeeper_aio.log import records
from bookkeeper_aio.log._common import LostLogCas, cas_log, delete_ledgers, log, log_manager, settle_cas
from bookkeeper_aio.log.position import LogPosition, check_position
from metadata.errors import BadVersion, UpdateRetriesExhausted
from metadata.log_manager import CAS_ATTEMPTS_MAX, LogManager, VersionedLog
from metadata.log_metadata import LogLedgerState, LogMetadata

PLAN_ATTEMPTS_MAX = 50


def truncate_list(
    md: LogMetadata, before_ledger_id: int, cursors: dict[str, tuple[int, int]], sequence: int | None = None
) -> tuple[LogMetadata, list[int]]:
    """The list without its ledgers below the cut (bounded as the module says), and their ids."""
    cut = before_ledger_id
    if md.ledgers:
        cut = min(cut, md.ledgers[-1].ledger_id)
    for entry in md.ledgers:
        if entry.state is LogLedgerState.OPEN:
            cut = min(cut, entry.ledger_id)
            break
    for ledger_id, _ in cursors.values():
        if ledger_id >= md.truncated_before:  # one below it points at nothing left to hold back
            cut = min(cut, ledger_id)
    dropped = [entry.ledger_id for entry in md.ledgers if entry.ledger_id < cut]
    if not dropped:
        return md, []
    return md.with_truncated_before(cut, sequence=sequence), dropped


def retention_cut(md: LogMetadata, age_s: float | None, size: int | None, now_ms: int) -> int | None:
    """The ledger id retention would truncate before (None: nothing to drop). Age: closed ledgers
    closed more than ``age_s`` ago. Size: the oldest closed ledgers beyond ``size`` payload bytes,
    counted from the newest. Ledgers with an unknown close time or length are kept."""
    closed = [e for e in md.ledgers[:-1] if e.state is LogLedgerState.CLOSED]
    cut: int | None = None
    if age_s is not None:
        for entry in closed:
            if entry.closed_ms is None or now_ms - entry.closed_ms <= age_s * 1000:
                break
            cut = _after(md, entry.ledger_id)
    if size is not None:
        kept = 0
        for entry in reversed(closed):
            kept += entry.length or 0
            if entry.length is None or kept > size:
                if entry.length is not None:
                    later = _after(md, entry.ledger_id)
                    cut = later if cut is None else max(cut, later)
                break
    return cut


def _after(md: LogMetadata, ledger_id: int) -> int:
    index = md.index_of(ledger_id)
    assert index is not None
    return md.ledgers[index + 1].ledger_id


def check_cut(md: LogMetadata, before_ledger_id: int, *, force: bool) -> None:
    """Refuse (BKInterfaceError) a cut before a ledger the log does not list, above its first one:
    such an id is most likely a typo, and cutting below it (an id past the last ledger drops every
    ledger but the last) is no truncation anyone asked for by name. ``force`` allows it. An id
    below the log's first ledger cuts nothing and is allowed (a truncation done already)."""
    if force or not md.ledgers or before_ledger_id <= md.ledgers[0].ledger_id:
        return
    if md.index_of(before_ledger_id) is None:
        raise BKInterfaceError(
            f"log {md.name!r}: ledger {before_ledger_id} is not in the log (its ledgers: "
            f"{md.ledgers[0].ledger_id}..{md.ledgers[-1].ledger_id}); truncate before one of its "
            "ledgers, or pass force=True (`bkaio log truncate --force`) to drop every ledger below "
            f"{before_ledger_id} (never the last one, an open one or one a cursor points into)"
        )


async def truncate_log(
    bk: BookKeeper, name: str, before: LogPosition, *, password: bytes = b"", force: bool = False
) -> LogPosition | None:
    """Drop the log's whole ledgers before ``before.ledger_id`` (bounded as the module says) and
    delete them; a live writer keeps writing. ``before.ledger_id`` must be a ledger of the log (or
    below its first: nothing to cut) unless ``force`` (`check_cut`). Returns the log's first
    position afterwards (None: no ledger). ``password`` (the log's) reads a sequenced log's last
    removed record and deletes the dropped ledgers (without it they stay as orphans, logged).
    Raises NoSuchLog, MetadataFormatError, MetadataUnavailable, BKInterfaceError (``before`` not a
    position, or not a ledger of the log)."""
    check_position(before, "before")
    manager = log_manager(bk)
    current = await manager.read(name)
    check_cut(current.metadata, before.ledger_id, force=force)
    change, planned = await plan_truncation(bk, manager, current.metadata, before.ledger_id, password)
    for _ in range(CAS_ATTEMPTS_MAX):
        proposed = change(current.metadata)
        if proposed == current.metadata:  # nothing (left) to cut: no write
            versioned = current
            break
        try:
            versioned = await cas_log(manager, proposed, current.version)
            break
        except LostLogCas as lost:
            versioned = await settle_lost_truncation(manager, planned, lost)
            break
        except BadVersion:
            pass  # someone else's change first: cut from the list as it is now
        current = await manager.read(name)
    else:
        raise UpdateRetriesExhausted(manager.keys.log(name), CAS_ATTEMPTS_MAX)
    await delete_ledgers(bk, name, truncated_ids(versioned.metadata, planned), password, why="truncated")
    ledgers = versioned.metadata.ledgers
    return LogPosition(ledgers[0].ledger_id, 0) if ledgers else None


def truncated_ids(md: LogMetadata, planned: list[int]) -> list[int]:
    """The ``planned`` ledgers ``md`` shows truncated away: not listed, below ``truncated_before``."""
    listed = set(md.ledger_ids)
    return [ledger_id for ledger_id in planned if ledger_id not in listed and ledger_id < md.truncated_before]


async def settle_lost_truncation(manager: LogManager, planned: list[int], lost: LostLogCas) -> VersionedLog:
    """After a truncation CAS whose answer was ``lost``: the list once that CAS can no longer land
    (`settle_cas`: read again, and the CAS sent again while the list is still at the version it
    expected, with backoff while the list cannot be read), when it shows the planned ledgers
    truncated away (the caller deletes them). Raises ``lost`` when the cut is not in (and never will
    be: try again) or it could not be settled within `settle_cas`'s budget; `NoSuchLog`."""
    versioned = await settle_cas(manager, lost)
    if versioned is None:
        raise lost
    applied = len(truncated_ids(versioned.metadata, planned)) == len(planned)
    log.info("log.truncate_answer_lost", log=versioned.name, planned=planned, applied=applied)
    if not applied:
        raise lost
    return versioned


async def plan_truncation(
    bk: BookKeeper, manager: LogManager, md: LogMetadata, before_ledger_id: int, password: bytes
) -> tuple[Callable[[LogMetadata], LogMetadata], list[int]]:
    """The list change of a truncation, and the ids it plans to drop (those of the list now, plus
    any a re-applied change drops; `truncated_ids` of the list afterwards says which did go). The
    cut is fixed here, from the cursors and the list as they are now (a retry of the
    CAS never cuts further); for a sequenced log the highest removed sequence number goes along."""
    cursors = await manager.read_cursors(md.name)
    for _ in range(PLAN_ATTEMPTS_MAX):
        planned, gone = truncate_list(md, before_ledger_id, cursors)
        sequence = None
        if not (md.sequenced and gone):
            break
        removed = [entry for entry in md.ledgers if entry.ledger_id in set(gone)]
        try:
            sequence = await records.last_sequence_in(bk, md.name, removed, password)
            break
        except NoSuchLedger:
            # ``md`` is stale (a writer's own view): another truncation removed and deleted the
            # ledger since; the list as it is now says what is left to cut.
            md = (await manager.read(md.name)).metadata
    else:
        raise MetadataConflict(f"log {md.name!r}: the list kept being truncated while planning a truncation")
    cut = planned.truncated_before if gone else before_ledger_id
    ids = list(gone)

    def change(current: LogMetadata) -> LogMetadata:
        proposed, now_gone = truncate_list(current, min(cut, before_ledger_id), cursors, sequence)
        ids.extend(ledger_id for ledger_id in now_gone if ledger_id not in ids)
        return proposed

    return change, ids
