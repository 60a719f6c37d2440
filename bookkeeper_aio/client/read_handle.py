"""Reading a ledger: entries up to the LAC from any replica, verified, in order.

Rules (docs/replication.md §1, §6):

- An entry is read from the bookies of its write set in the fragment that stores it, one replica at
  a time; on an error, a timeout or a corrupt body the next replica is asked. After
  ``speculative_read_delay_ms`` without an answer the next replica is asked too; the first *valid*
  answer wins and later answers are ignored.
- Every body is verified (digest, ledger id, entry id) before it is handed out. A corrupt replica is
  logged and skipped, never returned.
- When every replica failed: NoSuchEntry if all of them said "no such entry/ledger", else the first
  other error (a timeout, a connection loss, DigestError when every replica was corrupt).
- Ranges are read with a bounded read-ahead window and yielded in entry order. When every bookie
  holds every entry (``Qw == E``) sequential ranges use BATCH_READ, falling back to single reads.
- A reader never reads past the LAC (or, once closed, past the metadata's last entry).

:func:`read_lac_with_coverage` is the coverage-checked LAC read (docs/replication.md §4); recovery
reuses it and :class:`EntryReader` with its own flags.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import structlog

from bookkeeper_aio.client.batch_read import (
    can_batch,
    can_batch_striped,
    read_range_batched,
    read_range_striped,
)
from bookkeeper_aio.client.connection import Result
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.quorum import schedule_of
from bookkeeper_aio.client.speculation import SpeculativeOp
from bookkeeper_aio.client.tail import LONG_POLL_TIMEOUT_MS, Tail
from bookkeeper_aio.errors import (
    BKError,
    BKInterfaceError,
    DigestError,
    NoSuchEntry,
    NoSuchLedger,
    error_for_status,
)
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import NO_ENTRY, StatusCode
from bookkeeper_aio.protocol.digest import Entry, EntryCodec
from bookkeeper_aio.protocol.errors import DigestMismatch
from metadata.ledger_manager import VersionedLedger
from metadata.ledger_metadata import LedgerMetadata, LedgerState

log = structlog.get_logger(__name__)

LedgerEntry = Entry
"""An entry as handed to applications: ``ledger_id, entry_id, lac, length, payload``."""


class _ReadOp(SpeculativeOp):
    """One entry being read from its replicas; completed by connection callbacks."""

    __slots__ = (
        "entry_id",
        "errors",
        "future",
        "next_replica",
        "outstanding",
        "reader",
        "replicas",
        "started",
    )
    started: float  # set only when the reader reports metrics

    def __init__(self, reader: EntryReader, entry_id: int, replicas: tuple[str, ...]) -> None:
        self.reader = reader
        self.entry_id = entry_id
        self.replicas = replicas
        self.next_replica = 0
        self.outstanding = 0
        self.errors: list[BKError] = []
        self.future: asyncio.Future[Entry] = reader.loop.create_future()
        self.timer: asyncio.TimerHandle | None = None

    def send_next(self) -> bool:
        if self.next_replica >= len(self.replicas):
            return False
        bookie_id = self.replicas[self.next_replica]
        self.next_replica += 1
        self.outstanding += 1
        reader = self.reader
        reader.ctx.pool.request_with_callback(
            bookie_id,
            lambda rid: m.ReadEntryRequest(
                rid, reader.ledger_id, self.entry_id, reader.flags, reader.master_key
            ),
            _on_read_result,
            self,
            reader.ctx.config.read_timeout_s,
        )
        return True


def _on_read_result(op: _ReadOp, bookie_id: str, result: Result) -> None:
    op.outstanding -= 1
    if op.future.done():
        return  # a slower replica or a speculative duplicate: ignored
    error: BKError
    if isinstance(result, BKError):
        error = result
    elif result.status != StatusCode.EOK:
        error = error_for_status(result.status, result.message)
    else:
        body = getattr(result, "body", None)
        if body is None:
            error = NoSuchEntry(f"{bookie_id} has no entry {op.entry_id}")
        else:
            try:
                entry = op.reader.codec.decode(body, op.reader.ledger_id, op.entry_id)
            except DigestMismatch as mismatch:
                log.warning(
                    "read.corrupt_replica",
                    ledger_id=op.reader.ledger_id,
                    entry_id=op.entry_id,
                    bookie=bookie_id,
                    error=str(mismatch),
                )
                error = DigestError(f"{bookie_id}: {mismatch}")
            else:
                op.finish()
                op.future.set_result(entry)
                metrics = op.reader.metrics
                if metrics is not None:
                    metrics.read_completed(op.reader.loop.time() - op.started)
                return
    op.errors.append(error)
    if op.send_next():
        if op.timer is None:
            op.arm_speculation()
        return
    if op.outstanding == 0:
        op.finish()
        failure = _summarise(op)
        op.future.set_exception(failure)
        if op.reader.metrics is not None:
            op.reader.metrics.read_failed(failure)


def _summarise(op: _ReadOp) -> BKError:
    if all(isinstance(e, NoSuchEntry | NoSuchLedger) for e in op.errors):
        return NoSuchEntry(f"ledger {op.reader.ledger_id}: no replica has entry {op.entry_id}")
    first = next(e for e in op.errors if not isinstance(e, NoSuchEntry | NoSuchLedger))
    error = type(first)(
        f"ledger {op.reader.ledger_id} entry {op.entry_id}: every replica failed: {op.errors}"
    )
    error.__cause__ = first
    return error


def _retrieve(future: asyncio.Future[Entry]) -> None:
    if not future.cancelled():
        future.exception()


class EntryReader:
    """Reads entries of one ledger by metadata; shared by read handles and recovery."""

    def __init__(
        self,
        ctx: ClientContext,
        metadata: LedgerMetadata,
        codec: EntryCodec,
        *,
        flags: int = 0,
        master_key: bytes | None = None,
    ) -> None:
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()
        self.metadata = metadata
        self.ledger_id = metadata.ledger_id
        self.codec = codec
        self.flags = flags
        self.master_key = codec.master_key if master_key is None else master_key
        """Carried by every read (the codec's: bookies refuse a read without the ledger's key)."""
        self.schedule = schedule_of(metadata.ensemble_size, metadata.write_quorum, metadata.ack_quorum)
        self.speculative_delay_s = ctx.config.speculative_read_delay_ms / 1000
        self.metrics = ctx.metrics

    def replicas(self, entry_id: int) -> tuple[str, ...]:
        ensemble = self.metadata.ensemble_for(entry_id)
        return tuple(ensemble[i] for i in self.schedule.write_set(entry_id))

    def start(self, entry_id: int) -> _ReadOp:
        op = _ReadOp(self, entry_id, self.replicas(entry_id))
        if self.metrics is not None:
            op.started = self.loop.time()
        op.future.add_done_callback(_retrieve)
        op.send_next()
        op.arm_speculation()
        return op

    async def read_entry(self, entry_id: int) -> Entry:
        op = self.start(entry_id)
        try:
            return await op.future
        finally:
            op.finish()

    def read_range(self, first: int, last: int) -> AsyncIterator[Entry]:
        """Entries ``first..last`` in order, ``read_window_max`` reads ahead: in BATCH_READs when
        every bookie holds every entry (``Qw == E``), in stepped BATCH_READs merged per stripe when
        striped (``Qw < E``; see ``bookkeeper_aio.client.batch_read``), else (fencing reads, batches
        turned off) in pipelined single reads."""
        if can_batch(self):
            return read_range_batched(self, first, last)
        if can_batch_striped(self):
            return read_range_striped(self, first, last)
        return self._read_singles(first, last)

    async def _read_singles(self, first: int, last: int) -> AsyncIterator[Entry]:
        window = self.ctx.config.read_window_max
        ops: collections.deque[_ReadOp] = collections.deque()
        next_id = first
        try:
            while next_id <= last or ops:
                while next_id <= last and len(ops) < window:
                    ops.append(self.start(next_id))
                    next_id += 1
                op = ops.popleft()
                yield await op.future
        finally:
            for op in ops:
                op.finish()
                if not op.future.done():
                    op.future.cancel()


async def read_lac_with_coverage(ctx: ClientContext, metadata: LedgerMetadata, key: bytes) -> int:
    """The LAC as seen by the bookies of the last fragment, once their answers cover the ensemble.

    Never less than (first entry of the last fragment) - 1: that fragment was created at LAC+1.
    ``key`` is the ledger's master key (bookies refuse a LAC read without it: Unauthorized).
    Raises BKError when the answers cannot cover the ensemble (too many bookies unreachable).
    """
    first, ensemble = metadata.ensembles[-1]
    schedule = schedule_of(metadata.ensemble_size, metadata.write_quorum, metadata.ack_quorum)
    lac = first - 1
    answered: set[int] = set()
    errors: list[BaseException] = []

    async def ask(position: int, bookie_id: str) -> tuple[int, int]:
        response = await ctx.pool.request(
            bookie_id, lambda rid: m.ReadLacRequest(rid, metadata.ledger_id, key), ctx.config.read_timeout_s
        )
        if response.status == StatusCode.ENOLEDGER:
            return position, NO_ENTRY
        if response.status != StatusCode.EOK:
            raise error_for_status(response.status, response.message)
        return position, getattr(response, "lac", NO_ENTRY)

    tasks = [asyncio.ensure_future(ask(i, b)) for i, b in enumerate(ensemble)]
    try:
        for next_done in asyncio.as_completed(tasks):
            try:
                position, bookie_lac = await next_done
            except BKError as error:
                errors.append(error)
                continue
            answered.add(position)
            lac = max(lac, bookie_lac)
            if schedule.covers_ensemble(answered):
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not schedule.covers_ensemble(answered):
        first_error = errors[0] if errors else BKError("no answer")
        failure = type(first_error)(
            f"ledger {metadata.ledger_id}: LAC read did not cover the ensemble: {errors}"
        )
        raise failure from first_error
    return lac


class ReadHandle:
    """A ledger opened for reading (no recovery: the writer is not disturbed)."""

    def __init__(self, ctx: ClientContext, versioned: VersionedLedger, codec: EntryCodec, lac: int) -> None:
        self._ctx = ctx
        self._metadata = versioned.metadata
        self._version = versioned.version
        self._codec = codec
        self._lac = lac
        self._reader = EntryReader(ctx, self._metadata, codec)

    @property
    def id(self) -> int:
        return self._metadata.ledger_id

    @property
    def metadata(self) -> LedgerMetadata:
        return self._metadata

    @property
    def is_closed(self) -> bool:
        return self._metadata.state is LedgerState.CLOSED

    @property
    def last_add_confirmed(self) -> int:
        """Entries up to here are readable (for a closed ledger: its last entry)."""
        return self._lac

    @property
    def length(self) -> int:
        return self._metadata.length

    async def refresh_lac(self) -> int:
        """Ask the bookies for a newer LAC (closed ledgers: the metadata's last entry)."""
        if self.is_closed:
            return self._lac
        # Re-read the metadata first: a newer LAC may lie in a fragment created after we opened.
        self._apply_metadata(await self._ctx.ledgers.read(self.id))
        if self._metadata.last_entry_id is not None:  # closed meanwhile
            return self._lac
        self._advance_lac(await read_lac_with_coverage(self._ctx, self._metadata, self._codec.master_key))
        return self._lac

    def tail(
        self, from_entry: int = 0, *, long_poll_timeout_ms: int = LONG_POLL_TIMEOUT_MS
    ) -> AsyncGenerator[LedgerEntry, None]:
        """Every entry from ``from_entry`` on, in order, as the writer gets them acknowledged; ends
        once the ledger is closed and its last entry was handed out (see ``bookkeeper_aio.client.tail``).

        Close it early with ``aclose()`` (or ``contextlib.aclosing``). Raises NoSuchLedger if the
        ledger is deleted meanwhile, and the read errors of :meth:`read` for entries no replica can
        serve. Bookie trouble while waiting for new entries is retried, never raised.
        """
        if from_entry < 0:
            raise BKInterfaceError(f"bad first entry {from_entry}")
        return Tail(self, from_entry, long_poll_timeout_ms).entries()

    def _apply_metadata(self, versioned: VersionedLedger) -> bool:
        """Adopt newer metadata (new fragment, close). True when something changed."""
        if versioned.version <= self._version and self._version >= 0:
            return False
        md = versioned.metadata
        self._metadata, self._version = md, versioned.version
        self._reader = EntryReader(self._ctx, md, self._codec)
        if md.last_entry_id is not None:  # closed: the metadata bounds the reader, never a bookie
            self._lac = md.last_entry_id
        else:  # a fragment is created at the writer's LAC + 1: everything before it was acked
            self._lac = max(self._lac, md.ensembles[-1][0] - 1)
        return True

    def _advance_lac(self, lac: int) -> None:
        """A LAC some bookie reported (it only knows LACs the writer sent)."""
        if not self.is_closed and lac > self._lac:
            self._lac = lac

    async def read_entry(self, entry_id: int) -> LedgerEntry:
        self._check_range(entry_id, entry_id)
        return await self._reader.read_entry(entry_id)

    def replicas(self, entry_id: int) -> tuple[str, ...]:
        """The bookies that should hold ``entry_id``: its write set in the fragment storing it."""
        if entry_id < 0:
            raise BKInterfaceError(f"bad entry id {entry_id}")
        return self._reader.replicas(entry_id)

    async def read_from(self, bookie_id: str, entry_id: int) -> LedgerEntry:
        """``entry_id`` as stored by one replica, ``bookie_id`` (verifying replicas): no other
        replica is asked, nothing speculative. The body is digest-checked like any read.

        Raises BKInterfaceError (``bookie_id`` is not in the entry's write set — the message names
        the replicas — or the entry is beyond the LAC), NoSuchEntry / NoSuchLedger (this bookie
        does not have it), DigestError (its copy is corrupt), BKTimeout, BookieConnectionLost, or
        the error of the bookie's status.
        """
        self._check_range(entry_id, entry_id)
        replicas = self._reader.replicas(entry_id)
        if bookie_id not in replicas:
            raise BKInterfaceError(
                f"ledger {self.id}: bookie {bookie_id!r} is not in the write set of entry {entry_id} "
                f"(its replicas: {', '.join(replicas)})"
            )
        ledger_id, key = self.id, self._codec.master_key
        response = await self._ctx.pool.request(
            bookie_id,
            lambda rid: m.ReadEntryRequest(rid, ledger_id, entry_id, 0, key),
            self._ctx.config.read_timeout_s,
        )
        if response.status != StatusCode.EOK:
            error = error_for_status(response.status, response.message)
            raise type(error)(f"ledger {ledger_id} entry {entry_id} on {bookie_id}: {error}")
        body = getattr(response, "body", None)
        if body is None:
            raise NoSuchEntry(f"ledger {ledger_id}: {bookie_id} has no entry {entry_id}")
        try:
            return self._codec.decode(body, ledger_id, entry_id)
        except DigestMismatch as mismatch:
            log.warning(
                "read.corrupt_replica",
                ledger_id=ledger_id,
                entry_id=entry_id,
                bookie=bookie_id,
                error=str(mismatch),
            )
            raise DigestError(f"ledger {ledger_id} entry {entry_id} on {bookie_id}: {mismatch}") from mismatch

    def read(self, first: int = 0, last: int | None = None) -> AsyncIterator[LedgerEntry]:
        """Entries ``first..last`` (default: up to the LAC) in order. Raises BKInterfaceError for a
        range beyond the LAC; NoSuchEntry / BKTimeout / DigestError... when no replica can serve one."""
        end = self._lac if last is None else last
        if end < first:
            return _empty()
        self._check_range(first, end)
        return self._reader.read_range(first, end)

    def _check_range(self, first: int, last: int) -> None:
        if first < 0 or last < first:
            raise BKInterfaceError(f"bad entry range [{first}, {last}]")
        if last > self._lac:
            raise BKInterfaceError(
                f"ledger {self.id}: entry {last} is beyond the last add confirmed {self._lac}"
            )

    async def close(self) -> None:
        """Nothing to release today (connections belong to the client); kept for symmetry."""

    async def __aenter__(self) -> ReadHandle:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()


async def _empty() -> AsyncIterator[LedgerEntry]:
    return
    yield
