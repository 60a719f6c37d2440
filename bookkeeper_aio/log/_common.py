"""Shared by the log writer, reader and operations: the `LogManager` of a client, the one CAS of a
list (with a lost answer resolved), recovery of listed ledgers, what a takeover writes, discarding
an unlisted ledger and deleting ledgers that left the list."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.errors import BKError, LogFull, NoSuchLedger, NoSuchLog
from metadata.errors import BadVersion, CasResultUnknown, MetadataError, NodeExists
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import ENCODED_BYTES_MAX, LogLedgerState, LogMetadata, encoded_size, has_room

log = structlog.get_logger("bookkeeper_aio.log")

SETTLE_ATTEMPTS_MAX = 8
SETTLE_RETRY_S = 0.05
SETTLE_RETRY_S_MAX = 2.0
"""`settle_cas` tries for about 7 s (an etcd leader election) before it gives up for now."""

LEDGER_LOG_KEY = "bookkeeper-aio.log"
"""Custom metadata of a ledger made for a log (a log writer's, a Spark write task's) or imported
into one: the log's name, UTF-8. `append_ledgers` refuses a ledger that names another log (once
in two lists, truncating or deleting either log would delete it under the other)."""


def ledger_log_tag(name: str) -> dict[str, bytes]:
    """The custom metadata that ties a new ledger to the log ``name`` (`LEDGER_LOG_KEY`)."""
    return {LEDGER_LOG_KEY: name.encode()}


def log_manager(bk: BookKeeper) -> LogManager:
    """A `LogManager` on the client's metadata store and cluster root."""
    ledgers = bk.context.ledgers
    # The store and clock the client already uses.
    return LogManager(ledgers.store, ledgers.keys.root, now_ms=ledgers.now_ms)


async def read_or_create(
    manager: LogManager, name: str, *, create: bool, sequenced: bool = False
) -> VersionedLog:
    """The log's list; a missing log is created first when ``create`` (else `NoSuchLog`)."""
    while True:
        try:
            return await manager.read(name)
        except NoSuchLog:
            if not create:
                raise
            with contextlib.suppress(NodeExists):
                await manager.create(name, sequenced=sequenced)


class LostLogCas(CasResultUnknown):
    """`cas_log`'s lost answer, with what that CAS sent (``proposed`` at ``expected_version``):
    `settle_cas` needs them to settle it."""

    def __init__(self, proposed: LogMetadata, expected_version: int, message: str, key: str) -> None:
        super().__init__(key, message)
        self.proposed = proposed
        self.expected_version = expected_version


async def cas_log(manager: LogManager, proposed: LogMetadata, expected_version: int) -> VersionedLog:
    """One CAS of the list. A lost answer (`CasResultUnknown`) is resolved by reading the list back:
    ours if it is exactly ``proposed``, tried again if the version did not move (not applied yet),
    else `LostLogCas` (the caller must then assume its change may be in the list, or yet land in
    it: `settle_cas`). So a `BadVersion` from here always means the change was not applied: after a
    lost answer, a conflict is read back too (the lost request may have landed late and be what the
    retry conflicts with).
    """
    key = manager.keys.log(proposed.name)
    answer_lost = False
    for _ in range(2):
        try:
            return await manager.write(proposed, expected_version)
        except (CasResultUnknown, BadVersion) as error:
            if isinstance(error, BadVersion) and not answer_lost:
                raise
            answer_lost = True
            try:
                current = await manager.read(proposed.name)
            except MetadataError:
                raise LostLogCas(proposed, expected_version, "log CAS outcome lost", key) from error
            if current.metadata == proposed:
                return current
            if current.version != expected_version:
                raise LostLogCas(
                    proposed, expected_version, "log CAS outcome lost and the list moved on", key
                ) from error
    raise LostLogCas(proposed, expected_version, "log CAS outcome lost twice", key)


async def settle_cas(manager: LogManager, lost: LostLogCas) -> VersionedLog | None:
    """The list once the CAS whose answer was ``lost`` can no longer land: its version past the one
    that CAS expected, so the list tells for good whether it applied (the caller looks for its
    change: there, it applied; not there, it never will). A list still at that version tells
    nothing: the lost request may yet be applied (an etcd txn whose answer timed out can commit
    after a later read), so the CAS is sent again at that version, as `cas_log` does: it applies
    (the list is then the proposed one) or the version moved. Unreadable (or the answers lost
    again), tried again `SETTLE_RETRY_S` apart, doubled each time, `SETTLE_ATTEMPTS_MAX` times;
    then None: the change may still land, nothing that hangs on it may be decided (nor deleted).
    Raises `NoSuchLog`: the log was deleted (a CAS of it never lands: versions only grow)."""
    name = lost.proposed.name
    for attempt in range(SETTLE_ATTEMPTS_MAX):
        if attempt:
            await asyncio.sleep(min(SETTLE_RETRY_S_MAX, SETTLE_RETRY_S * 2 ** (attempt - 1)))
        try:
            current = await manager.read(name)
            if current.version != lost.expected_version:
                return current
            return await cas_log(manager, lost.proposed, lost.expected_version)
        except NoSuchLog:
            raise
        except BKError as error:  # unreadable, lost again, or moved meanwhile (BadVersion): again
            log.info("log.cas_unsettled", log=name, attempt=attempt + 1, error=repr(error))
    log.warning("log.cas_unsettled_for_now", log=name, expected_version=lost.expected_version)
    return None


def check_room(md: LogMetadata, ledgers: int = 1) -> None:
    """`LogFull` unless the list has room for ``ledgers`` more (`has_room`): checked before a
    ledger is created for it (or imported), so a full list never leaves one behind."""
    if not has_room(md, ledgers):
        detail = f"{len(md.ledgers)} ledgers, {encoded_size(md)} of {ENCODED_BYTES_MAX} bytes"
        raise LogFull(md.name, detail)


async def recover_ledgers(
    bk: BookKeeper, ledger_ids: tuple[int, ...], password: bytes
) -> dict[int, tuple[int, int]]:
    """Fence and recover (close) each ledger: id -> (last entry id, length in bytes)."""
    ends: dict[int, tuple[int, int]] = {}
    for ledger_id in ledger_ids:
        handle = await bk.open_ledger(ledger_id, password=password, recovery=True)
        md = handle.metadata
        ends[ledger_id] = (-1 if md.last_entry_id is None else md.last_entry_id, md.length)
    return ends


async def discard_ledger(bk: BookKeeper, handle: LedgerHandle, password: bytes) -> None:
    """Close and delete a ledger that never made it into the list (best effort)."""
    with contextlib.suppress(BKError):
        await handle.close()
    with contextlib.suppress(BKError):
        await bk.delete_ledger(handle.id, password=password)


def taken_over(md: LogMetadata, ends: dict[int, tuple[int, int]], now_ms: int) -> LogMetadata:
    """``md`` as a takeover writes it: the recovered ledgers marked CLOSED at their ends (close
    time ``now_ms``, from the `LogManager`'s clock, for those the list still had OPEN), and the
    previous leader's spare no longer recorded (the taker deletes it once its CAS applied:
    `delete_spare`)."""
    md = md.with_spare(None)
    for ledger_id, (last_entry_id, length) in ends.items():
        index = md.index_of(ledger_id)
        was_open = index is not None and md.ledgers[index].state is LogLedgerState.OPEN
        md = md.with_closed(
            ledger_id, last_entry_id=last_entry_id, length=length, closed_ms=now_ms if was_open else None
        )
    return md


async def delete_ledgers(
    bk: BookKeeper, name: str, ledger_ids: list[int], password: bytes, *, why: str
) -> None:
    """Delete ledgers that left the log (truncated, a deleted log's, a previous leader's spare) with
    the log's ``password``; a failure is logged, not raised: the ledger is then an orphan for
    `bkaio ledger delete`."""
    for ledger_id in ledger_ids:
        try:
            await bk.delete_ledger(ledger_id, password=password)
        except NoSuchLedger:  # deleted already (a retry, a concurrent cut): nothing left to do
            log.info("log.ledger_already_deleted", log=name, ledger_id=ledger_id, why=why)
        except BKError as error:
            log.warning("log.ledger_not_deleted", log=name, ledger_id=ledger_id, why=why, error=repr(error))
        else:
            log.info("log.ledger_deleted", log=name, ledger_id=ledger_id, why=why)


async def delete_spare(bk: BookKeeper, md: LogMetadata, password: bytes) -> None:
    """Delete the spare ledger ``md`` records, once a CAS dropped it (a takeover, a deleted log):
    nobody ever wrote to it, nobody will."""
    if md.spare is not None:
        await delete_ledgers(bk, md.name, [md.spare], password, why="spare of the previous writer")
