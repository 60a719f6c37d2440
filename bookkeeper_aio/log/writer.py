"""The log writer (docs/replication.md §7, docs/api.md "Logs").

Opening as leader: read the ledger list; fence and recover the last two ledgers
(``open_ledger(recovery=True)``, which closes them); create a new ledger; CAS the list with the
recovered ledgers marked CLOSED and the new one appended. On a CAS conflict the new ledger is
deleted and the open starts over. No append is served before the CAS succeeded.

Rolling: create a new ledger, CAS it into the list, switch appends to it, then close the previous
one and mark it CLOSED in the list. Until the first CAS succeeded appends go to the old ledger.

A writer that loses the log (its ledger fenced, or a CAS that finds the list changed by someone
else) raises `LogFenced` and stops for good.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.errors import (
    BKError,
    BKInterfaceError,
    LedgerClosed,
    LedgerFenced,
    LogFenced,
    MetadataConflict,
    NoSuchLog,
)
from bookkeeper_aio.log._common import log_manager
from bookkeeper_aio.log.position import LogPosition
from metadata.errors import BadVersion, CasResultUnknown, MetadataError, NodeExists
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogMetadata

log = structlog.get_logger("bookkeeper_aio.log.writer")

OPEN_ATTEMPTS_MAX = 50
_FENCING_ERRORS = (LedgerFenced, LedgerClosed, MetadataConflict)


class LogWriter:
    """The single writer (leader) of a log. Build with `open_log_writer`."""

    def __init__(
        self,
        bk: BookKeeper,
        manager: LogManager,
        versioned: VersionedLog,
        handle: LedgerHandle,
        *,
        ensemble: int,
        write_quorum: int,
        ack_quorum: int,
        password: bytes,
        roll_entries_max: int | None,
    ) -> None:
        self._bk = bk
        self._manager = manager
        self._versioned = versioned
        self._handle = handle
        self._ensemble = (ensemble, write_quorum, ack_quorum)
        self._password = password
        self._roll_entries_max = roll_entries_max
        self._entries_in_ledger = 0
        self._roll_task: asyncio.Task[None] | None = None
        self._roll_lock = asyncio.Lock()
        self._old_closes: set[asyncio.Task[None]] = set()
        self._fenced: LogFenced | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return self._versioned.name

    @property
    def ledger_id(self) -> int:
        """The ledger appends go to now."""
        return self._handle.id

    @property
    def ledger_ids(self) -> tuple[int, ...]:
        """The log's ledger list as this writer last wrote it."""
        return self._versioned.metadata.ledger_ids

    # ------------------------------------------------------------------ appends
    async def append(self, payload: bytes) -> LogPosition:
        """Append and wait; returns the record's position. Raises `LogFenced` (another writer took
        over: this writer is stopped), the ledger API's errors (``outcome_unknown`` as documented
        there), BKInterfaceError (closed writer)."""
        future = await self.append_async(payload)
        return await future

    async def append_async(self, payload: bytes) -> asyncio.Future[LogPosition]:
        """Hand ``payload`` to the current ledger; returns a future of its position (pipelining:
        waits only for a window slot, as `LedgerHandle.append_async`)."""
        self._check_writable()
        while True:
            handle = self._handle
            try:
                inner = await handle.append_async(payload)
                break
            except _FENCING_ERRORS as error:
                if handle is not self._handle and type(error) is LedgerClosed and not error.outcome_unknown:
                    continue  # a roll closed it while we waited for a window slot: nothing was sent
                raise self._fence(error) from error
        self._entries_in_ledger += 1
        self._maybe_roll()
        outer: asyncio.Future[LogPosition] = asyncio.get_running_loop().create_future()

        def done(f: asyncio.Future[int]) -> None:
            if outer.done():
                return
            if f.cancelled():
                outer.cancel()
                return
            error = f.exception()
            if error is None:
                outer.set_result(LogPosition(handle.id, f.result()))
            elif isinstance(error, _FENCING_ERRORS):
                fenced = self._fence(error)
                fenced.__cause__ = error
                outer.set_exception(fenced)
            else:
                outer.set_exception(error)

        inner.add_done_callback(done)
        return outer

    def _check_writable(self) -> None:
        if self._fenced is not None:
            raise LogFenced(self.name, "this writer was already fenced")
        if self._closed:
            raise BKInterfaceError(f"log {self.name!r}: the writer is closed")

    def _fence(self, error: BaseException | str) -> LogFenced:
        """Stop the writer; the `LogFenced` for the failed operation (``outcome_unknown`` copied)."""
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        unknown = isinstance(error, BKError) and error.outcome_unknown
        if self._fenced is None:
            log.warning("log.writer_fenced", log=self.name, ledger_id=self._handle.id, detail=detail)
            self._fenced = LogFenced(self.name, str(detail))
            self._handle.abort()
        return LogFenced(self.name, str(detail), outcome_unknown=unknown)

    # ------------------------------------------------------------------ roll
    def _maybe_roll(self) -> None:
        limit = self._roll_entries_max
        if limit is None or self._entries_in_ledger < limit or self._roll_task is not None:
            return
        self._roll_task = asyncio.create_task(self._auto_roll())

    async def _auto_roll(self) -> None:
        try:
            await self.roll()
        except BKError as error:
            log.warning("log.auto_roll_failed", log=self.name, error=repr(error))
        finally:
            self._roll_task = None

    async def roll(self) -> int:
        """Move appends to a new ledger (create it, CAS it into the list, then close the previous
        one). Returns the new ledger's id. Raises `LogFenced` when the list changed under us."""
        async with self._roll_lock:
            self._check_writable()
            ensemble, wq, aq = self._ensemble
            new = await self._bk.create_ledger(ensemble, wq, aq, password=self._password)
            try:
                versioned = await _cas(
                    self._manager,
                    self._versioned.metadata.with_ledger_appended(new.id),
                    self._versioned.version,
                )
            except BadVersion as error:
                await _discard(self._bk, new)
                raise self._fence("the ledger list changed (another writer opened the log)") from error
            except CasResultUnknown:
                new.abort()  # it may be in the list: leave it for recovery, keep writing to the old one
                raise
            except BaseException:
                await _discard(self._bk, new)
                raise
            old, self._handle, self._versioned = self._handle, new, versioned
            self._entries_in_ledger = 0
            log.info("log.rolled", log=self.name, old_ledger=old.id, new_ledger=new.id)
            await self._close_old(old)
            return new.id

    async def _close_old(self, old: LedgerHandle) -> None:
        try:
            await old.close()  # waits for the adds still pending on it
        except _FENCING_ERRORS as error:
            raise self._fence(error) from error
        try:
            self._versioned = await _cas(
                self._manager, self._versioned.metadata.with_closed(old.id), self._versioned.version
            )
        except BadVersion as error:
            raise self._fence("the ledger list changed (another writer opened the log)") from error

    # ------------------------------------------------------------------ close
    async def close(self) -> None:
        """Close the current ledger and mark it CLOSED in the list. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._roll_task is not None:
            with contextlib.suppress(BKError):
                await self._roll_task
        if self._fenced is not None:
            return
        async with self._roll_lock:
            await self._close_old(self._handle)

    async def __aenter__(self) -> LogWriter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _cas(manager: LogManager, proposed: LogMetadata, expected_version: int) -> VersionedLog:
    """One CAS of the list. A lost answer (`CasResultUnknown`) is resolved by reading the list back:
    ours if it is exactly ``proposed``, tried again if the version did not move (not applied), else
    `CasResultUnknown` (the caller must then assume its ledger may be in the list)."""
    for _ in range(2):
        try:
            return await manager.write(proposed, expected_version)
        except CasResultUnknown as unknown:
            try:
                current = await manager.read(proposed.name)
            except MetadataError:
                raise unknown from None
            if current.metadata == proposed:
                return current
            if current.version != expected_version:
                raise
    raise CasResultUnknown(manager.keys.log(proposed.name), "log CAS outcome lost twice")


async def _discard(bk: BookKeeper, handle: LedgerHandle) -> None:
    """Close and delete a ledger that never made it into the list (best effort)."""
    with contextlib.suppress(BKError):
        await handle.close()
    with contextlib.suppress(BKError):
        await bk.delete_ledger(handle.id)


async def open_log_writer(
    bk: BookKeeper,
    name: str,
    *,
    ensemble: int = 3,
    write_quorum: int = 2,
    ack_quorum: int = 2,
    password: bytes = b"",
    create: bool = True,
    roll_entries_max: int | None = None,
) -> LogWriter:
    """Become the log's writer (docs/replication.md §7). Fences whoever wrote before.

    Raises NoSuchLog (``create=False`` and no such log), MetadataFormatError (a corrupt log key,
    naming the log), the ledger API's errors (recovery, creation), BKInterfaceError.
    """
    if roll_entries_max is not None and roll_entries_max < 1:
        raise BKInterfaceError(f"roll_entries_max must be >= 1, got {roll_entries_max}")
    manager = log_manager(bk)
    for attempt in range(1, OPEN_ATTEMPTS_MAX + 1):
        try:
            current = await manager.read(name)
        except NoSuchLog:
            if not create:
                raise
            with contextlib.suppress(NodeExists):
                await manager.create(name)
            continue
        last_two = current.metadata.ledger_ids[-2:]
        for ledger_id in last_two:  # fence: the old leader's adds now fail
            await bk.open_ledger(ledger_id, password=password, recovery=True)
        handle = await bk.create_ledger(ensemble, write_quorum, ack_quorum, password=password)
        proposed = current.metadata.with_closed(*last_two).with_ledger_appended(handle.id)
        try:
            versioned = await _cas(manager, proposed, current.version)
        except BadVersion:
            log.info("log.open_conflict", log=name, attempt=attempt, discarded_ledger=handle.id)
            await _discard(bk, handle)
            continue
        except CasResultUnknown:
            raise  # the ledger may be in the list: keep it (a later writer fences it like any other)
        except BaseException:
            await _discard(bk, handle)
            raise
        log.info("log.writer_opened", log=name, ledger_id=handle.id, fenced=list(last_two))
        return LogWriter(
            bk,
            manager,
            versioned,
            handle,
            ensemble=ensemble,
            write_quorum=write_quorum,
            ack_quorum=ack_quorum,
            password=password,
            roll_entries_max=roll_entries_max,
        )
    raise MetadataConflict(f"log {name!r}: could not open as writer after {OPEN_ATTEMPTS_MAX} attempts")
