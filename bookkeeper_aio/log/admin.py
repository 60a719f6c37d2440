"""Operations on logs besides writing and reading (docs/api.md "Logs"): describe, list, delete,
named cursors, and imports of already-written ledgers (`append_ledgers`, exactly once per token).

Named cursors are keys beside the log's (``<root>/logcursors/<log>/<cursor>``): a consumer commits
the last position it processed; truncation and retention never cut into a cursor's ledger.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import structlog

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.errors import (
    BKInterfaceError,
    CommitTokenReused,
    LogTruncated,
    MetadataConflict,
    NoSuchLog,
)
from bookkeeper_aio.log._common import (
    LEDGER_LOG_KEY,
    LostLogCas,
    cas_log,
    check_room,
    delete_ledgers,
    delete_spare,
    log_manager,
    read_or_create,
    recover_ledgers,
    settle_cas,
    taken_over,
)
from bookkeeper_aio.log.position import LogPosition, check_position
from metadata.errors import BadVersion, CasResultUnknown, InvalidMetadata
from metadata.ledger_manager import UNCHANGED, _Unchanged
from metadata.ledger_metadata import LedgerMetadata
from metadata.log_metadata import (
    IMPORTER_BYTES_MAX,
    LogLedgerState,
    LogMetadata,
    commit_tag_problem,
    importer_problem,
)

log = structlog.get_logger("bookkeeper_aio.log.admin")

IMPORT_ATTEMPTS_MAX = 50
DELETE_ATTEMPTS_MAX = 50


class LogLedgerInfo(NamedTuple):
    """A ledger of a log as its list records it (``state`` "open" | "closed"; ``first_offset``:
    the log-wide offset of its entry 0 once known; end fields once the log closed it)."""

    ledger_id: int
    state: str
    first_offset: int | None
    last_entry_id: int | None
    length: int | None
    closed_ms: int | None


@dataclass(frozen=True, slots=True)
class LogInfo:
    name: str
    ledgers: tuple[LogLedgerInfo, ...]
    truncated_before: int
    sequenced: bool
    ctime_ms: int
    commits: Mapping[str, int]
    cursors: Mapping[str, LogPosition]
    version: int
    spare: int | None = None
    """The ledger the writer created ahead for its next roll (not part of the log)."""


async def describe_log(bk: BookKeeper, name: str) -> LogInfo:
    """The log's list and cursors. Raises NoSuchLog, MetadataFormatError, MetadataUnavailable."""
    manager = log_manager(bk)
    versioned = await manager.read(name)
    cursors = await read_cursors(bk, name)
    md = versioned.metadata
    return LogInfo(
        name,
        tuple(LogLedgerInfo(e.ledger_id, e.state.value, *e[2:]) for e in md.ledgers),
        md.truncated_before,
        md.sequenced,
        md.ctime_ms,
        types.MappingProxyType(dict(md.commits)),
        types.MappingProxyType(cursors),
        versioned.version,
        md.spare,
    )


async def list_logs(bk: BookKeeper) -> list[str]:
    """Every log's name, in key order."""
    return [name async for name in log_manager(bk).iter_names()]


async def delete_log(bk: BookKeeper, name: str, *, password: bytes = b"") -> None:
    """Fence the log's writer (recover its last two ledgers), remove the log, then delete its
    cursors and ledgers. The key is deleted at the version whose last ledgers were fenced: if the
    list changed meanwhile (a roll, a new writer), its new last ledgers are fenced first. A delete
    whose answer was lost is settled by reading the log back: gone (or a new log of that name,
    created since: another ``ctime_ms``), the delete applied and the ledgers of the list it was
    issued for are deleted; still there, it is tried again. The cursors go once the key is gone
    (not when that read back found a new log: they are its own), so a call that fails leaves the
    log with its cursors, still holding back its truncation. A crash after the key's delete leaves
    cursors and ledgers outside every log; a log created again under that name starts without
    those cursors (`LogManager.create` clears them). Raises NoSuchLog, MetadataConflict (the list
    kept changing), the metadata store's errors and the ledger API's recovery errors."""
    manager = log_manager(bk)
    lost: LogMetadata | None = None  # the list a delete whose answer was lost was issued for
    recreated = False  # a new log of that name exists: the cursors are its own
    for _ in range(DELETE_ATTEMPTS_MAX):
        try:
            versioned = await manager.read(name)
        except NoSuchLog:
            if lost is None:
                raise
            break  # that delete applied
        if lost is not None and versioned.metadata.ctime_ms != lost.ctime_ms:
            recreated = True
            break  # it applied, and a new log of that name was created since
        await recover_ledgers(bk, versioned.metadata.ledger_ids[-2:], password)
        try:
            await manager.delete(name, versioned.version)
        except BadVersion:
            continue  # fence what the newer list ends with, then try again
        except NoSuchLog:
            if lost is None:
                raise  # deleted by another caller since our read: that caller deletes the rest
            break
        except CasResultUnknown as error:
            log.info("log.delete_answer_lost", log=name, error=repr(error))
            lost = versioned.metadata
            continue
        lost = versioned.metadata
        break
    else:
        raise MetadataConflict(
            f"log {name!r}: the list kept changing ({DELETE_ATTEMPTS_MAX} attempts to delete it)"
        )
    if not recreated:
        await manager.delete_cursors(name)
    await delete_ledgers(bk, name, list(lost.ledger_ids), password, why="log deleted")
    await delete_spare(bk, lost, password)
    log.info("log.deleted", log=name, ledgers=len(lost.ledgers))


# ---------------------------------------------------------------------- cursors
async def commit_cursor(bk: BookKeeper, name: str, cursor: str, position: LogPosition) -> None:
    """Record that ``cursor`` consumed the log up to ``position`` (inclusive); last commit wins.
    Truncation reads the cursors when it plans its cut: a commit into a ledger a truncation already
    removed raises `LogTruncated` and stores nothing (if that truncation lands between the check and
    the write, the cursor is stored and `LogTruncated` raised all the same; truncation ignores a
    cursor below the log's start, so it never holds anything back); one between a truncation's plan
    and its CAS returns, and the truncation still removes its ledger (a reader resuming after it
    then gets `LogTruncated`, never a silent gap).
    Raises NoSuchLog, BKInterfaceError (bad cursor name or position: one whose ledger is not in the
    log, or past the end of a ledger the log has closed)."""
    check_position(position, "position", entry_min=-1)
    manager = log_manager(bk)
    try:
        manager.keys.log_cursor(name, cursor)  # the names, checked before anything is read
    except InvalidMetadata as error:
        raise BKInterfaceError(f"log {name!r}: {error}") from error
    md = (await manager.read(name)).metadata
    _raise_if_truncated(md, cursor, position)
    _raise_if_not_in_log(md, cursor, position)
    try:
        await manager.write_cursor(name, cursor, position.ledger_id, position.entry_id)
    except InvalidMetadata as error:
        raise BKInterfaceError(f"log {name!r}: {error}") from error
    _raise_if_truncated((await manager.read(name)).metadata, cursor, position)


def _raise_if_truncated(md: LogMetadata, cursor: str, position: LogPosition) -> None:
    if position.ledger_id < md.truncated_before:
        first = (md.ledgers[0].ledger_id, 0) if md.ledgers else None
        raise LogTruncated(md.name, f"cursor {cursor!r} at {tuple(position)}", first)


def _raise_if_not_in_log(md: LogMetadata, cursor: str, position: LogPosition) -> None:
    """A cursor points at a record the log holds: its ledger is listed and, once the log knows
    that ledger's last entry (CLOSED), the entry is at most that one (-1: none of it consumed). An
    open ledger's entries are not checked (its end is still moving)."""
    index = md.index_of(position.ledger_id)
    if index is None:
        listed = f"{md.ledgers[0].ledger_id}..{md.ledgers[-1].ledger_id}" if md.ledgers else "none"
        raise BKInterfaceError(
            f"log {md.name!r}: cursor {cursor!r} at {tuple(position)}: ledger {position.ledger_id} is "
            f"not in the log (its ledgers: {listed}; `describe_log` / `bkaio log show` lists them)"
        )
    last = md.ledgers[index].last_entry_id
    if md.ledgers[index].state is LogLedgerState.CLOSED and last is not None and position.entry_id > last:
        raise BKInterfaceError(
            f"log {md.name!r}: cursor {cursor!r} at {tuple(position)}: ledger {position.ledger_id} is "
            f"closed at entry {last}; a cursor names the last record it consumed, at most {last}"
        )


async def read_cursors(bk: BookKeeper, name: str) -> dict[str, LogPosition]:
    """Every named cursor of the log and the last position it committed. Raises NoSuchLog."""
    manager = log_manager(bk)
    await manager.read(name)  # the log must exist
    cursors = await manager.read_cursors(name)
    return {cursor: LogPosition(*position) for cursor, position in sorted(cursors.items())}


async def delete_cursor(bk: BookKeeper, name: str, cursor: str) -> bool:
    """Remove a named cursor (it no longer holds back truncation). Whether it existed. Raises
    NoSuchLog."""
    manager = log_manager(bk)
    await manager.read(name)  # the log must exist
    try:
        return await manager.delete_cursor(name, cursor)
    except InvalidMetadata as error:
        raise BKInterfaceError(f"log {name!r}: {error}") from error


# ---------------------------------------------------------------------- imports
async def append_ledgers(
    bk: BookKeeper,
    name: str,
    ledger_ids: Sequence[int],
    *,
    password: bytes = b"",
    commit: tuple[str, int] | None = None,
    commit_tag: str | None = None,
    create: bool = True,
) -> bool:
    """Append closed ledgers (in id order) to the log in one CAS, taking the log over as a new
    writer does (its last two ledgers are fenced and recovered: a live writer gets `LogFenced`).

    ``commit=(importer, batch_id)`` is stored in the same CAS; when that importer already committed
    ``batch_id`` nothing changes and the result is False (a replay: none of these ledgers is in the
    list, the caller deletes them) — unless these very ledgers are listed (the same call's CAS
    applied and only its answer was lost): True. A token below the importer's committed batch id
    is not a replay but a reused importer id: `CommitTokenReused`, nothing changed.

    ``commit_tag`` names what produced the batch (a Spark query id, at most `COMMIT_TAG_BYTES_MAX`
    UTF-8 bytes) and is stored with the token: the same batch id committed under another tag is
    not a replay either (`CommitTokenReused`). A token stored without a tag (before tags existed,
    or committed without one) or a call without one compares batch ids only.

    A ledger belongs to one log: its custom metadata `LEDGER_LOG_KEY` names it (set when a log
    writer or a Spark task creates it for the log, else here before the CAS, one ledger-metadata
    CAS per untagged ledger); one that names another log is refused.

    Raises BKInterfaceError (a ledger not closed, or another log's; bad token, a sequenced log;
    `CommitTokenReused`),
    MetadataConflict (a ledger id not above every listed one: the log got a newer ledger since these
    were created), LogFull (the list has no room for them: nothing changed), NoSuchLog
    (``create=False``), CasResultUnknown (the CAS's answer was lost and the list stayed unreadable
    past `settle_cas`'s budget: it may list the ledgers yet, so do not delete them), the ledger
    API's errors.
    """
    if commit is not None:
        problem = importer_problem(commit[0])
        if problem is not None or not isinstance(commit[1], int) or commit[1] < 0:
            raise BKInterfaceError(
                f"commit must be (importer id of 1..{IMPORTER_BYTES_MAX} UTF-8 bytes, batch id >= 0), got "
                f"{commit!r:.120}{': ' + problem if problem else ''}"
            )
    if commit_tag is not None:
        problem = "commit_tag needs a commit token" if commit is None else commit_tag_problem(commit_tag)
        if problem is not None:
            raise BKInterfaceError(f"log {name!r}: {problem}")
    ends = {}
    unclaimed: list[int] = []  # ledgers no log's name is on yet
    for ledger_id in sorted(set(ledger_ids)):
        handle = await bk.open_ledger(ledger_id, password=password)
        if not handle.is_closed:
            raise BKInterfaceError(
                f"log {name!r}: ledger {ledger_id} is not closed; close it before appending it"
            )
        md = handle.metadata
        ends[ledger_id] = (-1 if md.last_entry_id is None else md.last_entry_id, md.length)
        if not _owned_by(name, md):
            unclaimed.append(ledger_id)
    manager = log_manager(bk)
    lost_from: list[LogMetadata] = []  # the lists our CASes whose answers were lost started from
    for _ in range(IMPORT_ATTEMPTS_MAX):
        current = await read_or_create(manager, name, create=create)
        if current.metadata.sequenced:
            raise BKInterfaceError(
                f"log {name!r} is sequenced: its records carry sequence headers that imported ledgers "
                "lack; append through a log writer"
            )
        listed = set(current.metadata.ledger_ids)
        if ends and all(ledger_id in listed for ledger_id in ends):
            # these very ledgers are in: a CAS of ours applied (its answer was lost)
            log.info("log.imported", log=name, ledgers=sorted(ends), commit=commit, answer_lost=True)
            for earlier in lost_from:
                if (
                    earlier.spare is not None
                    and earlier.spare not in listed
                    and earlier.spare != current.metadata.spare
                ):
                    await delete_spare(bk, earlier, password)
            return True
        if commit is not None and _is_replay(current.metadata, name, commit, commit_tag):
            log.info("log.import_replayed", log=name, importer=commit[0], batch=commit[1])
            return False
        last = current.metadata.last_ledger_id
        if ends and min(ends) <= last:
            raise MetadataConflict(
                f"log {name!r}: ledger {min(ends)} is not above the log's last ledger {last} "
                "(create ledgers for a log with after_ledger_id=its last ledger, and write them again)"
            )
        # with its commit token (its importer id counts too): LogFull before the fencing
        check_room(
            current.metadata if commit is None else current.metadata.with_commit(*commit, commit_tag),
            len(ends),
        )
        for ledger_id in unclaimed:  # before the list names them: never listed untagged
            await bk.context.ledgers.update(ledger_id, functools.partial(_claimed, name), retry_unknown=True)
        unclaimed = []
        recovered = await recover_ledgers(bk, current.metadata.ledger_ids[-2:], password)
        proposed = taken_over(current.metadata, recovered, manager.now_ms())
        for ledger_id, (last_entry_id, length) in sorted(ends.items()):
            proposed = proposed.with_ledger_appended(ledger_id).with_closed(
                ledger_id, last_entry_id=last_entry_id, length=length, closed_ms=manager.now_ms()
            )
        if commit is not None:
            proposed = proposed.with_commit(*commit, commit_tag)
        try:
            await cas_log(manager, proposed, current.version)
        except BadVersion:
            continue
        except LostLogCas as lost:
            # Applied or not: the list read again once that CAS can no longer land settles it
            # (these ledgers listed, or not and never will be). Unsettled, the caller must not
            # delete them: the lost CAS may list them yet.
            log.info("log.import_answer_lost", log=name, ledgers=sorted(ends), error=repr(lost))
            lost_from.append(current.metadata)
            if await settle_cas(manager, lost) is None:
                raise
            continue
        log.info("log.imported", log=name, ledgers=sorted(ends), commit=commit)
        await delete_spare(bk, current.metadata, password)
        return True
    raise MetadataConflict(f"log {name!r}: could not append ledgers after {IMPORT_ATTEMPTS_MAX} attempts")


def _owned_by(name: str, md: LedgerMetadata) -> bool:
    """Whether the ledger's custom metadata names the log ``name`` (False: it names none);
    BKInterfaceError when it names another log."""
    owner = md.custom_metadata.get(LEDGER_LOG_KEY)
    if owner is None:
        return False
    if owner != name.encode():
        raise BKInterfaceError(
            f"log {name!r}: ledger {md.ledger_id} belongs to log {owner.decode(errors='replace')!r} "
            f"(its custom metadata {LEDGER_LOG_KEY!r}); a ledger goes into one log only: truncating "
            "or deleting either log would delete it under the other"
        )
    return True


def _claimed(name: str, md: LedgerMetadata) -> LedgerMetadata | _Unchanged:
    """The ledger's metadata naming the log ``name`` (`UNCHANGED`: it does already)."""
    return UNCHANGED if _owned_by(name, md) else md.with_custom_metadata({LEDGER_LOG_KEY: name.encode()})


def _is_replay(md: LogMetadata, name: str, commit: tuple[str, int], tag: str | None) -> bool:
    """Whether ``commit`` (with ``tag``) is the token the importer committed last (a replay: True),
    a new batch (False) or a reused importer id (`CommitTokenReused`)."""
    importer, batch_id = commit
    committed = md.commits.get(importer, -1)
    if committed < batch_id:
        return False
    committed_tag = md.commit_tags.get(importer)
    if committed > batch_id or (tag is not None and committed_tag is not None and committed_tag != tag):
        raise CommitTokenReused(name, importer, batch_id, committed, tag=tag, committed_tag=committed_tag)
    return True


async def committed_batch(bk: BookKeeper, name: str, importer: str) -> int | None:
    """The last batch id ``importer`` committed into the log (None: none)."""
    try:
        md = (await log_manager(bk).read(name)).metadata
    except NoSuchLog:
        return None
    return md.commits.get(importer)
