"""The log writer (docs/replication.md §7, docs/api.md "Logs").

Opening as leader: read the ledger list; fence and recover the last two ledgers
(``open_ledger(recovery=True)``, which closes them); create a new ledger whose id is above every
listed one; CAS the list with the recovered ledgers marked CLOSED (with their last entries) and the
new one appended. On a CAS conflict the new ledger is deleted and the open starts over. No append is
served before the CAS succeeded. A lost CAS answer is settled once that CAS can no longer land
(`settle_cas`: the list's version past the one it expected; a list still at that version gets the
CAS again, as a timed-out etcd txn may still commit): the new ledger listed, the CAS applied; not
listed, it never will be (a conflict), and only then is the ledger deleted.

Rolling (by entry count, payload bytes or age, or ``roll()``): create a new ledger, CAS it into the
list, switch appends to it, then close the previous one and mark it CLOSED in the list. Until the
first CAS succeeded appends go to the old ledger. Retention runs after each roll. Once its ledger is
chosen a roll runs to its end in a task of its own, whatever happens to its caller (a cancelled
``roll()`` or ``close()``): a listed ledger always gets the switch, and the ledger before it is
always closed and marked, or readers would stop at it. A roll's lost CAS answer is settled as an
open's: listed, the roll goes on; not listed, a spare the list still records stays the spare, any
other ledger is deleted. With the list unreadable then, the ledger is kept and the CAS settled
before the list next changes (`_repair`: in the background, and first in every roll, truncation and
close); so is a ledger rolled away from whose close failed closed again.

With automatic rolls the next ledger is created ahead, once the current one is half way to a limit
(`SPARE_AT`), and recorded in the list as its ``spare`` (one CAS): the roll itself is then the CAS
that lists it, the switch and the close, and the creation (an etcd write and the key derivation)
happens away from it. A spare whose bookie the client cannot reach is deleted and the roll creates
a fresh ledger. Whoever takes the log over (a new writer, an import, a delete) drops the spare from
the list in its CAS and deletes it; this writer's close deletes its own. DistributedLog's ledger
allocator does the same.

The writer's later CASes (roll, close, truncation) survive changes by others that leave it leader —
a truncation, a cursor-driven retention — by re-reading the list and applying their change again.
It is still leader while the list's last ledger is its own and OPEN (or CLOSED by its own close,
whose CAS answer was lost): a takeover (or an import, `append_ledgers`) always lists a ledger after
it. A writer that lost the log raises `LogFenced` and
stops for good.

Sequenced logs (``sequenced=True`` at creation): each record carries the writer-supplied sequence
number in an 8-byte header (`bookkeeper_aio.log.records`); a new writer learns the last one from the
log's last record, and ``append`` skips (returns None for) a sequence at or below it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, cast

import structlog

from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.ledger import HandleState, LedgerHandle
from bookkeeper_aio.errors import (
    BKError,
    BKInterfaceError,
    LedgerClosed,
    LedgerFenced,
    LogFenced,
    LogFull,
    MetadataConflict,
    NoSuchLedger,
    NoSuchLog,
)
from bookkeeper_aio.log import records
from bookkeeper_aio.log._common import (
    LostLogCas,
    cas_log,
    check_room,
    delete_ledgers,
    delete_spare,
    discard_ledger,
    ledger_log_tag,
    log_manager,
    read_or_create,
    recover_ledgers,
    settle_cas,
    taken_over,
)
from bookkeeper_aio.log.position import LogPosition, check_position
from bookkeeper_aio.log.truncation import (
    check_cut,
    plan_truncation,
    retention_cut,
    settle_lost_truncation,
    truncated_ids,
)
from metadata.errors import BadVersion, MetadataError
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogLedgerState, LogMetadata, has_room

log = structlog.get_logger("bookkeeper_aio.log.writer")

OPEN_ATTEMPTS_MAX = 50
CHANGE_ATTEMPTS_MAX = 100
ROLL_RETRY_S = 1.0
"""After a failed automatic roll (or spare), appends do not start another one for this long; the
repair of a failed roll step (`LogWriter._repair`) is tried again after it."""
ROLL_FULL_RETRY_S_MAX = 30.0
"""While the list is full (`LogFull`), automatic rolls and spares wait `ROLL_RETRY_S` doubled for
each refusal in a row, up to this: each try encodes the list (about 60 ms of CPU at 31,000
ledgers) and reads it again (another client's truncation makes room too), so a full log's writer
must not try every second until someone truncates. A truncation through this writer
(`truncate_before`, retention) ends the wait at once; one by another client is seen at the next
try."""
REPAIR_ATTEMPTS_MAX = 600
"""Background tries of a repair (`ROLL_RETRY_S` apart); the next roll, truncation and close() try
too."""
SPARE_AT = 0.5
"""The spare ledger is created once the current one reached this fraction of a roll limit."""
_FENCING_ERRORS = (LedgerFenced, LedgerClosed, MetadataConflict)
_new_tuple = tuple.__new__


class LogWriter:
    """The single writer (leader) of a log. Build with `open_log_writer`."""

    def __init__(
        self,
        bk: BookKeeper,
        manager: LogManager,
        versioned: VersionedLog,
        handle: LedgerHandle,
        *,
        ensemble: tuple[int, int, int],
        password: bytes,
        rolls: tuple[int | None, int | None, float | None],
        retention: tuple[float | None, int | None],
        last_sequence: int | None,
    ) -> None:
        self._bk = bk
        self._manager = manager
        self._versioned = versioned
        self._handle = self._adopt(handle)
        self._ensemble = ensemble
        self._password = password
        self._roll_at = rolls
        self._spare_at = tuple(None if limit is None else limit * SPARE_AT for limit in rolls)
        self._roll_limits_set = any(limit is not None for limit in rolls)
        self._retention = retention
        self._entries_in_ledger = 0
        self._bytes_in_ledger = 0
        self._loop = asyncio.get_running_loop()  # its time(): the clock a simulation replaces
        self._ledger_started = self._loop.time()
        self._roll_task: asyncio.Task[None] | None = None
        self._roll_lock = asyncio.Lock()
        self._append_lock = asyncio.Lock()
        self._queued = 0  # appends in the slow path (waiting for their turn or a window slot)
        self._roll_retry_at = 0.0
        self._full_retry_s = 0.0  # the wait after the last LogFull of an automatic roll or spare
        self._spare: LedgerHandle | None = None  # created ahead, recorded in the list as its spare
        self._spare_task: asyncio.Task[None] | None = None
        self._rolling: asyncio.Task[None] | None = None  # the last roll's CAS, switch and close
        self._spare_retry_at = 0.0
        self._unmarked: dict[int, tuple[int, int]] = {}  # closed by us, not yet CLOSED in the list
        self._unclosed: dict[int, LedgerHandle] = {}  # rolled away from, their close failed
        # a roll's ledger, its CAS answer lost and not settled yet (`_settle_roll`)
        self._maybe_listed: tuple[LedgerHandle, LostLogCas] | None = None
        self._repair_task: asyncio.Task[None] | None = None
        self._repairing = False  # the repair task holds the roll lock (close() waits, not cancels)
        self._close_done = False
        self._fenced: LogFenced | None = None
        self._closed = False
        self._sequenced = versioned.metadata.sequenced
        self._last_sequence = last_sequence

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

    @property
    def sequenced(self) -> bool:
        return self._sequenced

    @property
    def last_sequence(self) -> int | None:
        """Sequenced logs: the highest sequence number in the log when this writer opened it, then
        the highest this writer accepted (None: none yet)."""
        return self._last_sequence

    # ------------------------------------------------------------------ appends
    async def append(self, payload: bytes, *, sequence: int | None = None) -> LogPosition | None:
        """Append and wait; returns the record's position, or None when ``sequence`` is at or below
        `last_sequence` (a duplicate, not written). Raises `LogFenced` (another writer took over:
        this writer is stopped), the ledger API's errors (``outcome_unknown`` as documented there),
        BKInterfaceError (closed writer; a sequence on an unsequenced log or none on a sequenced
        one)."""
        future = await self.append_async(payload, sequence=sequence)
        return await future

    async def append_async(
        self, payload: bytes, *, sequence: int | None = None
    ) -> asyncio.Future[LogPosition | None]:
        """Hand ``payload`` to the current ledger; returns a future of its position (pipelining:
        waits only for a window slot, as `LedgerHandle.append_async`). Appends reach the log in the
        order of their calls, also from several tasks and across a roll (a FIFO lock: an append
        waiting for a slot on a ledger that a roll closes is sent to the new one before later
        calls)."""
        if self._fenced is not None or self._closed:
            self._check_writable()
        if sequence is None and not self._sequenced:
            data = payload  # the common case, without a call
        else:
            framed = self._frame(payload, sequence)
            if framed is None:
                return _skipped()
            data = framed
        inner = None
        if not self._queued:  # nobody waits before us: a free slot needs no turn
            try:
                inner = self._handle.append_nowait(data)
            except _FENCING_ERRORS as error:
                raise self._fence(error) from error
        if inner is None:
            sent = await self._append_in_turn(data, sequence)
            if sent is None:
                return _skipped()
            inner = sent
        if sequence is not None:
            self._last_sequence = sequence  # sent: a retry of it is a duplicate from now on
        self._entries_in_ledger += 1
        self._bytes_in_ledger += len(data)
        if self._roll_task is None and self._roll_limits_set:
            self._maybe_roll()
        return cast("asyncio.Future[LogPosition | None]", inner)  # the handle makes positions (_Results)

    async def _append_in_turn(self, data: bytes, sequence: int | None) -> asyncio.Future[int] | None:
        """The slow path: wait for a window slot in call order (a FIFO lock; ``_queued`` keeps
        later calls off the fast path meanwhile), following a roll. None: ``sequence`` turned out
        to be a duplicate of one sent while this call waited."""
        self._queued += 1
        try:
            async with self._append_lock:
                self._check_writable()
                if self._is_duplicate(sequence):
                    return None
                while True:
                    handle = self._handle
                    try:
                        return await handle.append_async(data)
                    except _FENCING_ERRORS as error:
                        if type(error) is LedgerClosed and not error.outcome_unknown:
                            # Closed by this writer while we waited for a slot: nothing was sent.
                            if handle is not self._handle:
                                continue  # a roll closed it: on to the new ledger
                            if self._closed:  # our own close(): a closed writer, not a fencing
                                raise BKInterfaceError(f"log {self.name!r}: the writer is closed") from error
                        raise self._fence(error) from error
        finally:
            self._queued -= 1

    def _frame(self, payload: bytes, sequence: int | None) -> bytes | None:
        """The entry's bytes, or None for a duplicate sequence."""
        if not self._sequenced:
            if sequence is not None:
                raise BKInterfaceError(f"log {self.name!r} is not sequenced: append without sequence=")
            return payload
        if sequence is None:
            raise BKInterfaceError(f"log {self.name!r} is sequenced: append needs sequence=N")
        data = records.encode_sequenced(sequence, payload)
        return None if self._is_duplicate(sequence) else data

    def _is_duplicate(self, sequence: int | None) -> bool:
        """Whether ``sequence`` is at or below the last one sent (logged: the append is skipped)."""
        last = self._last_sequence
        if sequence is None or last is None or sequence > last:
            return False
        log.debug("log.duplicate_skipped", log=self.name, sequence=sequence, last=last)
        return True

    def _adopt(self, handle: LedgerHandle) -> LedgerHandle:
        """Make ``handle``'s add futures complete with log positions, and fail with `LogFenced`
        when its ledger was fenced or closed under us (no second future per append)."""
        handle.adapt_results(_Results(self))
        return handle

    def _check_writable(self) -> None:
        if self._fenced is not None:
            raise LogFenced(self.name, "this writer was already fenced")
        if self._closed:
            raise BKInterfaceError(f"log {self.name!r}: the writer is closed")

    def _fence(self, error: BaseException | str) -> LogFenced:
        """Stop the writer; the `LogFenced` for the failed operation (``outcome_unknown`` copied)."""
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        unknown = isinstance(error, BKError) and error.outcome_unknown
        self._stop(detail)
        return LogFenced(self.name, str(detail), outcome_unknown=unknown)

    def _stop(self, error: BaseException | str) -> None:
        """Stop the writer for good (later appends raise `LogFenced`: open a new writer, which
        recovers the ledgers and learns where the log ends). Also after an append that failed once
        sent (NotEnoughBookies, a timeout): a later record must never follow a record that may be
        missing (`_switch`)."""
        if self._fenced is None:
            detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            log.warning("log.writer_fenced", log=self.name, ledger_id=self._handle.id, detail=detail)
            self._fenced = LogFenced(self.name, str(detail))
            self._handle.abort()

    # ------------------------------------------------------------------ list changes
    async def _change(
        self,
        change: Callable[[LogMetadata], LogMetadata],
        leader_ledger: int,
        current: VersionedLog | None = None,
    ) -> VersionedLog:
        """CAS ``change`` of the list, re-applied on a newer list while this writer is still its
        leader (``leader_ledger`` is the last ledger and OPEN, or CLOSED by this writer's own mark:
        a close whose CAS answer was lost); `LogFenced` once it is not. ``current``: the list as
        just read (default: this writer's copy)."""
        current = self._versioned if current is None else current
        for _ in range(CHANGE_ATTEMPTS_MAX):
            last = current.metadata.ledgers[-1] if current.metadata.ledgers else None
            if last is None or last.ledger_id != leader_ledger:
                raise self._fence("the ledger list changed (another writer took the log over)")
            if last.state is not LogLedgerState.OPEN:
                # Only our own close marks the last ledger CLOSED: a takeover lists one after it.
                if self._unmarked.get(leader_ledger) != (last.last_entry_id, last.length):
                    raise self._fence("the ledger list changed (another writer took the log over)")
                del self._unmarked[leader_ledger]  # the mark is in: a lost answer of ours applied
            proposed = change(self._with_unmarked(current.metadata))
            if proposed == current.metadata:
                self._versioned = current
                self._unmarked.clear()  # applying them changed nothing: the list has them
                return current
            try:
                self._versioned = await cas_log(self._manager, proposed, current.version)
                self._unmarked.clear()
                return self._versioned
            except BadVersion:
                pass
            except NoSuchLog as error:  # delete_log fences the writer; its list is gone
                raise self._fence("the log was deleted") from error
            try:
                current = await self._manager.read(self.name)
            except NoSuchLog as error:
                raise self._fence("the log was deleted") from error
        raise MetadataConflict(
            f"log {self.name!r}: the list kept changing ({CHANGE_ATTEMPTS_MAX} CAS conflicts)"
        )

    def _with_unmarked(self, md: LogMetadata) -> LogMetadata:
        """``md`` with the ledgers this writer closed but could not yet mark CLOSED (a failed CAS
        after the close) marked now: every later change of the list carries them."""
        closed_ms = self._manager.now_ms()
        for ledger_id, (last_entry_id, length) in self._unmarked.items():
            md = md.with_closed(ledger_id, last_entry_id=last_entry_id, length=length, closed_ms=closed_ms)
        return md

    # ------------------------------------------------------------------ roll
    def _maybe_roll(self) -> None:
        if self._roll_task is not None or self._loop.time() < self._roll_retry_at:
            return
        spare_wanted = self._spare is None and self._spare_task is None and self._due(self._spare_at)
        if spare_wanted and self._loop.time() >= self._spare_retry_at:
            self._spare_task = asyncio.create_task(self._prepare_spare())
        if self._due(self._roll_at):
            self._roll_task = asyncio.create_task(self._auto_roll())

    def _due(self, limits: tuple[float | None, ...]) -> bool:
        entries, size, age = limits
        return (
            (entries is not None and self._entries_in_ledger >= entries)
            or (size is not None and self._bytes_in_ledger >= size)
            or (age is not None and self._loop.time() - self._ledger_started >= age)
        )

    async def _auto_roll(self) -> None:
        try:
            await self.roll()
        except BKError as error:
            if self._closing("roll", error):
                return
            retry_s = self._wait_after(error)
            self._roll_retry_at = self._loop.time() + retry_s  # not on every append meanwhile
            log.warning("log.auto_roll_failed", log=self.name, error=repr(error), retry_in_s=retry_s)
        finally:
            self._roll_task = None

    def _closing(self, step: str, error: BKError) -> bool:
        """Whether ``close()`` was called: an automatic roll or spare that then fails (met the
        closed writer, or anything on the way) is no failure to warn about, as close() closes the
        ledger itself and wants no next one. Logged at debug level only."""
        if self._closed:
            log.debug("log.background_step_skipped", log=self.name, step=step, error=repr(error))
        return self._closed

    def _wait_after(self, error: BKError) -> float:
        """How long an automatic roll or spare waits after ``error``: `ROLL_RETRY_S`; after a
        LogFull, doubled for each one in a row up to `ROLL_FULL_RETRY_S_MAX`, the roll and the
        spare alike (both would meet the same full list)."""
        if not isinstance(error, LogFull):
            return ROLL_RETRY_S
        self._full_retry_s = min(ROLL_FULL_RETRY_S_MAX, 2 * self._full_retry_s or ROLL_RETRY_S)
        retry_at = self._loop.time() + self._full_retry_s
        self._roll_retry_at = max(self._roll_retry_at, retry_at)
        self._spare_retry_at = max(self._spare_retry_at, retry_at)
        return self._full_retry_s

    def _room_made(self) -> None:
        """The list changed so that a roll may fit (a roll, a truncation): automatic rolls and
        spares held back by a LogFull may try at once."""
        if self._full_retry_s:
            self._full_retry_s = 0.0
            self._roll_retry_at = self._spare_retry_at = 0.0

    async def _prepare_spare(self) -> None:
        """Create the next roll's ledger and record it in the list as the spare. A failure is
        logged: the roll then creates its ledger itself."""
        try:
            check_room(self._versioned.metadata)
            spare = await self._create_ledger()
            try:
                async with self._roll_lock:
                    self._check_writable()
                    await self._repair()
                    if spare.id <= self._versioned.metadata.last_ledger_id:  # a roll() overtook it
                        raise BKInterfaceError(f"ledger {spare.id} is below the list's last one")
                    await self._change(lambda md: md.with_spare(spare.id), self._handle.id)
                    self._spare = spare
            except BKError:
                await discard_ledger(self._bk, spare, self._password)
                raise
        except BKError as error:
            if self._closing("spare", error):
                return
            retry_s = self._wait_after(error)
            self._spare_retry_at = self._loop.time() + retry_s  # not on every append meanwhile
            log.warning("log.spare_failed", log=self.name, error=repr(error), retry_in_s=retry_s)
        finally:
            self._spare_task = None

    def _create_ledger(self) -> Awaitable[LedgerHandle]:
        ensemble, wq, aq = self._ensemble
        return self._bk.create_ledger(
            ensemble,
            wq,
            aq,
            password=self._password,
            after_ledger_id=self._versioned.metadata.last_ledger_id,
            custom_metadata=ledger_log_tag(self.name),
        )

    def _take_spare(self) -> LedgerHandle | None:
        """The spare, unless the client cannot reach one of its bookies now (reconnect backoff):
        then None, and it is left for `_drop_spare`."""
        spare = self._spare
        if spare is None:
            return None
        pool = self._bk.context.pool
        if any(pool.reconnect_delay_s(bookie) > 0 for bookie in spare.metadata.ensemble_for(0)):
            log.info("log.spare_unreachable", log=self.name, ledger_id=spare.id)
            return None
        self._spare = None
        return spare

    async def _drop_spare(self) -> None:
        """Delete a spare the list no longer records (`_take_spare` refused it, or the writer
        closes)."""
        spare, self._spare = self._spare, None
        if spare is not None:
            await discard_ledger(self._bk, spare, self._password)

    async def roll(self) -> int:
        """Move appends to a new ledger (the spare, or a new one: CAS it into the list, then close
        the previous one), then apply retention. Returns the new ledger's id. Raises `LogFenced`
        when another writer took the log over, `LogFull` (the list has no room for another ledger:
        nothing created; retention, if set, was applied first, and the list read again, as another
        client's truncation makes room too). Cancelling it once the new ledger
        is chosen does not stop the roll: its CAS, switch and close run on (`_finish_roll`), and
        `close()` waits for them."""
        self._check_writable()  # a closed writer's roll is misuse, not a fencing (retention below)
        if self._spare_task is not None:
            await asyncio.wait([self._spare_task])  # the ledger it makes is this roll's
        checked = self._versioned.metadata
        roomy = has_room(checked)  # checked once per list: it encodes it
        if not roomy:
            await self._apply_retention()  # it may make room
        await self._roll_lock.acquire()
        try:
            self._check_writable()
            await self._repair()
            if not roomy or self._versioned.metadata is not checked:
                await self._check_room(known_full=not roomy and self._versioned.metadata is checked)
            old = self._handle
            new = self._take_spare() or await self._create_ledger()
        except BaseException:
            self._roll_lock.release()
            raise
        finishing = asyncio.create_task(self._finish_roll(old, new))  # it releases the roll lock
        finishing.add_done_callback(_retrieve_error)
        self._rolling = finishing
        await asyncio.shield(finishing)
        self._room_made()
        await self._apply_retention()
        return new.id

    async def _check_room(self, *, known_full: bool) -> None:
        """`LogFull` (nothing created) unless the list has room for a roll. A full list is read
        again first: another client may have truncated it (adopted as a change of ours would be:
        `LogFenced` when this writer no longer leads it). ``known_full``: this copy was found
        full already (each check encodes it)."""
        if not known_full and has_room(self._versioned.metadata):
            return
        try:
            stored = await self._manager.read_if_changed(self.name, self._versioned.version)
        except NoSuchLog as error:
            raise self._fence("the log was deleted") from error
        except MetadataError as error:  # unreadable now: this writer's copy answers, as before
            log.info("log.full_list_unread", log=self.name, error=repr(error))
            stored = None
        if stored is not None:
            await self._change(lambda md: md, self._handle.id, stored)
        check_room(self._versioned.metadata)

    async def _finish_roll(self, old: LedgerHandle, new: LedgerHandle) -> None:
        """The roll once ``new`` is chosen, holding the roll lock (released at the end): CAS ``new``
        into the list, switch appends to it, close ``old`` and mark it CLOSED. One task that a
        cancelled `roll()` (``wait_for``, a cancelled `close()`) leaves running: a ledger the list
        names always gets the switch, and the ledger before it is always closed and marked, or
        readers would stop at it for good."""
        try:
            try:
                await self._change(lambda md: md.with_ledger_appended(new.id), old.id)
            except (BadVersion, LogFenced, MetadataConflict):
                # the list does not hold it: the CAS never applied
                await discard_ledger(self._bk, new, self._password)
                raise
            except LostLogCas as lost:
                if not await self._settle_roll(old, new, lost):
                    raise
            except BaseException:
                new.abort()  # it may be in the list (outcome unknown): a takeover recovers it
                raise
            await self._switch(old, new)
            log.info("log.rolled", log=self.name, old_ledger=old.id, new_ledger=new.id)
            await self._drop_spare()  # one _take_spare refused
            await self._close_old(old)
        finally:
            self._roll_lock.release()

    async def _settle_roll(self, old: LedgerHandle, new: LedgerHandle, lost: LostLogCas) -> bool:
        """A roll's CAS of ``new`` whose answer was ``lost``, settled by `settle_cas` (the list once
        that CAS can no longer land). True: ``new`` listed last, OPEN, right after ``old``: the CAS
        applied, the roll goes on to the switch. False: not listed, and never will be: ``new`` is
        kept for the next roll if the list records it as the spare, else discarded. Listed
        otherwise: another writer took the log over (`LogFenced`). Unsettled for now (the list
        unreadable): ``new`` may yet be listed, so it is kept; appends stay on ``old`` (a roll's old
        ledger may take appends until it is closed) and every change of the list waits until
        `_repair` settled it (in the background, and first in every roll, truncation and close);
        ``lost`` is raised."""
        self._maybe_listed = None
        try:
            current = await settle_cas(self._manager, lost)
        except NoSuchLog as deleted:
            await discard_ledger(self._bk, new, self._password)  # deleted with the log, or never listed
            raise self._fence("the log was deleted") from deleted
        if current is None:
            self._maybe_listed = (new, lost)
            self._schedule_repair()
            raise lost
        md = current.metadata
        index = md.index_of(new.id)
        if index is None:
            last = md.ledgers[-1] if md.ledgers else None
            leader = last is not None and last.ledger_id == old.id and last.state is LogLedgerState.OPEN
            keep = leader and md.spare == new.id and self._spare is None
            log.info("log.roll_answer_lost", log=self.name, ledger_id=new.id, applied=False, kept_spare=keep)
            if keep:
                self._spare = new  # still recorded as the spare: the next roll lists it
            else:
                await discard_ledger(self._bk, new, self._password)
            return False
        ours = (
            index == len(md.ledgers) - 1
            and index > 0
            and md.ledgers[index - 1].ledger_id == old.id
            and md.ledgers[index].state is LogLedgerState.OPEN
        )
        if not ours:
            new.abort()
            raise self._fence("the ledger list changed (another writer took the log over)") from lost
        log.info("log.roll_answer_lost", log=self.name, ledger_id=new.id, applied=True)
        self._versioned = current  # our CAS applied (with the marks it carried), others' after it
        self._unmarked.clear()
        return True

    async def _switch(self, old: LedgerHandle, new: LedgerHandle) -> None:
        """Send appends to ``new`` once every append sent to ``old`` is acknowledged (appends wait
        meanwhile, in order, on the slow path). A record acknowledged in the new ledger while an
        earlier one could still fail would leave a hole before it, and a crash then would keep the
        later record and lose the earlier (recovery closes the old ledger where its data ends):
        a log is a prefix of what its writer sent, as a ledger is, and a sequenced log's dedup,
        which trusts its last sequence, relies on it. If an append to ``old`` failed, the writer
        stops (`_stop`); ``new`` stays empty in the list, for the next writer to close."""
        self._queued += 1  # keeps appends off the fast path until the switch is done
        try:
            async with self._append_lock:
                try:
                    await old.wait_for_adds()
                except BKError as error:
                    self._stop(error)
                    new.abort()  # listed, never written: the next writer closes it empty
                    raise
                self._handle = self._adopt(new)
                self._entries_in_ledger = self._bytes_in_ledger = 0
                self._ledger_started = self._loop.time()
        finally:
            self._queued -= 1

    async def _close_old(self, old: LedgerHandle) -> None:
        """Close and mark the ledger a roll left. If its close fails (`MetadataUnavailable`, a
        timeout), it is kept and closed again later (`_repair`): left OPEN it would stop every
        reader at it, and truncation too."""
        try:
            await self._close_and_mark(old, self._handle.id)
        except LogFenced:
            raise
        except BKError:
            if old.state is not HandleState.CLOSED:
                self._unclosed[old.id] = old
                self._schedule_repair()
            raise

    # ------------------------------------------------------------------ repairs
    def _schedule_repair(self) -> None:
        if self._repair_task is None:
            self._repair_task = asyncio.create_task(self._repair_later())
            self._repair_task.add_done_callback(_retrieve_error)

    async def _repair_later(self) -> None:
        """Try `_repair` every `ROLL_RETRY_S` until it is done (or the writer stops)."""
        try:
            for _ in range(REPAIR_ATTEMPTS_MAX):
                await asyncio.sleep(ROLL_RETRY_S)
                if self._fenced is not None or not (self._unclosed or self._maybe_listed):
                    return
                async with self._roll_lock:
                    self._repairing = True
                    try:
                        await self._repair()
                        return
                    except LogFenced:
                        return
                    except BKError as error:
                        log.warning("log.repair_failed", log=self.name, error=repr(error))
                        if self._closed:
                            return  # close() repairs (and raises what fails): it waits for us
                    finally:
                        self._repairing = False
        finally:
            self._repair_task = None

    async def _repair(self) -> None:
        """What a failed roll step left, settled before the list changes again (the caller holds
        the roll lock): a roll's ledger whose CAS answer was lost with the list unreadable (listed:
        the roll goes on to it; not listed: discarded or kept as the spare), then the close of the
        ledgers rolled away from whose close failed. Raises what still fails (tried again later)."""
        if self._maybe_listed is not None:
            await self._settle_maybe_listed(*self._maybe_listed)
        if not self._unclosed:
            return
        for ledger_id, handle in list(self._unclosed.items()):
            try:
                await handle.close()
            except _FENCING_ERRORS as error:
                raise self._fence(error) from error
            del self._unclosed[ledger_id]
            md = handle.metadata
            self._unmarked[ledger_id] = (-1 if md.last_entry_id is None else md.last_entry_id, md.length)
            log.info("log.rolled_ledger_closed", log=self.name, ledger_id=ledger_id)
        await self._change(lambda md: md, self._handle.id)  # marks them CLOSED in the list

    async def _settle_maybe_listed(self, new: LedgerHandle, lost: LostLogCas) -> None:
        """A roll's CAS of ``new`` whose answer was lost, unsettled then (`_settle_roll`): settle it
        now. Applied: switch to ``new`` and close the current ledger (the roll's end)."""
        old = self._handle
        if not await self._settle_roll(old, new, lost):
            return
        await self._switch(old, new)
        log.info("log.rolled", log=self.name, old_ledger=old.id, new_ledger=new.id)
        await self._close_old(old)

    async def _close_and_mark(
        self,
        handle: LedgerHandle,
        leader_ledger: int,
        change: Callable[[LogMetadata], LogMetadata] = lambda current: current,
    ) -> None:
        """Close ``handle`` (waiting for its pending adds), then mark it CLOSED in the list (with
        ``change``); if that CAS fails, the mark rides along with the writer's next change of the
        list."""
        try:
            await handle.close()
        except _FENCING_ERRORS as error:
            raise self._fence(error) from error
        md = handle.metadata
        self._unmarked[handle.id] = (-1 if md.last_entry_id is None else md.last_entry_id, md.length)
        await self._change(change, leader_ledger)

    # ------------------------------------------------------------------ truncation
    async def truncate_before(self, position: LogPosition, *, force: bool = False) -> LogPosition | None:
        """Drop the whole ledgers before ``position``'s ledger from the list (never the ledger being
        written, never past the slowest named cursor) and delete them. Returns the log's first
        position afterwards. A ledger the log does not list is refused unless ``force``. See
        `bookkeeper_aio.log.truncate_log`."""
        check_position(position, "position")
        self._check_writable()
        async with self._roll_lock:
            await self._repair()
            check_cut(self._versioned.metadata, position.ledger_id, force=force)
            return await self._truncate(position.ledger_id)

    async def _apply_retention(self) -> None:
        age_s, size = self._retention
        if age_s is None and size is None:
            return
        cut = retention_cut(self._versioned.metadata, age_s, size, self._manager.now_ms())
        if cut is not None:
            try:
                async with self._roll_lock:
                    await self._repair()
                    await self._truncate(cut)
            except BKError as error:
                log.warning("log.retention_failed", log=self.name, error=repr(error))

    async def _truncate(self, before_ledger_id: int) -> LogPosition | None:
        change, planned = await plan_truncation(
            self._bk, self._manager, self._versioned.metadata, before_ledger_id, self._password
        )
        try:
            versioned = await self._change(change, self._handle.id)
        except LostLogCas as lost:
            # Settled once it can no longer land (the ledgers it dropped are deleted, never
            # orphaned); our own view stays as it was: the next change meets BadVersion and reads
            # the list again.
            try:
                versioned = await settle_lost_truncation(self._manager, planned, lost)
            except NoSuchLog as error:
                raise self._fence("the log was deleted") from error
        dropped = truncated_ids(versioned.metadata, planned)
        self._room_made()
        await delete_ledgers(self._bk, self.name, dropped, self._password, why="truncated")
        return LogPosition(versioned.metadata.ledgers[0].ledger_id, 0)

    # ------------------------------------------------------------------ close
    async def close(self) -> None:
        """Close the current ledger and mark it CLOSED in the list. Idempotent; after a failure
        (e.g. `MetadataUnavailable`) calling it again tries again. No append is accepted once it
        was called."""
        if self._close_done:
            return
        self._closed = True
        if self._roll_task is not None:
            with contextlib.suppress(BKError):  # shielded: a cancelled close() leaves the roll be
                await asyncio.shield(self._roll_task)
        if self._rolling is not None:
            with contextlib.suppress(BKError):
                await asyncio.shield(self._rolling)
        if self._spare_task is not None:
            await asyncio.wait([self._spare_task])
        if self._repair_task is not None:
            if not self._repairing:
                self._repair_task.cancel()  # asleep: this close repairs now
            await asyncio.wait([self._repair_task])
        if self._fenced is None:
            async with self._roll_lock:
                await self._repair()
                await self._close_and_mark(self._handle, self._handle.id, lambda md: md.with_spare(None))
        else:  # the new leader recovers them (listed) or they never were (an orphan at worst)
            maybe_listed = () if self._maybe_listed is None else (self._maybe_listed[0],)
            for handle in (*self._unclosed.values(), *maybe_listed):
                handle.abort()
        await self._drop_spare()  # fenced: the new leader deletes it too (the list records it)
        self._close_done = True

    async def __aenter__(self) -> LogWriter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _retrieve_error(task: asyncio.Task[Any]) -> None:
    """A background step's error is retrieved (its caller may have been cancelled) and logged."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.info("log.background_step_failed", error=repr(error))


def _skipped() -> asyncio.Future[LogPosition | None]:
    """The future of an append not made (a duplicate sequence): None, at once."""
    future: asyncio.Future[LogPosition | None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class _Results:
    """A log writer's `AddResults`: positions, and `LogFenced` for a fenced or closed ledger."""

    __slots__ = ("_writer",)

    def __init__(self, writer: LogWriter) -> None:
        self._writer = writer

    @staticmethod
    def ok(ledger_id: int, entry_id: int) -> LogPosition:
        return _new_tuple(LogPosition, (ledger_id, entry_id))  # LogPosition(...) without its __new__

    def failed(self, error: BKError) -> BKError:
        if not isinstance(error, _FENCING_ERRORS):
            self._writer._stop(error)  # the record may be missing: nothing may follow it
            return error
        fenced = self._writer._fence(error)
        fenced.__cause__ = error
        return fenced


async def open_log_writer(
    bk: BookKeeper,
    name: str,
    *,
    ensemble: int = 3,
    write_quorum: int = 2,
    ack_quorum: int = 2,
    password: bytes = b"",
    create: bool = True,
    sequenced: bool = False,
    roll_entries_max: int | None = None,
    roll_bytes_max: int | None = None,
    roll_age_s: float | None = None,
    retention_age_s: float | None = None,
    retention_bytes: int | None = None,
) -> LogWriter:
    """Become the log's writer (docs/replication.md §7). Fences whoever wrote before.

    ``sequenced`` applies when this call creates the log. Raises NoSuchLog (``create=False`` and no
    such log), MetadataFormatError (a corrupt log key, naming the log), LogFull (the list has no
    room for another ledger: truncate it), the ledger API's errors (recovery, creation),
    BKInterfaceError (bad limits).
    """
    _check_limits(roll_entries_max, roll_bytes_max, roll_age_s, retention_age_s, retention_bytes)
    manager = log_manager(bk)
    for attempt in range(1, OPEN_ATTEMPTS_MAX + 1):
        current = await read_or_create(manager, name, create=create, sequenced=sequenced)
        fencing = _to_recover(current.metadata)
        try:
            recovered = await recover_ledgers(bk, fencing, password)  # fence: the old leader's adds fail
        except NoSuchLedger:
            if await _still_listed_missing(manager, name, fencing, bk):
                raise  # a listed ledger is gone (deleted by hand): the log lost data, say so
            continue  # a truncation removed it from the list meanwhile: start over
        check_room(current.metadata)
        handle = await bk.create_ledger(
            ensemble,
            write_quorum,
            ack_quorum,
            password=password,
            after_ledger_id=current.metadata.last_ledger_id,
            custom_metadata=ledger_log_tag(name),
        )
        proposed = taken_over(current.metadata, recovered, manager.now_ms())
        proposed = proposed.with_ledger_appended(handle.id)
        taking = asyncio.create_task(_take_over(bk, manager, current, proposed, handle, password))
        taking.add_done_callback(_retrieve_error)
        try:
            versioned = await asyncio.shield(taking)  # a cancelled open still deletes the spare it dropped
        except BaseException:
            handle.abort()  # it may be in the list (outcome unknown, cancelled): a later writer fences it
            raise
        if versioned is None:
            log.info("log.open_conflict", log=name, attempt=attempt, ledger_id=handle.id)
            continue  # its ledger discarded (not listed) or left to the writer after it (listed)
        last_sequence = await _last_sequence(bk, manager, versioned, password)
        log.info("log.writer_opened", log=name, ledger_id=handle.id, fenced=list(fencing))
        writer = LogWriter(
            bk,
            manager,
            versioned,
            handle,
            ensemble=(ensemble, write_quorum, ack_quorum),
            password=password,
            rolls=(roll_entries_max, roll_bytes_max, roll_age_s),
            retention=(retention_age_s, retention_bytes),
            last_sequence=last_sequence,
        )
        await writer._apply_retention()
        return writer
    raise MetadataConflict(f"log {name!r}: could not open as writer after {OPEN_ATTEMPTS_MAX} attempts")


async def _take_over(
    bk: BookKeeper,
    manager: LogManager,
    current: VersionedLog,
    proposed: LogMetadata,
    handle: LedgerHandle,
    password: bytes,
) -> VersionedLog | None:
    """The open's CAS of ``proposed`` (``current`` taken over, ``handle`` appended), then the deletion
    of the spare it dropped from the list. None: the CAS did not apply (``handle`` is discarded:
    start over). A lost answer is settled by `settle_cas` (the list once that CAS can no longer
    land): ``handle`` listed, the CAS applied (if another writer already listed a ledger after it,
    the open starts over: None); not listed, it never will be. Unsettled (the list unreadable for
    the whole budget): the `LostLogCas` is raised, and ``handle`` is kept (it may yet be listed).
    """
    try:
        versioned = await cas_log(manager, proposed, current.version)
    except (BadVersion, NoSuchLog):
        # The CAS never applied (or the log was deleted, with whatever it listed): no list holds it.
        await discard_ledger(bk, handle, password)
        return None
    except LostLogCas as lost:
        try:
            read = await settle_cas(manager, lost)
        except NoSuchLog:
            await discard_ledger(bk, handle, password)  # deleted with the log, or never listed
            return None
        if read is None:
            raise  # the caller aborts the handle: it may yet be listed, a later writer fences it
        versioned, md = read, read.metadata
        applied = md.index_of(handle.id) is not None
        log.info("log.open_answer_lost", log=md.name, ledger_id=handle.id, applied=applied)
        if not applied:
            await discard_ledger(bk, handle, password)
            return None
        if current.metadata.spare is not None and current.metadata.spare != md.spare:
            await delete_spare(bk, current.metadata, password)
        last = md.ledgers[-1]
        if last.ledger_id != handle.id or last.state is not LogLedgerState.OPEN:
            handle.abort()  # listed, then taken over by another writer: start over
            return None
        return versioned
    await delete_spare(bk, current.metadata, password)
    return versioned


async def _still_listed_missing(
    manager: LogManager, name: str, ledger_ids: tuple[int, ...], bk: BookKeeper
) -> bool:
    """Whether one of ``ledger_ids`` is still in the log's list yet has no ledger metadata."""
    listed = set((await manager.read(name)).metadata.ledger_ids)
    for ledger_id in ledger_ids:
        if ledger_id in listed and not await bk.context.ledgers.exists(ledger_id):
            return True
    return False


async def _last_sequence(
    bk: BookKeeper, manager: LogManager, versioned: VersionedLog, password: bytes
) -> int | None:
    """`records.last_sequence` of the list; a truncation that removes a ledger while it is read
    sends it to the newer list (whose ``truncated_sequence`` then covers what went)."""
    md = versioned.metadata
    for _ in range(OPEN_ATTEMPTS_MAX):
        try:
            return await records.last_sequence(bk, md, password)
        except NoSuchLedger:
            md = (await manager.read(md.name)).metadata
    raise MetadataConflict(f"log {md.name!r}: the list kept being truncated while reading its last sequence")


def _to_recover(md: LogMetadata) -> tuple[int, ...]:
    """The ledgers a new writer fences and recovers: the last two (§7), and any other the list
    still has OPEN (its mark was lost; no writer can be on it, but truncation waits for the mark)."""
    last_two = md.ledger_ids[-2:]
    stale = [e.ledger_id for e in md.ledgers[:-2] if e.state is LogLedgerState.OPEN]
    return (*stale, *last_two)


def _check_limits(*limits: float | None) -> None:
    names = ("roll_entries_max", "roll_bytes_max", "roll_age_s", "retention_age_s", "retention_bytes")
    for what, value in zip(names, limits, strict=True):
        if value is not None and not value > 0:
            raise BKInterfaceError(f"{what} must be > 0 (or None), got {value!r}")
