"""Ledger storage: the journal, the per-ledger state and index, checkpoints, reads.

Entries live in journal segments and are found through each ledger's index; there is no separate
entry log (yet): one write path, one sync per group, reads by ``pread`` of the record.

Rules this module keeps:

- an entry enters the index, and the LAC it piggybacks takes effect, only after its record is
  durable (the journal's completion callback);
- the first add (or fence carrying a key) of a ledger journals its master key before the entry;
- a fence sets the bit in memory at once (adds are refused from that instant: atomic with respect to
  adds, since the loop is single-threaded) and its callback fires after the FENCE record is durable;
- reads verify the record's CRC32C; a damaged record is :class:`EntryCorrupt` (EIO), never "no entry".

Typed errors (mapped to wire statuses by the processor): :class:`NoLedger`, :class:`NoEntry`,
:class:`Fenced`, :class:`Unauthorized`, :class:`EntryCorrupt`, :class:`~bookie.journal.JournalError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog

from bookie import checkpoint, replay
from bookie import journal_format as fmt
from bookie.cookie import ensure_cookie
from bookie.fileio import OS_FILE_IO, FileIO
from bookie.index import Location
from bookie.journal import Callback, Journal, JournalConfig
from bookie.ledger_state import LedgerState
from bookkeeper_aio.common import failpoints

log = structlog.get_logger(__name__)

READ_FDS_MAX = 256
"""Open read descriptors on journal segments; beyond this the least recently opened is closed."""

_RECORD_OVERHEAD_BYTES = fmt.RECORD_HEADER_BYTES + fmt.ENTRY_PREFIX_BYTES


class StorageError(Exception):
    """Base of the storage layer's typed errors."""


class NoLedger(StorageError):
    pass


class NoEntry(StorageError):
    pass


class Fenced(StorageError):
    pass


class Unauthorized(StorageError):
    pass


class EntryCorrupt(StorageError):
    """A stored record that fails its checksum or names another entry: answer EIO, never ENOENTRY."""


@dataclass(frozen=True)
class StorageConfig:
    data_dir: str
    bookie_id: str
    journal: JournalConfig = field(default_factory=JournalConfig)
    checkpoint_interval_s: float = 30.0
    """How often the index is checkpointed when the journal moved: bounds replay time at restart."""


class AddCompletion:
    """Completion of one add, subclassed by the caller (one small object per add: no closure, no
    Future, DESIGN §10). Storage fills the slots; once the record is durable it indexes the entry,
    advances the piggybacked LAC, then calls :meth:`on_durable` (``error`` None on success)."""

    __slots__ = ("entry_id", "lac", "length", "offset", "segment_id", "state")
    state: LedgerState
    entry_id: int
    lac: int
    length: int
    segment_id: int
    offset: int

    def on_durable(self, error: BaseException | None) -> None:
        raise NotImplementedError

    def __call__(self, error: BaseException | None) -> None:
        if error is None:
            state = self.state
            state.index.put(self.entry_id, self.segment_id, self.offset, self.length)
            if self.lac > state.piggyback_lac:
                state.advance_piggyback(self.lac)
        self.on_durable(error)


AddItem = tuple[int, int, int, int, LedgerState, int, Any, int]
"""One batched add: entry id, record segment id, offset and length (the index's
:meth:`~bookie.index.LedgerIndex.put_run` reads these four), ledger state, piggybacked LAC, then
the caller's reply target and request id (opaque to storage)."""


class AddBatch:
    """Completion of the adds of one group (the processor's add path), subclassed by the caller:
    one callback per group instead of one object and four calls per add. Once the group is durable
    it indexes every entry and advances each ledger's piggybacked LAC, then calls
    :meth:`on_durable` with the items (``error`` None on success; on error nothing is indexed)."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[AddItem] = []

    def on_durable(self, items: list[AddItem], error: BaseException | None) -> None:
        raise NotImplementedError

    def __call__(self, error: BaseException | None) -> None:
        items = self.items
        if error is None and items:
            # Runs of one ledger (usually the whole group): one index call and one LAC update each.
            state = items[0][4]
            start = i = 0
            lac_max = -1
            for item in items:
                if item[4] is not state:
                    state.index.put_run(items, start, i)
                    if lac_max > state.piggyback_lac:
                        state.advance_piggyback(lac_max)
                    state = item[4]
                    start = i
                    lac_max = -1
                if item[5] > lac_max:
                    lac_max = item[5]
                i += 1
            state.index.put_run(items, start, i)
            if lac_max > state.piggyback_lac:
                state.advance_piggyback(lac_max)
        self.on_durable(items, error)


class Storage:
    """Owner of the journal, the ledger states and the checkpoint task."""

    def __init__(
        self, config: StorageConfig, fileio: FileIO, recovered: replay.Recovered, lock_fd: int
    ) -> None:
        self.config = config
        self.fileio = fileio
        self.ledgers: dict[int, LedgerState] = recovered.ledgers
        self._loop = asyncio.get_running_loop()
        self._journal_dir = os.path.join(config.data_dir, replay.JOURNAL_DIR)
        self.journal = Journal(fileio, self._journal_dir, recovered.start, config.journal)
        self._lock_fd = lock_fd
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="storage-reader")
        self._cold = ThreadPoolExecutor(max_workers=1, thread_name_prefix="storage-cold")
        self._read_fds: dict[int, int] = {}
        self._checkpointed = recovered.start
        self._checkpoint_task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, config: StorageConfig, fileio: FileIO = OS_FILE_IO) -> Storage:
        """Guard the data dir (lock + cookie), recover state, start the journal.

        Raises ``BlockingIOError`` (dir in use), :class:`~bookie.cookie.CookieMismatch`,
        :class:`~bookie.journal_format.JournalCorrupt`, :class:`~bookie.checkpoint.CheckpointCorrupt`.
        """
        config.journal.validate()
        loop = asyncio.get_running_loop()
        fileio.makedirs(config.data_dir)
        lock_fd = fileio.lock_dir(config.data_dir)
        try:
            recovered = await loop.run_in_executor(None, _recover_blocking, fileio, config)
        except BaseException:
            fileio.close(lock_fd)
            raise
        log.info(
            "storage.recovered",
            ledgers=len(recovered.ledgers),
            records_replayed=recovered.records_replayed,
            torn_bytes_cut=recovered.torn_bytes_cut,
            start_segment=recovered.start.segment_id,
            start_offset=recovered.start.offset,
        )
        storage = cls(config, fileio, recovered, lock_fd)
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
        return state

    def add_entry(
        self,
        ledger_id: int,
        entry_id: int,
        lac: int,
        master_key: bytes,
        body: bytes,
        recovery: bool,
        completion: AddCompletion,
    ) -> None:
        """Journal an entry; ``completion`` runs once it is durable (then readable).

        ``body`` must already be checked to carry ``ledger_id``/``entry_id``/``lac`` in its header.
        Raises :class:`Unauthorized`, :class:`Fenced` (unless ``recovery``), :class:`JournalError`.
        """
        state = self.ledgers.get(ledger_id)
        if state is None or state.master_key is None or not hmac.compare_digest(state.master_key, master_key):
            state = self.ledger_for_write(ledger_id, master_key)
        if state.fenced and not recovery:
            raise Fenced(f"ledger {ledger_id} is fenced")
        head, tail = fmt.encode_entry_parts(ledger_id, entry_id, body)
        completion.state = state
        completion.entry_id = entry_id
        completion.lac = lac
        completion.length = len(head) + len(tail)
        completion.segment_id, completion.offset = self.journal.append((head, tail), completion)

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
        """Persist an explicit LAC; it takes effect (and wakes waiters) once durable."""
        state = self.ledger_for_write(ledger_id, master_key)

        def durable(error: BaseException | None) -> None:
            if error is None:
                state.advance_explicit(lac, lac_body)
            callback(error)

        self.journal.append((fmt.encode_explicit_lac(ledger_id, lac, lac_body),), durable)

    def force(self, callback: Callback) -> None:
        """``callback`` once everything journaled so far is durable (FORCE_LEDGER)."""
        self.journal.sync(callback)

    # ------------------------------------------------------------------ reads
    def ledger(self, ledger_id: int) -> LedgerState:
        state = self.ledgers.get(ledger_id)
        if state is None:
            raise NoLedger(f"ledger {ledger_id} is not on this bookie")
        return state

    def _location(self, state: LedgerState, entry_id: int) -> tuple[int, Location]:
        if entry_id == -1:
            entry_id = state.index.last_entry_id
        location = state.index.get(entry_id)
        if location is None:
            raise NoEntry(f"entry {state.ledger_id}:{entry_id} is not on this bookie")
        return entry_id, location

    async def read_entry(self, ledger_id: int, entry_id: int) -> tuple[int, bytes]:
        """(entry id, body) of an entry; ``entry_id`` -1 is the last entry this bookie has.

        Raises :class:`NoLedger`, :class:`NoEntry`, :class:`EntryCorrupt`, ``OSError``.
        """
        state = self.ledger(ledger_id)
        entry_id, location = self._location(state, entry_id)
        body = await self._loop.run_in_executor(
            self._reader, self._read_blocking, ledger_id, entry_id, location
        )
        return entry_id, body

    async def read_range(self, ledger_id: int, first: int, count_max: int, bytes_max: int) -> list[bytes]:
        """Consecutive entries from ``first``: stops at a gap, ``count_max`` or ``bytes_max`` (the
        first entry is always returned). Raises like :meth:`read_entry` for the first entry."""
        state = self.ledger(ledger_id)
        plan: list[tuple[int, Location]] = []
        total = 0
        for entry_id in range(first, first + count_max):
            location = state.index.get(entry_id)
            if location is None:
                break
            total += location.length - _RECORD_OVERHEAD_BYTES  # count entry bodies, as the client sees them
            if plan and total > bytes_max:
                break
            plan.append((entry_id, location))
        if not plan:
            raise NoEntry(f"entry {ledger_id}:{first} is not on this bookie")
        return await self._loop.run_in_executor(self._reader, self._read_many_blocking, ledger_id, plan)

    def _read_many_blocking(self, ledger_id: int, plan: list[tuple[int, Location]]) -> list[bytes]:
        return [self._read_blocking(ledger_id, entry_id, location) for entry_id, location in plan]

    def _read_blocking(self, ledger_id: int, entry_id: int, location: Location) -> bytes:
        fd = self._read_fd(location.segment_id)
        data = self.fileio.pread(fd, location.length, location.offset)
        record = fmt.decode_record_at(data, 0)
        if record is None or record.type != fmt.RecordType.ENTRY:
            raise EntryCorrupt(f"entry {ledger_id}:{entry_id}: journal record fails its checksum")
        if fmt.parse_ledger_entry(record.body) != (ledger_id, entry_id):
            raise EntryCorrupt(f"entry {ledger_id}:{entry_id}: index points at another record")
        return bytes(record.body[fmt.ENTRY_PREFIX_BYTES :])

    def _read_fd(self, segment_id: int) -> int:
        fd = self._read_fds.get(segment_id)
        if fd is None:
            if len(self._read_fds) >= READ_FDS_MAX:
                oldest = next(iter(self._read_fds))
                self.fileio.close(self._read_fds.pop(oldest))
            path = os.path.join(self._journal_dir, fmt.segment_name(segment_id))
            fd = self._read_fds[segment_id] = self.fileio.open_read(path)
        return fd

    # ------------------------------------------------------------------ checkpoints and lifecycle
    async def checkpoint(self) -> bool:
        """Write a checkpoint if the journal moved since the last one; True if one was written."""
        position = self.journal.synced_position
        if position == self._checkpointed:
            return False
        data = checkpoint.encode(position, self.ledgers.values())
        path = os.path.join(self.config.data_dir, replay.INDEX_DIR, replay.CHECKPOINT_FILE)
        await self._loop.run_in_executor(
            self._cold, self.fileio.write_file_atomic, path, data, failpoints.INDEX_CHECKPOINT
        )
        self._checkpointed = position
        log.info("storage.checkpointed", segment=position.segment_id, offset=position.offset, bytes=len(data))
        return True

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint_interval_s)
            try:
                await self.checkpoint()
            except OSError as exc:  # the next interval retries; replay covers the gap meanwhile
                log.error("storage.checkpoint_failed", error=repr(exc))  # noqa: TRY400 (expected, no trace)

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


def _recover_blocking(fileio: FileIO, config: StorageConfig) -> replay.Recovered:
    journal_dir = os.path.join(config.data_dir, replay.JOURNAL_DIR)
    has_data = fileio.exists(journal_dir) and any(
        fmt.parse_segment_name(name) is not None for name in fileio.listdir(journal_dir)
    )
    ensure_cookie(fileio, config.data_dir, config.bookie_id, has_data)
    return replay.recover(fileio, config.data_dir)
