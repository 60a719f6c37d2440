"""Ledger storage: the journal, the per-ledger state and index, checkpoints, reads.

Entries live in journal segments and are found through each ledger's index; there is no separate
entry log (yet): one write path, one sync per group, reads by ``pread`` of the record.

Rules this module keeps:

- an entry enters the index, and the LAC it piggybacks takes effect, only after its record is
  durable (the journal's completion callback);
- the first add (or fence carrying a key) of a ledger journals its master key before the entry;
- a fence sets the bit in memory at once (adds are refused from that instant: atomic with respect to
  adds, since the loop is single-threaded) and its callback fires after the FENCE record is durable;
- reads verify the record's CRC32C; a damaged record is :class:`EntryCorrupt` (EIO), never "no entry";
- while a ledger is in limbo (:mod:`bookie.limbo`: a journal cut may have lost what it held) a read
  of what the bookie does not hold is :class:`Unknown` (EUNKNOWNLEDGERSTATE), never "no entry", and
  a writer's add waits for metadata to show the ledger OPEN (one check per ledger: the add path
  pays one ``is not None`` per add while nothing is in limbo).

The add path (:meth:`Storage.add_run`) takes a connection's consecutive ADD requests at once: the
entry-body checks, the ledger checks (master key, fence, read-only through the caller's check),
then each entry body goes into one journal batch (:meth:`~bookie.journal.Journal.open_batch`),
whose records the journal makes at its close. What the completion needs is kept in
one :class:`AddBatch` per reply target and journal group (three lists over all its adds, no object
per add), cut into runs of one ledger (:class:`AddRun`: a slice of those lists, no list of its own:
with many ledgers every run holds one add); the batch indexes them and answers. Every add, the
inline-decoded ones and the others, goes this way: there is one add path.

Seams (docs/internals.md §2): files through :class:`~bookie.fileio.FileIO`, threads and executors through
:class:`~bookie.threads.Threads`, time through :class:`~bookkeeper_aio.common.clock.Clock`.

Typed errors (mapped to wire statuses by the processor): :class:`NoLedger`, :class:`NoEntry`,
:class:`Unknown`, :class:`Fenced`, :class:`Unauthorized`, :class:`EntryCorrupt`, :class:`BadRequest`,
:class:`~bookie.journal.JournalError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from bookie import checkpoint, replay
from bookie import journal_format as fmt
from bookie.cookie import ensure_cookie
from bookie.fileio import OS_FILE_IO, FileIO
from bookie.index import Location, segment_position, split_position
from bookie.journal import Callback, Journal, JournalConfig, JournalError, RecordBatch
from bookie.journal_format import Position
from bookie.ledger_keys import KeyRefused, KeyVerifier
from bookie.ledger_state import LedgerState, WakeReason
from bookie.limbo import Limbo, save_blocking
from bookie.threads import OS_THREADS, Threads
from bookkeeper_aio.common import failpoints
from bookkeeper_aio.common.clock import SYSTEM_CLOCK, Clock
from bookkeeper_aio.protocol.codes import AddFlag
from bookkeeper_aio.protocol.messages import AddEntryRequest

if TYPE_CHECKING:
    from bookkeeper_aio.protocol.messages import AddRequests

log = structlog.get_logger(__name__)

READ_FDS_MAX = 256
"""Open read descriptors on journal segments; beyond this the least recently opened is closed."""

_COALESCE_GAP_BYTES = 64 * 1024
"""Compaction reads live records that lie closer than this in one ``pread`` (dead bytes between)."""
_COALESCE_BYTES_MAX = 4 * 1024 * 1024
_READ_GAP_BYTES = 16 * 1024
"""A batch read reads the records of its entries that lie closer than this in one ``pread``: a
read call (syscall, buffer, Python) costs about what copying ~16 KiB more does. A stripe's records
lie a few records apart (the bookie's other stripes, other ledgers' records between them)."""
_READ_SPAN_BYTES_MAX = 1024 * 1024
CHECKPOINT_POLL_S = 1.0
"""How often the checkpoint policy (:meth:`Storage.checkpoint_due`) is checked."""
CHECKPOINT_SLICE_S = 0.005
"""Loop time a checkpoint takes at most in one go while it collects rows (the 50 ms target with a
million ledgers leaves room for the other work of the same turn)."""
GC_FREEZE_LEDGERS_MIN = 10_000
"""From this many ledgers recovered at the start, the recovered objects are moved out of the cyclic
garbage collector's reach (``gc.freeze``): a full collection walks every tracked object, and with a
million ledgers (three objects each) that held the event loop for 2.9 s. They hold no cycles;
refcounting still frees each one that goes (a dropped ledger). Below it the walk is short."""
ROW_CACHE_BYTES_MAX = 64 * 1024
"""Checkpoint rows up to this size are kept between checkpoints (most ledgers: ~100 bytes). A
bigger one (a ledger of ~5000 entries or more) is encoded again each time instead of doubling the
memory its index takes; a busy ledger changes between checkpoints anyway."""


class StorageError(Exception):
    """Base of the storage layer's typed errors."""


class NoLedger(StorageError):
    pass


class NoEntry(StorageError):
    pass


class Unknown(StorageError):
    """The bookie does not hold what was asked and cannot say it never did: the ledger is in limbo
    (:mod:`bookie.limbo`) -> EUNKNOWNLEDGERSTATE, never ENOENTRY / ENOLEDGER."""


class Fenced(StorageError):
    pass


class Unauthorized(StorageError):
    pass


class EntryCorrupt(StorageError):
    """A stored record that fails its checksum or names another entry: answer EIO, never ENOENTRY."""


def _corrupt(ledger_id: int, entry_id: int, data: memoryview) -> EntryCorrupt:
    """The error for a record ``data`` the index points entry ``ledger_id:entry_id`` at and that
    is not that entry's valid ENTRY record (reads check with ``fmt.entry_bodies``)."""
    record = fmt.decode_record_at(bytes(data), 0)
    if record is None or record.type not in fmt.ENTRY_TYPES:
        return EntryCorrupt(f"entry {ledger_id}:{entry_id}: journal record fails its checksum")
    return EntryCorrupt(f"entry {ledger_id}:{entry_id}: index points at another record")


class BadRequest(StorageError):
    """A request that is well-formed on the wire but not an acceptable one (an ADD whose entry
    body does not carry its ledger and entry ids)."""


@dataclass(frozen=True)
class StorageConfig:
    data_dir: str
    bookie_id: str
    journal: JournalConfig = field(default_factory=JournalConfig)
    checkpoint_interval_s: float = 30.0
    """How often the index is checkpointed when the journal moved: bounds replay time at restart."""
    checkpoint_journal_bytes: int = 256 * 1024 * 1024
    """A checkpoint is also written once the journal grew by this much since the last one, so what
    a restart replays is bounded whatever the write rate (replay runs at ~150-200k records/s)."""
    checkpoint_journal_records: int = 500_000
    """The same bound in records (small entries replay slower per byte)."""
    limbo_after_cut: bool = True
    """A torn-tail cut puts every ledger in limbo first (:mod:`bookie.limbo`)."""


# ledger id, entry id, piggybacked LAC (protocol/digest.py), and the entry's length, not unpacked:
# a body shorter than digest.HEADER_BYTES fails the unpacking
_BODY_HEADER = struct.Struct(">qqq8x")
_unpack_body_header = _BODY_HEADER.unpack_from
_struct_error = struct.error
_RECOVERY_ADD = int(AddFlag.RECOVERY_ADD)
_ENTRY_RECORD_OVERHEAD_BYTES = fmt.ENTRY_RECORD_OVERHEAD_BYTES
_entry_bodies = fmt.entry_bodies
_compare_digest = hmac.compare_digest
AddGate = Callable[[bool], None]
"""The caller's read-only gate: ``gate(recovery)`` raises to refuse an add."""


class AddRun:
    """Adds of one ledger whose records lie back to back in one journal segment, from ``offset``:
    the adds ``start`` to ``stop`` of their :class:`AddBatch`'s lists (entry ids and record lengths
    for the index, request ids for the answers), and the highest LAC they piggyback. A slice of the
    batch's lists, not lists of its own: writing to many ledgers makes a run per add (measured with
    10,000 ledgers: the run's three lists were a fifth of the loop's time, allocation and the
    collections it triggers)."""

    __slots__ = ("lac_max", "offset", "segment_id", "start", "state", "stop")

    def __init__(self, state: LedgerState, segment_id: int, offset: int, start: int) -> None:
        self.state = state
        self.segment_id = segment_id
        self.offset = offset
        self.start = start
        self.stop = start
        self.lac_max = -1


class AddBatch:
    """Completion of one reply target's adds in one journal group, subclassed by the caller: one
    journal callback for them all. Its adds' entry ids, record lengths and request ids are in
    ``entry_ids``, ``lengths``, ``request_ids`` (journal order), cut into ``runs`` of one ledger.
    Once the group is durable it indexes every run's entries and advances each ledger's
    piggybacked LAC, then calls :meth:`on_durable` (``error`` None on success; on error nothing is
    indexed). :meth:`on_error` answers an add refused before the journal, at once. ``end``: where
    the last run's records end (set by each :meth:`Storage.add_run` that gave it a run)."""

    __slots__ = ("end", "entry_ids", "lengths", "request_ids", "runs", "target")

    def __init__(self, target: Any) -> None:
        self.target = target
        self.runs: list[AddRun] = []
        self.entry_ids: list[int] = []
        self.lengths: list[int] = []
        self.request_ids: list[int] = []
        self.end = 0

    def on_durable(self, error: BaseException | None) -> None:
        raise NotImplementedError

    def on_error(self, request_id: int, error: BaseException) -> None:
        raise NotImplementedError

    def __call__(self, error: BaseException | None) -> None:
        if error is None:
            entry_ids, lengths = self.entry_ids, self.lengths
            for run in self.runs:
                state = run.state
                start, stop = run.start, run.stop
                if stop - start == 1:  # one add of this ledger (many ledgers): no slices
                    state.index.put(entry_ids[start], run.segment_id, run.offset, lengths[start])
                else:
                    state.index.put_run(
                        run.segment_id, run.offset, entry_ids[start:stop], lengths[start:stop]
                    )
                state.row = None  # its checkpoint row is stale
                if run.lac_max > state.piggyback_lac:
                    state.advance_piggyback(run.lac_max)
        self.on_durable(error)


def _continued(batch: AddBatch, records: RecordBatch) -> AddRun | None:
    """``batch``'s last run if the records about to be appended at ``records.offset`` follow its
    own back to back (nothing was journaled between: a later socket read's adds go on the same run,
    one index loop and one LAC update per run, not per read), else None."""
    run = batch.runs[-1]
    if run.segment_id == records.segment_id and batch.end == records.offset:
        return run
    return None


def durable_future(
    loop: asyncio.AbstractEventLoop,
) -> tuple[asyncio.Future[None], Callable[[BaseException | None], None]]:
    """A future and the journal callback (``error`` or None once durable) that resolves it."""
    durable: asyncio.Future[None] = loop.create_future()

    def done(error: BaseException | None) -> None:
        if not durable.done():
            if error is None:
                durable.set_result(None)
            else:
                durable.set_exception(error)

    return durable, done


class Storage:
    """Owner of the journal, the ledger states and the checkpoint task."""

    def __init__(
        self,
        config: StorageConfig,
        fileio: FileIO,
        recovered: replay.Recovered,
        lock_fd: int,
        threads: Threads = OS_THREADS,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = config
        self.fileio = fileio
        self.ledgers: dict[int, LedgerState] = recovered.ledgers
        self._loop = asyncio.get_running_loop()
        self._journal_dir = os.path.join(config.data_dir, replay.JOURNAL_DIR)
        self.journal = Journal(
            fileio,
            self._journal_dir,
            recovered.start,
            config.journal,
            threads,
            clock,
            synced_mark=os.path.join(config.data_dir, fmt.SYNCED_MARK_FILE),
            start_format=recovered.start_format,
            previous_end=recovered.previous_end,
        )
        self._clock = clock
        self._lock_fd = lock_fd
        self._reader = threads.executor("storage-reader")
        self._reads_nowait = fileio.reads_nowait
        self._cold = threads.executor("storage-cold")
        self._read_fds: dict[int, int] = {}
        self._fds_lock = threading.Lock()
        self._checkpointed = recovered.replayed_from or recovered.start
        """The position of the checkpoint on disk: replay after a crash starts there."""
        self._checkpointed_at = (0, 0)  # the journal's (records, bytes) written when it was taken
        self._replayed = recovered.records_replayed
        self._checkpoint_task: asyncio.Task[None] | None = None
        self._checkpoint_lock = asyncio.Lock()
        self._forgotten = False
        """A ledger was forgotten since the last checkpoint began (:meth:`forget_ledger`)."""
        self.keys: KeyVerifier | None = None
        """Checks keys against metadata before adopting one (set when the bookie has metadata)."""
        self._rekeys_unsynced = 0
        self._rekey_waiters: list[asyncio.Future[None]] = []
        self._rekey_failed: BaseException | None = None
        self.limbo: Limbo | None = recovered.limbo
        """The ledgers in limbo (:mod:`bookie.limbo`); None when none is (the common case)."""

    @classmethod
    async def open(
        cls,
        config: StorageConfig,
        fileio: FileIO = OS_FILE_IO,
        threads: Threads = OS_THREADS,
        clock: Clock = SYSTEM_CLOCK,
    ) -> Storage:
        """Guard the data dir (lock + cookie), recover state, start the journal.

        Raises ``BlockingIOError`` (dir in use), :class:`~bookie.cookie.CookieMismatch`,
        :class:`~bookie.journal_format.JournalCorrupt`, :class:`~bookie.checkpoint.CheckpointCorrupt`.
        """
        config.journal.validate()
        loop = asyncio.get_running_loop()
        fileio.makedirs(config.data_dir)
        lock_fd = fileio.lock_dir(config.data_dir)
        recovery = threads.executor("storage-recovery")
        try:
            with _gc_paused():  # else collections walk the objects recovery is building, GIL held
                recovered = await loop.run_in_executor(recovery, _recover_blocking, fileio, config)
                if len(recovered.ledgers) >= GC_FREEZE_LEDGERS_MIN:
                    gc.freeze()
        except BaseException:
            fileio.close(lock_fd)
            raise
        finally:
            recovery.shutdown(wait=False)
        log.info(
            "storage.recovered",
            ledgers=len(recovered.ledgers),
            records_replayed=recovered.records_replayed,
            torn_bytes_cut=recovered.torn_bytes_cut,
            limbo_ledgers=None if recovered.limbo is None else recovered.limbo.count(),
            start_segment=recovered.start.segment_id,
            start_offset=recovered.start.offset,
        )
        storage = cls(config, fileio, recovered, lock_fd, threads, clock)
        storage._checkpoint_task = loop.create_task(storage._checkpoint_loop(), name="storage-checkpoint")
        return storage

    # ------------------------------------------------------------------ writes
    def ledger_for_write(self, ledger_id: int, master_key: bytes) -> LedgerState:
        """The ledger's state for a write carrying ``master_key``: a new ledger is created and the
        first key adopted (journaled before the entry). Raises :class:`Unauthorized`."""
        state = self.ledgers.get(ledger_id)
        if state is not None and state.master_key is not None:
            if not hmac.compare_digest(state.master_key, master_key):
                raise Unauthorized(f"ledger {ledger_id}: master key mismatch")
            return state
        # Journaled first: a journal that refuses it leaves no key (nor ledger) adopted in memory.
        self.journal.append((fmt.encode_master_key(ledger_id, master_key),), None)
        if state is None:
            state = self.ledgers[ledger_id] = LedgerState(ledger_id)
        state.master_key = master_key
        state.row = None
        return state

    def add_run(
        self,
        requests: AddRequests,
        target: Any,
        batch_type: type[AddBatch],
        check_add: AddGate | None = None,
        *,
        keys_checked: bool = False,
    ) -> None:
        """Journal consecutive adds of one reply target, in order, each checked: its entry body
        carries its ids (:class:`BadRequest`), ``check_add(recovery)`` (the read-only gate; None:
        writable), the key (:class:`Unauthorized`), the fence unless a recovery add
        (:class:`Fenced`), the record size (:class:`JournalError`). A refused add is answered at
        once (``on_error`` of a ``batch_type(target)``), the others by such a batch once durable.
        An add of a ledger not held yet, or with a key other than the held one, waits for the
        metadata check of :attr:`keys` when there is one (``keys_checked``: it was done)."""
        journal = self.journal
        keys = None if keys_checked else self.keys
        limbo = self.limbo
        batch = self._batch_for(target, batch_type)
        entry_ids, lengths, request_ids = batch.entry_ids, batch.lengths, batch.request_ids
        ledgers = self.ledgers
        records: RecordBatch | None = None  # the journal batch open, if any
        run: AddRun | None = None
        run_state: LedgerState | None = None  # run.state, and run.lac_max below, kept in locals
        offset = end = record_max = lac_max = 0
        # the last key check passed (below): ledger id, key, state
        checked_lid, checked_key, checked_state = -1, b"", None
        state: LedgerState | None
        try:
            for _, rid, lid, eid, flags, key, body in requests.fields:
                try:
                    try:
                        ledger_id, entry_id, lac = _unpack_body_header(body)
                    except _struct_error:
                        message = f"entry body of {len(body)} bytes is shorter than its header"
                        batch.on_error(rid, BadRequest(message))
                        continue
                    if ledger_id != lid or entry_id != eid:
                        batch.on_error(rid, BadRequest(f"entry body does not carry ledger {lid} entry {eid}"))
                        continue
                    if check_add is not None:
                        check_add(flags & _RECOVERY_ADD != 0)
                    if (
                        limbo is not None
                        and keys is not None
                        and not flags & _RECOVERY_ADD
                        and limbo.wants_write_check(lid)
                    ):
                        # metadata must show it OPEN first: its fence may have been cut (bookie/limbo.py)
                        keys.park(
                            AddEntryRequest(rid, lid, eid, flags, key, body), target, batch_type, check_add
                        )
                        continue
                    if lid == checked_lid and key == checked_key and checked_state is not None:
                        # The key an earlier add of this call passed the constant-time check with,
                        # for this ledger: this compare's timing tells the sender only of two keys
                        # it sent itself (a call's adds are one connection's).
                        state = checked_state
                    else:
                        state = ledgers.get(lid)  # ledger_for_write decides a new ledger or a wrong key
                        if (
                            state is None
                            or (known_key := state.master_key) is None
                            or not _compare_digest(known_key, key)
                        ):
                            if keys is not None and keys.wants(lid, key):  # checked against metadata first
                                parked = AddEntryRequest(rid, lid, eid, flags, key, body)
                                keys.park(parked, target, batch_type, check_add)
                                continue
                            if records is not None:  # a new ledger journals its key first
                                closing, records = records, None  # closed once even if this raises
                                journal.close_batch(closing, offset, batch)
                            state = self.ledger_for_write(lid, key)
                        checked_lid, checked_key, checked_state = lid, key, state
                    if state.fenced and not flags & _RECOVERY_ADD:
                        batch.on_error(rid, Fenced(f"ledger {lid} is fenced"))
                        continue
                    size = _ENTRY_RECORD_OVERHEAD_BYTES + len(body)
                    if records is None or offset + size > end or size > record_max:
                        if records is not None:  # full: the next batch starts in the next segment
                            closing, records = records, None
                            journal.close_batch(closing, offset, batch)
                        records = journal.open_batch(size)  # rolls to the next segment, or raises
                        bodies, offset, end = records.entry_bodies, records.offset, records.end  # in locals
                        record_max = records.record_max
                        run_state = None
                        if run is None and batch.runs:  # this target's adds of an earlier read
                            run = _continued(batch, records)
                            if run is not None:
                                run_state, lac_max = run.state, run.lac_max
                    if state is not run_state:
                        if run is not None:
                            run.lac_max = lac_max
                            run.stop = len(entry_ids)
                        run = AddRun(state, records.segment_id, offset, len(entry_ids))
                        batch.runs.append(run)
                        run_state, lac_max = state, -1
                    bodies.append(body)
                    entry_ids.append(eid)
                    lengths.append(size)
                    request_ids.append(rid)
                    if lac > lac_max:
                        lac_max = lac
                    offset += size
                except (StorageError, JournalError, OSError, KeyRefused) as exc:
                    batch.on_error(rid, exc)
                except Exception as exc:  # a bug: answer (EIO), keep serving
                    log.exception("storage.add_failed", ledger_id=lid, entry_id=eid)
                    batch.on_error(rid, exc)
        finally:
            if run is not None:
                run.lac_max = lac_max
                run.stop = len(entry_ids)
                batch.end = offset  # where run's records end (offset is past its last one)
            if records is not None:
                journal.close_batch(records, offset, batch)

    def _batch_for(self, target: Any, batch_type: type[AddBatch]) -> AddBatch:
        """The gathering group's last completion if it is ``target``'s (its adds keep one
        completion, and so one answer, per group), else a new one."""
        last = self.journal.last_callback
        if type(last) is batch_type and last.target is target:
            return last
        return batch_type(target)

    def fence(self, ledger_id: int, master_key: bytes | None, callback: Callback) -> LedgerState:
        """Fence ``ledger_id`` (creating it fenced if unknown); ``callback`` once durable.

        Idempotent. Raises :class:`Unauthorized` for a wrong key, :class:`JournalError`.
        """
        if master_key is not None:
            state = self.ledger_for_write(ledger_id, master_key)
        else:  # an unknown ledger is registered once its fence record is journaled
            state = self.ledgers.get(ledger_id) or LedgerState(ledger_id)
        if state.fenced:
            if state.fence_durable:
                self._loop.call_soon(callback, None)
            else:
                self.journal.sync(callback)
            return state
        failpoints.hit(failpoints.FENCE_PERSIST)

        def durable(error: BaseException | None) -> None:
            if error is None:
                state.fence_durable = True
            callback(error)

        self.journal.append((fmt.encode_fence(ledger_id),), durable)
        self.ledgers.setdefault(ledger_id, state)
        state.set_fenced()
        return state

    def write_lac(
        self, ledger_id: int, master_key: bytes, lac: int, lac_body: bytes, callback: Callback
    ) -> None:
        """Persist an explicit LAC; it takes effect (and wakes waiters) once durable. Raises
        :class:`Unauthorized`."""
        state = self.ledger_for_write(ledger_id, master_key)

        def durable(error: BaseException | None) -> None:
            if error is None:
                state.advance_explicit(lac, lac_body)
            callback(error)

        self.journal.append((fmt.encode_explicit_lac(ledger_id, lac, lac_body),), durable)

    def rekey(self, state: LedgerState, key: bytes) -> None:
        """Start ``state``'s record anew under ``key`` (a squatter's record, proven so by metadata:
        :mod:`bookie.ledger_keys`). Journaled first; what follows of the ledger lies after it.

        The state changes in memory at once, before the record is durable; a checkpoint taken
        meanwhile must not be written until it is (:meth:`write_checkpoint`): replay applies the
        journal after the checkpoint's position on top of its rows, and the squatter's records
        that lie there (a fence, entries) would land on the re-keyed row with no REKEY after them
        to drop them again."""
        self._rekeys_unsynced += 1

        def durable(error: BaseException | None) -> None:
            self._rekeys_unsynced -= 1
            if error is not None:
                self._rekey_failed = error
            if not self._rekeys_unsynced:
                for waiter in self._rekey_waiters:
                    if not waiter.done():
                        waiter.set_result(None)
                self._rekey_waiters.clear()

        try:
            self.journal.append((fmt.encode_rekey(state.ledger_id, key),), durable)
        except BaseException:
            self._rekeys_unsynced -= 1
            raise
        # A new record, not the old one started anew: the squatter's requests journaled before the
        # REKEY and not durable yet complete on the record they hold (an add run's index entries
        # and LAC, a WRITE_LAC's LAC, a fence's durability). Replay drops them with the REKEY;
        # they must not land on the real ledger's record in memory either.
        fresh = self.ledgers[state.ledger_id] = LedgerState(state.ledger_id)
        fresh.master_key = key
        fresh.key_verified = True
        state.release_waiters()

    async def _rekeys_durable(self) -> None:
        """Return once every REKEY journaled so far is durable; raise when one never will be."""
        if self._rekeys_unsynced:
            waiter = self._loop.create_future()
            self._rekey_waiters.append(waiter)
            await waiter
        if self._rekey_failed is not None:
            raise JournalError("a REKEY record was not made durable") from self._rekey_failed

    def force(self, callback: Callback) -> None:
        """``callback`` once everything journaled so far is durable (FORCE_LEDGER)."""
        self.journal.sync(callback)

    # ------------------------------------------------------------------ reads
    def ledger(self, ledger_id: int) -> LedgerState:
        state = self.ledgers.get(ledger_id)
        if state is None:
            raise self._no_ledger(ledger_id)
        return state

    def _no_ledger(self, ledger_id: int) -> StorageError:
        """The error for a ledger not held: :class:`Unknown` while it is in limbo."""
        limbo = self.limbo
        if limbo is not None and limbo.holds(ledger_id):
            return Unknown(f"ledger {ledger_id} is in limbo on this bookie: it holds none of it now")
        return NoLedger(f"ledger {ledger_id} is not on this bookie")

    def _no_entry(self, ledger_id: int, entry_id: int) -> StorageError:
        """The error for an entry not held: :class:`Unknown` while its ledger is in limbo."""
        limbo = self.limbo
        if limbo is not None and limbo.holds(ledger_id):
            return Unknown(f"entry {ledger_id}:{entry_id}: the ledger is in limbo on this bookie")
        return NoEntry(f"entry {ledger_id}:{entry_id} is not on this bookie")

    def in_limbo(self, ledger_id: int) -> bool:
        limbo = self.limbo
        return limbo is not None and limbo.holds(ledger_id)

    async def save_limbo(self, limbo: Limbo) -> None:
        """Make ``limbo`` durable (the marker; removed when it holds no ledger). Raises ``OSError``."""
        await self._loop.run_in_executor(self._cold, save_blocking, self.fileio, self.config.data_dir, limbo)

    def check_read_key(self, ledger_id: int, master_key: bytes | None) -> None:
        """Raise :class:`Unauthorized` when the bookie holds ``ledger_id`` under another key
        (before a read is queued; an unknown ledger is answered by the read itself)."""
        if ledger_id in self.ledgers:
            self.ledger_for_read(ledger_id, master_key)

    def ledger_for_read(self, ledger_id: int, master_key: bytes | None) -> LedgerState:
        """The ledger's state for a read carrying ``master_key`` (every read, LAC read and entry
        list does): raises :class:`NoLedger`, and :class:`Unauthorized` for a missing or wrong key
        (constant-time compare). A ledger whose record holds no key (none was ever journaled for
        it) is readable with any key: there is nothing to check against."""
        state = self.ledgers.get(ledger_id)
        if state is None:
            raise self._no_ledger(ledger_id)
        known = state.master_key
        if known is not None and (master_key is None or not _compare_digest(known, master_key)):
            why = "a read must carry the ledger's master key" if master_key is None else "master key mismatch"
            raise Unauthorized(f"ledger {ledger_id}: {why}")
        return state

    async def read_entry(self, ledger_id: int, entry_id: int) -> tuple[int, memoryview]:
        """(entry id, body) of an entry; ``entry_id`` -1 is the last entry this bookie has.

        Raises :class:`NoLedger`, :class:`NoEntry`, :class:`Unknown`, :class:`EntryCorrupt`, ``OSError``.
        """
        state = self.ledger(ledger_id)
        if entry_id == -1:
            entry_id = state.index.last_entry_id
        positions, lengths = state.index.run(entry_id, 1)
        if not positions:
            raise self._no_entry(ledger_id, entry_id)
        bodies = await self._read_run(ledger_id, entry_id, 1, positions, lengths)
        return entry_id, bodies[0]

    async def read_range(
        self, ledger_id: int, first: int, count_max: int, bytes_max: int, step: int = 1
    ) -> list[memoryview]:
        """Entries ``first``, ``first + step``, ...: stops at a gap, ``count_max``, ``bytes_max``
        or an entry that fails its checks (the first entry is always returned, or raises like
        :meth:`read_entry`)."""
        state = self.ledger(ledger_id)
        positions, lengths = state.index.run(first, count_max, step)
        if not positions:
            raise self._no_entry(ledger_id, first)
        # count entry bodies, as the client sees them; the first entry always goes (a format-2
        # record has more bytes besides its body: counted a little large, a batch ends early, never late)
        if sum(lengths) - len(lengths) * _ENTRY_RECORD_OVERHEAD_BYTES > bytes_max:
            count, total = 1, lengths[0] - _ENTRY_RECORD_OVERHEAD_BYTES
            for length in lengths[1:]:
                total += length - _ENTRY_RECORD_OVERHEAD_BYTES
                if total > bytes_max:
                    break
                count += 1
            positions, lengths = positions[:count], lengths[:count]
        return await self._read_run(ledger_id, first, step, positions, lengths)

    async def _read_run(
        self, ledger_id: int, first: int, step: int, positions: Sequence[int], lengths: Sequence[int]
    ) -> list[memoryview]:
        """The bodies of entries ``first``, ``first + step``, ... at ``positions`` (of
        :meth:`LedgerIndex.run <bookie.index.LedgerIndex.run>`): read on the loop when the page
        cache holds them all (recently written entries, the common case: no thread hand-off),
        else on the reader thread (at once when the file seam cannot tell: ``FileIO.reads_nowait``)."""
        bodies: list[memoryview] | None = None
        if self._reads_nowait:
            bodies = self._read_spans(ledger_id, first, step, positions, lengths, self._pread_cached)
        if bodies is None:
            bodies = await self._loop.run_in_executor(
                self._reader, self._read_spans, ledger_id, first, step, positions, lengths, self._pread
            )
            assert bodies is not None, "a blocking read gives its bytes or raises"
        return bodies

    def _read_spans(
        self,
        ledger_id: int,
        first: int,
        step: int,
        positions: Sequence[int],
        lengths: Sequence[int],
        pread: Callable[[int, int, int], bytes | bytearray | None],
    ) -> list[memoryview] | None:
        """What :meth:`_read_run` reads, each record checked: records lying in order and close
        together are read with one ``pread(segment_id, offset, length)``, the bodies are views of
        it. Stops before a record that fails its checks, or raises :class:`EntryCorrupt` if it is
        the first; None as soon as ``pread`` gives None (not cached)."""
        bodies: list[memoryview] = []
        count = len(positions)
        i = 0
        while i < count:
            # a span: the next records of the segment while each starts at most _READ_GAP_BYTES
            # after the end of the one before (positions of one segment compare as its offsets)
            start = positions[i]
            segment_id, offset = split_position(start)
            limit = min(start + _READ_SPAN_BYTES_MAX, segment_position(segment_id + 1, 0))
            end = start + lengths[i]
            j = i + 1
            while j < count and end <= (position := positions[j]) <= min(end + _READ_GAP_BYTES, limit - 1):
                end = position + lengths[j]
                j += 1
            read = pread(segment_id, offset, end - start)
            if read is None:
                return None
            data = memoryview(read)
            if not _entry_bodies(data, positions[i:j], start, ledger_id, first + i * step, step, bodies):
                if bodies:
                    return bodies  # a short batch: the client asks for the rest elsewhere
                raise _corrupt(ledger_id, first, data[: lengths[0]])
            i = j
        return bodies

    def _pread(self, segment_id: int, offset: int, length: int) -> bytes:
        """A read on the reader thread (blocking)."""
        return self.fileio.pread(self._read_fd(segment_id), length, offset)

    def _pread_cached(self, segment_id: int, offset: int, length: int) -> bytearray | None:
        """A read on the loop: the bytes when a descriptor of the segment is open and the page
        cache holds them all, else None. Never opens or closes a descriptor: the reader thread
        does, under ``_fds_lock``, which this holds while it reads (no disk wait: microseconds)."""
        with self._fds_lock:
            fd = self._read_fds.get(segment_id)
            return None if fd is None else self.fileio.pread_nowait(fd, length, offset)

    def _read_fd(self, segment_id: int) -> int:
        """The segment's read descriptor, opened if need be (reader thread: the only one to open or
        close them, under ``_fds_lock`` as the loop reads through them too)."""
        fd = self._read_fds.get(segment_id)
        if fd is None:
            path = os.path.join(self._journal_dir, fmt.segment_name(segment_id))
            opened = self.fileio.open_read(path)
            with self._fds_lock:
                if len(self._read_fds) >= READ_FDS_MAX:
                    oldest = next(iter(self._read_fds))
                    self.fileio.close(self._read_fds.pop(oldest))
                fd = self._read_fds[segment_id] = opened
        return fd

    # ------------------------------------------------------------------ garbage collection
    def forget_ledger(self, ledger_id: int) -> bool:
        """Drop a ledger that no longer exists in metadata (bookie GC, :mod:`bookie.gc`): it leaves
        the index at once (reads answer ENOLEDGER, long polls parked on it are answered), and the
        next checkpoint leaves it out; its records become garbage for compaction. False if unknown."""
        state = self.ledgers.pop(ledger_id, None)
        if state is None:
            return False
        for waiter in list(state.waiters):
            waiter.fire(WakeReason.TIMEOUT)  # answered from the ledgers table: ENOLEDGER
        self._forgotten = True
        return True

    @property
    def checkpointed_position(self) -> Position:
        """The position of the last checkpoint this process wrote (or recovery started from)."""
        return self._checkpointed

    def segment_sizes_blocking(self) -> dict[int, int]:
        """Journal segment id -> its size on disk (bytes), for every segment file. Blocking."""
        sizes = {}
        for segment_id in replay.segment_ids(self.fileio, self._journal_dir):
            path = os.path.join(self._journal_dir, fmt.segment_name(segment_id))
            try:
                fd = self.fileio.open_read(path)
            except FileNotFoundError:
                continue
            try:
                sizes[segment_id] = self.fileio.size(fd)
            finally:
                self.fileio.close(fd)
        return sizes

    def read_records_blocking(
        self, segment_id: int, wanted: list[tuple[int, int, Location]]
    ) -> list[bytes | None]:
        """The whole ENTRY records (header included) at ``wanted`` = ``(ledger id, entry id,
        location)`` in segment ``segment_id``, sorted by offset; None for a record that fails its
        checksum or is not that entry. Neighbouring records are read with one ``pread``. Blocking."""
        path = os.path.join(self._journal_dir, fmt.segment_name(segment_id))
        fd = self.fileio.open_read(path)
        out: list[bytes | None] = []
        try:
            i = 0
            while i < len(wanted):
                first = wanted[i][2].offset
                j, end = i, first
                while j < len(wanted) and wanted[j][2].offset <= end + _COALESCE_GAP_BYTES:
                    end = max(end, wanted[j][2].offset + wanted[j][2].length)
                    j += 1
                    if end - first >= _COALESCE_BYTES_MAX:
                        break
                data = self.fileio.pread(fd, end - first, first)
                for ledger_id, entry_id, location in wanted[i:j]:
                    record = fmt.decode_record_at(data, location.offset - first)
                    if (
                        record is None
                        or record.type not in fmt.ENTRY_TYPES
                        or record.length != location.length
                        or fmt.parse_ledger_entry(record.body) != (ledger_id, entry_id)
                    ):
                        out.append(None)
                    else:
                        start = location.offset - first
                        out.append(data[start : start + location.length])
                i = j
        finally:
            self.fileio.close(fd)
        return out

    async def delete_segments(self, segment_ids: list[int]) -> int:
        """Delete journal segments nothing needs any more; returns the bytes freed.

        The caller (bookie GC) guarantees that no index entry points into them and that a durable
        checkpoint lies past them; this re-checks the position (replay reads nothing before the
        checkpoint's segment) and refuses a segment at or past it. Each goes on the reader's
        executor, so every read planned against it before the index moved has finished, and its
        cached descriptor is closed there, before the unlink. Then the directory is fsynced."""
        limit = min(self._checkpointed.segment_id, self.journal.synced_position.segment_id)
        freed = 0
        deleted = 0
        for segment_id in segment_ids:
            if segment_id >= limit:
                raise ValueError(f"journal segment {segment_id:016x} is not before the checkpoint")
            freed += await self._loop.run_in_executor(self._reader, self._delete_segment_blocking, segment_id)
            deleted += 1
            failpoints.hit(failpoints.GC_AFTER_DELETE)
        if deleted:
            await self._loop.run_in_executor(self._cold, self.fileio.fsync_dir, self._journal_dir)
        return freed

    def _delete_segment_blocking(self, segment_id: int) -> int:
        with self._fds_lock:
            fd = self._read_fds.pop(segment_id, None)
            if fd is not None:
                self.fileio.close(fd)
        path = os.path.join(self._journal_dir, fmt.segment_name(segment_id))
        try:
            probe = self.fileio.open_read(path)
        except FileNotFoundError:
            return 0  # gone already (a crash after an earlier unlink)
        try:
            size = self.fileio.size(probe)
        finally:
            self.fileio.close(probe)
        self.fileio.remove(path)
        log.info("storage.segment_deleted", segment=f"{segment_id:016x}", bytes=size)
        return size

    # ------------------------------------------------------------------ checkpoints and lifecycle
    async def checkpoint(self) -> bool:
        """Write a checkpoint if the journal moved since the last one; True if one was written."""
        if self.journal.synced_position == self._checkpointed:
            return False
        await self.write_checkpoint()
        return True

    async def write_checkpoint(self) -> Position:
        """Write a checkpoint of the state as it is now (also when the journal did not move: GC
        dropped ledgers) and return its position once the file is durable. Raises ``OSError``.

        One at a time (GC and compaction write theirs beside the periodic one). The position is
        taken first; the rows are taken after it, a slice of ledgers per loop turn, so each holds
        at least every record before the position (more is fine: the module doc of
        :mod:`bookie.checkpoint`). Rows of ledgers that did not change are reused; joining, the
        CRC and the write happen in a worker thread."""
        async with self._checkpoint_lock:
            while self._forgotten:
                # A forgotten ledger's records appended but not durable yet would lie past the
                # position: replay would bring the ledger back from them alone (no key, no fence).
                # Again until no forget came during the sync (GC forgets in slices, loop turns
                # apart); nothing awaits between the last check and the position.
                self._forgotten = False
                synced, done = durable_future(self._loop)
                self.journal.sync(done)
                await synced
            position = self.journal.synced_position
            written = (self.journal.records_written, self.journal.bytes_written)
            rows, reencoded = await self._checkpoint_rows()
            await self._rekeys_durable()  # a re-keyed row is written only once its REKEY is durable
            write = self._write_checkpoint_blocking
            size = await self._loop.run_in_executor(self._cold, write, position, rows)
            self._checkpointed, self._checkpointed_at = position, written
            log.info(
                "storage.checkpointed",
                segment=position.segment_id,
                offset=position.offset,
                bytes=size,
                ledgers=len(rows),
                rows_reencoded=reencoded,
            )
            return position

    async def _checkpoint_rows(self) -> tuple[list[bytes], int]:
        """Every ledger's checkpoint row, and how many were encoded anew; yields the loop every
        :data:`CHECKPOINT_SLICE_S`."""
        states = list(self.ledgers.values())  # one C-level copy (a few ms at a million ledgers)
        rows: list[bytes] = []
        append = rows.append
        encode_row = checkpoint.encode_row
        clock = self._clock.monotonic  # the seam's: a simulation's never moves within a step (no yield)
        deadline = clock() + CHECKPOINT_SLICE_S
        reencoded = 0
        for i, state in enumerate(states):
            row = state.row
            if row is None:
                row = encode_row(state)
                reencoded += 1
                if len(row) <= ROW_CACHE_BYTES_MAX:
                    state.row = row
                if clock() > deadline:  # a big ledger's row alone may take a while
                    await asyncio.sleep(0)
                    deadline = clock() + CHECKPOINT_SLICE_S
            append(row)
            if i & 1023 == 1023 and clock() > deadline:
                await asyncio.sleep(0)
                deadline = clock() + CHECKPOINT_SLICE_S
        return rows, reencoded

    def _write_checkpoint_blocking(self, position: Position, rows: list[bytes]) -> int:
        parts = checkpoint.encode_parts(position, rows)
        path = os.path.join(self.config.data_dir, replay.INDEX_DIR, replay.CHECKPOINT_FILE)
        self.fileio.write_file_atomic(path, parts, failpoints.INDEX_CHECKPOINT)
        return sum(len(part) for part in parts)

    def checkpoint_due(self, elapsed_s: float) -> bool:
        """Whether the policy asks for a checkpoint ``elapsed_s`` after the last one: the journal
        moved and the interval passed, or it grew by ``checkpoint_journal_bytes`` or
        ``checkpoint_journal_records`` since (replay after a crash is bounded by these)."""
        if self.journal.synced_position == self._checkpointed:
            return False
        records, written = self._checkpointed_at
        config = self.config
        return (
            elapsed_s >= config.checkpoint_interval_s
            or self.journal.bytes_written - written >= config.checkpoint_journal_bytes
            or self.journal.records_written - records >= config.checkpoint_journal_records
        )

    async def _checkpoint_loop(self) -> None:
        """Checkpoints as :meth:`checkpoint_due` asks, checked every :data:`CHECKPOINT_POLL_S`.
        The first check comes at once: what a restart replayed is checkpointed straight away, so a
        bookie that crashes again (idle or not) does not replay it all again."""
        config = self.config
        last = self._loop.time()
        due = self._replayed > 0
        while True:
            if due or self.checkpoint_due(self._loop.time() - last):
                try:
                    await self.write_checkpoint()
                    due = False
                except (OSError, JournalError) as exc:  # the next check retries; replay covers the gap
                    log.error("storage.checkpoint_failed", error=repr(exc))  # noqa: TRY400 (expected, no trace)
                except Exception:  # a bug: logged with its trace; checkpoints go on at the next check
                    log.exception("storage.checkpoint_failed")
                last = self._loop.time()
            await asyncio.sleep(min(CHECKPOINT_POLL_S, config.checkpoint_interval_s))

    async def close(self) -> None:
        """Flush the journal, write a final checkpoint, release the data dir."""
        await self._stop_checkpoint_task()
        await self.journal.close()
        if self.journal.failed is None:
            try:
                await self.checkpoint()
            except OSError as exc:
                log.error("storage.checkpoint_failed", error=repr(exc))  # noqa: TRY400 (expected, no trace)
        self._release()

    def abort(self) -> None:
        if self._checkpoint_task is not None:
            self._checkpoint_task.cancel()
        self.journal.abort()
        self._release()

    async def _stop_checkpoint_task(self) -> None:
        task, self._checkpoint_task = self._checkpoint_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _release(self) -> None:
        self._reader.shutdown(wait=True)
        self._cold.shutdown(wait=True)
        for fd in self._read_fds.values():
            with contextlib.suppress(OSError):
                self.fileio.close(fd)
        self._read_fds.clear()
        if self._lock_fd >= 0:
            self.fileio.close(self._lock_fd)
            self._lock_fd = -1


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No automatic cyclic collection meanwhile (unless the process had turned it off already)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _recover_blocking(fileio: FileIO, config: StorageConfig) -> replay.Recovered:
    ensure_cookie(fileio, config.data_dir, config.bookie_id)
    return replay.recover(
        fileio, config.data_dir, ROW_CACHE_BYTES_MAX, limbo_after_cut=config.limbo_after_cut
    )
