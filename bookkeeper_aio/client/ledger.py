"""The write handle: sequential adds with quorum acks, ordered completion, ensemble change, close.

Rules (seed 000 "Writing to the ledger" / "Closing a ledger as a writer"; DESIGN §5):

- Entry ids are sequential. Entry ``e`` goes to its write set: ``Qw`` bookies of the *current*
  ensemble starting at position ``e mod E``; its body carries the LAC at send time (piggyback).
- An add *completes* (its future resolves, the LAC advances) only when ``Qa`` bookies of its write
  set acked it **and** every lower entry completed, and never while an ensemble change is in flight.
- A failed or timed-out bookie is replaced: choose a replacement, CAS a new fragment starting at
  LAC+1 (replacing the last fragment if it already starts there), drop acks of the replaced bookie,
  re-send every outstanding entry to the bookies of its new write set it was not sent to. On a CAS
  conflict re-read: not OPEN any more -> fail every outstanding add (LedgerFenced when IN_RECOVERY,
  LedgerClosed when CLOSED); OPEN -> decide again on the fresh metadata. Late failures from a bookie
  of the current ensemble still lead to its replacement; answers from replaced bookies are ignored.
- EFENCED or EUA from any bookie fails the handle (and every outstanding add). A LedgerFenced add
  is *unknown*: it may or may not be in the ledger (only the recovered ledger's last entry tells).
- Backpressure: at most ``add_window_max`` adds in flight; ``append`` waits for a slot.
- Explicit LAC: after ``explicit_lac_interval_ms`` without an add carrying the latest LAC, the LAC is
  sent to the ensemble with WRITE_LAC so readers see the last entry.
- Close: wait for outstanding adds, then CAS state CLOSED + last entry = LAC; on conflict re-read:
  OPEN -> retry, IN_RECOVERY -> LedgerFenced, CLOSED at our LAC -> success, CLOSED elsewhere ->
  MetadataConflict.

Hot path: one small ``_PendingAdd`` per entry completed by connection callbacks, one frame encoded
per entry and shared by its write set, one future per entry for the caller.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import struct
from collections.abc import Callable
from typing import Any

import crc32c
import msgpack
import structlog

from bookkeeper_aio.client.connection import ADD_OK, BookieConnection, ConnectionState, Result
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.quorum import DistributionSchedule
from bookkeeper_aio.errors import (
    BKError,
    BKInterfaceError,
    BKTimeout,
    LedgerClosed,
    LedgerFenced,
    MetadataConflict,
    NotEnoughBookies,
    Unauthorized,
    error_for_status,
)
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, OpCode
from bookkeeper_aio.protocol.digest import DIGEST_BYTES, HEADER, HEADER_BYTES, DigestType, EntryCodec
from metadata.errors import BadVersion, CasResultUnknown, MetadataError
from metadata.ledger_manager import VersionedLedger
from metadata.ledger_metadata import LedgerMetadata, LedgerState

log = structlog.get_logger(__name__)

EventListener = Callable[[str, int], None]
"""``listener(event, entry_id)``: ``add.completed`` (entry id), ``ensemble_change.started`` (the
LAC), ``ensemble_change.finished`` (first entry of the new fragment). Observability and tests."""


class HandleState(enum.Enum):
    WRITABLE = "writable"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


_WRITABLE = HandleState.WRITABLE
_CLOSED = ConnectionState.CLOSED
_ADD_ENTRY = int(OpCode.ADD_ENTRY)
_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_LENGTH = struct.Struct(">I").pack
_LENGTH_BYTES = 4
_ADD_HEAD = bytes((0x97, _ADD_ENTRY))  # fixarray of 7, then the op (a positive fixint)
_ENTRY_HEADER = HEADER.pack
_ENTRY_PREFIX_BYTES = HEADER_BYTES + DIGEST_BYTES[DigestType.CRC32C]
_CRC = struct.Struct(">I").pack
_crc32c = crc32c.crc32c
_BIN8 = struct.Struct(">BB").pack
_BIN16 = struct.Struct(">BH").pack
_BIN32 = struct.Struct(">BI").pack


def _bin_header(size: int) -> bytes:
    """msgpack's bin header for ``size`` bytes (the smallest form, as the packer writes it)."""
    if size < 0x100:
        return _BIN8(0xC4, size)
    if size < 0x10000:
        return _BIN16(0xC5, size)
    return _BIN32(0xC6, size)


def encode_add_request(
    request_id: int, ledger_id: int, entry_id: int, flags: int, key: bytes, body: bytes
) -> bytes:
    """``messages.encode(AddEntryRequest(...))`` without building the NamedTuple (hot path; a
    unit test pins it to the protocol module's bytes)."""
    packed = _pack((_ADD_ENTRY, request_id, ledger_id, entry_id, flags, key, body))
    return _LENGTH(len(packed)) + packed


class _PendingAdd:
    """One outstanding add. ``acked`` is a bitmask over positions of ``write_set`` (bit i: the
    bookie ``write_set[i]`` acked); ``sent_to`` is the write set itself while the entry went to
    exactly that (the common case, no allocation), else a set of every bookie it was sent to.
    ``frame`` is the encoded ADD request; the entry body is ``frame[body_start:]``. ``started``
    (loop time) is set only when the handle reports metrics."""

    __slots__ = (
        "acked",
        "body_start",
        "entry_id",
        "frame",
        "future",
        "length",
        "quorum",
        "sent_to",
        "started",
        "write_set",
    )
    started: float

    def __init__(
        self,
        entry_id: int,
        length: int,
        future: asyncio.Future[int],
        frame: bytes,
        body_start: int,
        write_set: tuple[str, ...],
    ) -> None:
        self.entry_id = entry_id
        self.length = length
        self.future = future
        self.frame = frame
        self.body_start = body_start
        self.write_set = write_set
        self.acked = 0
        self.sent_to: tuple[str, ...] | set[str] = write_set
        self.quorum = False


def _fail_future(future: asyncio.Future[int], error: BKError) -> None:
    if not future.done():
        future.set_exception(error)
        # The caller may drop an append future without awaiting it; the error is also in the
        # handle's state, so asyncio must not log "exception never retrieved" for each one.
        future.exception()


class LedgerHandle:
    """A ledger open for writing. Made by ``BookKeeper.create_ledger``; use as an async context
    manager or call :meth:`close`."""

    def __init__(
        self, ctx: ClientContext, versioned: VersionedLedger, password: bytes, master_key: bytes
    ) -> None:
        md = versioned.metadata
        self._ctx = ctx
        self._config = ctx.config
        self._pool = ctx.pool
        self._loop = asyncio.get_running_loop()
        self._metadata = md
        self._version = versioned.version
        self._id = md.ledger_id
        self._schedule = DistributionSchedule(md.ensemble_size, md.write_quorum, md.ack_quorum)
        self._ack_quorum = md.ack_quorum
        self._codec = EntryCodec(md.digest_type, password)
        self._master_key = master_key
        self._crc32c = self._codec.digest_type is DigestType.CRC32C
        self._lid_packed = _pack(self._id)
        self._add_tail = _pack(int(AddFlag.NONE)) + _pack(master_key)
        self._add_head_bytes = len(_ADD_HEAD) + len(self._lid_packed) + len(self._add_tail)
        """Bytes of an ADD frame's head that are the same for every entry of this ledger."""
        self._ensemble: tuple[str, ...] = md.current_ensemble
        self._write_sets = self._bookie_write_sets(self._ensemble)
        self._ensemble_size = len(self._write_sets)
        self._write_conns: list[tuple[BookieConnection, ...] | None] = [None] * self._ensemble_size
        """The pool's connections of each write set (None: look them up), so an add does not."""
        self._state = HandleState.WRITABLE
        self._error: BKError | None = None
        self._next_entry_id = 0
        self._lac = -1
        self._length_sent = 0
        self._length_confirmed = 0
        self._pending: collections.deque[_PendingAdd] = collections.deque()
        self._window = self._config.add_window_max
        self._slot_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._slots_reserved = 0
        self._drained: asyncio.Event | None = None
        self._failed_bookies: dict[str, BKError] = {}
        self._ever_failed: set[str] = set()
        self._changing = False
        self._change_task: asyncio.Task[None] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._lac_sent = -1
        self._sends = 0
        self._sends_at_lac_check = 0
        self._entry_bytes_max = self._config.entry_bytes_max
        self._add_timeout_s = self._config.add_timeout_s
        self._lac_timer: asyncio.TimerHandle | None = None
        self._lac_interval_s = self._config.explicit_lac_interval_ms / 1000
        self._listener: EventListener | None = None
        self._metrics = ctx.metrics
        self._on_add = self._on_add_result
        self.ensemble_changes = 0

    # ------------------------------------------------------------------ properties
    @property
    def id(self) -> int:
        return self._id

    @property
    def last_add_confirmed(self) -> int:
        """The highest entry id completed (acked by Qa and every lower entry), -1 if none."""
        return self._lac

    @property
    def length(self) -> int:
        """Bytes of payload completed."""
        return self._length_confirmed

    @property
    def metadata(self) -> LedgerMetadata:
        return self._metadata

    @property
    def state(self) -> HandleState:
        return self._state

    @property
    def pending_adds(self) -> int:
        return len(self._pending)

    def set_event_listener(self, listener: EventListener | None) -> None:
        self._listener = listener

    async def __aenter__(self) -> LedgerHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ appends
    async def append(self, payload: bytes) -> int:
        """Add ``payload`` and wait for it to complete; returns its entry id.

        Raises LedgerClosed, LedgerFenced (outcome unknown: see docs/api.md), NotEnoughBookies,
        Unauthorized, BKInterfaceError (payload too large). Cancelling the wait does not withdraw
        the entry once it was handed to the bookies.
        """
        if (  # fast path, same checks as append_async: no extra coroutine per entry
            self._state is _WRITABLE
            and type(payload) is bytes
            and len(payload) <= self._entry_bytes_max
            and not self._slot_waiters
            and len(self._pending) + self._slots_reserved < self._window
        ):
            future = self._start_add(payload)
        else:
            future = await self.append_async(payload)
        return await future

    async def append_async(self, payload: bytes) -> asyncio.Future[int]:
        """Hand ``payload`` to the bookies; returns a future of its entry id (pipelining).

        Waits only while the window of in-flight adds is full (backpressure). The returned future
        fails with the errors listed for :meth:`append`.
        """
        self._check_writable()
        if len(payload) > self._entry_bytes_max:
            raise BKInterfaceError(f"entry of {len(payload)} bytes exceeds {self._entry_bytes_max}")
        if self._slot_waiters or len(self._pending) + self._slots_reserved >= self._window:
            await self._wait_for_slot()
            self._slots_reserved -= 1
            self._wake_slot_waiters()
            self._check_writable()
        return self._start_add(bytes(payload))

    def _check_writable(self) -> None:
        if self._state is HandleState.WRITABLE:
            return
        if self._error is not None:
            raise self._error
        raise LedgerClosed(f"ledger {self._id} is {self._state.value}")

    async def _wait_for_slot(self) -> None:
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._slot_waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._slots_reserved -= 1  # woken, then cancelled: pass the slot on
                self._wake_slot_waiters()
            else:
                self._slot_waiters.remove(waiter)
            raise

    def _wake_slot_waiters(self) -> None:
        waiters = self._slot_waiters
        while waiters and len(self._pending) + self._slots_reserved < self._window:
            waiter = waiters.popleft()
            if not waiter.done():
                self._slots_reserved += 1
                waiter.set_result(None)

    def _start_add(self, payload: bytes) -> asyncio.Future[int]:
        entry_id = self._next_entry_id
        self._next_entry_id = entry_id + 1
        length = self._length_sent + len(payload)
        self._length_sent = length
        lac = self._lac
        self._lac_sent = lac
        self._sends += 1
        # One request id for the whole write set: ids are unique per pool, hence per connection,
        # so the frame is encoded once and shared.
        pool = self._pool
        rid = pool.next_request_id()
        if self._crc32c:
            frame, body_start = self._encode_crc32c(rid, entry_id, lac, length, payload)
        else:
            body = self._codec.encode(self._id, entry_id, lac, length, payload)
            frame = encode_add_request(rid, self._id, entry_id, AddFlag.NONE, self._master_key, body)
            body_start = len(frame) - len(body)
        future: asyncio.Future[int] = self._loop.create_future()
        index = entry_id % self._ensemble_size
        write_set = self._write_sets[index]
        op = _PendingAdd(entry_id, length, future, frame, body_start, write_set)
        if self._metrics is not None:
            op.started = self._loop.time()
        self._pending.append(op)
        timeout_s, on_add = self._add_timeout_s, self._on_add
        if self._failed_bookies:
            failed = self._failed_bookies
            op.sent_to = sent_to = set()
            for bookie_id in write_set:
                if bookie_id not in failed:
                    sent_to.add(bookie_id)
                    pool.connection(bookie_id).request(rid, frame, on_add, op, timeout_s)
        else:
            conns = self._write_conns[index]
            if conns is None:
                conns = self._write_conns[index] = tuple(pool.connection(b) for b in write_set)
            for conn in conns:
                if conn.state is _CLOSED:  # the pool replaces it: look the set up again next time
                    self._write_conns[index] = None
                    conn = pool.connection(conn.bookie_id)
                conn.request(rid, frame, on_add, op, timeout_s)
        return future

    def _encode_crc32c(
        self, rid: int, entry_id: int, lac: int, length: int, payload: bytes
    ) -> tuple[bytes, int]:
        """The ADD frame of a CRC32C ledger in one join (one copy of the payload); the same bytes
        as ``encode_add_request(..., codec.encode(...))`` for every size and id. Returns the frame
        and the offset of the entry body in it."""
        header = _ENTRY_HEADER(self._id, entry_id, lac, length)
        body_len = _ENTRY_PREFIX_BYTES + len(payload)
        rid_b = _pack(rid)
        eid_b = _pack(entry_id)
        bin_head = _BIN16(0xC5, body_len) if 0x100 <= body_len < 0x10000 else _bin_header(body_len)
        head_len = self._add_head_bytes + len(rid_b) + len(eid_b) + len(bin_head)
        frame = b"".join(
            (
                _LENGTH(head_len + body_len),
                _ADD_HEAD,
                rid_b,
                self._lid_packed,
                eid_b,
                self._add_tail,
                bin_head,
                header,
                _CRC(_crc32c(payload, _crc32c(header))),
                payload,
            )
        )
        return frame, _LENGTH_BYTES + head_len

    def _resend(self, op: _PendingAdd, bookie_id: str) -> None:
        rid = self._pool.next_request_id()
        body = op.frame[op.body_start :]
        frame = encode_add_request(rid, self._id, op.entry_id, AddFlag.NONE, self._master_key, body)
        if type(op.sent_to) is not set:
            op.sent_to = set(op.sent_to)
        op.sent_to.add(bookie_id)
        self._pool.connection(bookie_id).request(rid, frame, self._on_add, op, self._config.add_timeout_s)

    # ------------------------------------------------------------------ responses
    def _on_add_result(self, op: _PendingAdd, bookie_id: str, result: Result) -> None:
        if result is ADD_OK:  # the hot path: an ack
            try:
                position = op.write_set.index(bookie_id)
            except ValueError:
                return  # from a bookie replaced since the send: ignored
            acked = op.acked | (1 << position)
            op.acked = acked
            if not op.quorum and acked.bit_count() >= self._ack_quorum:
                op.quorum = True
                pending = self._pending
                if pending and pending[0] is op:
                    self._complete_ready()
            return
        error = result if isinstance(result, BKError) else error_for_status(result.status, result.message)
        if bookie_id not in op.write_set or bookie_id not in self._ensemble:
            return  # failure of a bookie already replaced
        if isinstance(error, LedgerFenced | Unauthorized):
            self._fail(error)
            return
        self._bookie_failed(bookie_id, error)

    def _complete_ready(self) -> None:
        if self._changing:
            return
        pending = self._pending
        listener = self._listener
        metrics = self._metrics
        now = self._loop.time() if metrics is not None else 0.0
        completed = False
        while pending and pending[0].quorum:
            op = pending.popleft()
            self._lac = op.entry_id
            self._length_confirmed = op.length
            if not op.future.done():
                op.future.set_result(op.entry_id)
            if metrics is not None:
                metrics.add_completed(now - op.started)
            if listener is not None:
                listener("add.completed", op.entry_id)
            completed = True
        if not completed:
            return
        if self._slot_waiters:
            self._wake_slot_waiters()
        if not pending and self._drained is not None:
            self._drained.set()
        if self._lac_interval_s > 0 and self._lac_timer is None:
            self._sends_at_lac_check = self._sends
            self._lac_timer = self._loop.call_later(self._lac_interval_s, self._explicit_lac)

    # ------------------------------------------------------------------ explicit LAC
    def _explicit_lac(self) -> None:
        self._lac_timer = None
        if self._state in (HandleState.CLOSED, HandleState.FAILED) or self._lac <= self._lac_sent:
            return
        if self._sends != self._sends_at_lac_check:  # not idle: adds went out (each carries a LAC)
            self._sends_at_lac_check = self._sends
            self._lac_timer = self._loop.call_later(self._lac_interval_s, self._explicit_lac)
            return
        lac = self._lac_sent = self._lac
        ledger_id, key = self._id, self._master_key

        def make(rid: int) -> m.Request:
            return m.WriteLacRequest(rid, ledger_id, key, lac)

        for bookie_id in self._ensemble:
            self._pool.request_with_callback(
                bookie_id, make, _ignore_result, None, self._config.add_timeout_s
            )

    # ------------------------------------------------------------------ failures
    def _fail(self, error: BKError) -> None:
        """Fail the handle and every outstanding add with ``error``."""
        if self._state in (HandleState.CLOSED, HandleState.FAILED):
            return
        log.warning("ledger.failed", ledger_id=self._id, lac=self._lac, error=repr(error))
        self._state = HandleState.FAILED
        self._error = error
        self._fail_outstanding(error)

    def _fail_outstanding(self, error: BKError) -> None:
        pending, self._pending = self._pending, collections.deque()
        metrics = self._metrics
        for op in pending:
            if metrics is not None:
                metrics.add_failed(error)
            _fail_future(op.future, error)
        for waiter in self._slot_waiters:
            if not waiter.done():
                waiter.set_result(None)  # the waiter re-checks the state and raises
                self._slots_reserved += 1
        self._slot_waiters.clear()
        if self._drained is not None:
            self._drained.set()

    def _bookie_failed(self, bookie_id: str, error: BKError) -> None:
        if self._state not in (HandleState.WRITABLE, HandleState.CLOSING):
            return
        if bookie_id not in self._failed_bookies:
            log.info("ledger.bookie_failed", ledger_id=self._id, bookie=bookie_id, error=repr(error))
        self._failed_bookies[bookie_id] = error
        if self._change_task is None:
            self._changing = True  # from now on no add completes until the change is done
            if self._listener is not None:
                self._listener("ensemble_change.started", self._lac)
            self._change_task = self._loop.create_task(
                self._run_ensemble_change(), name=f"ensemble change {self._id}"
            )

    async def _run_ensemble_change(self) -> None:
        try:
            while self._failed_bookies and self._state in (HandleState.WRITABLE, HandleState.CLOSING):
                failed = dict(self._failed_bookies)
                await self._change_ensemble(failed)
                for bookie_id in failed:
                    self._failed_bookies.pop(bookie_id, None)
                self._resend_outstanding()
        except BKError as error:
            self._fail(error)
        except (MetadataError, TimeoutError) as error:
            wrapped = NotEnoughBookies(f"ensemble change of ledger {self._id} failed: {error!r}")
            wrapped.__cause__ = error
            self._fail(wrapped)
        finally:
            self._failed_bookies.clear()
            self._change_task = None
            self._changing = False
            if self._listener is not None and self._state is not HandleState.FAILED:
                self._listener("ensemble_change.finished", self._lac + 1)
            if self._state in (HandleState.WRITABLE, HandleState.CLOSING):
                self._complete_ready()

    async def _change_ensemble(self, failed: dict[str, BKError]) -> None:
        self._ever_failed.update(failed)
        first_entry = self._lac + 1
        md, version = self._metadata, self._version
        ledgers = self._ctx.ledgers
        for _ in range(self._config.ensemble_change_attempts_max):
            writable = await self._ctx.directory.writable_bookies()
            ensemble = list(md.current_ensemble)
            for position, bookie_id in enumerate(ensemble):
                if bookie_id in failed:
                    exclude = self._ever_failed | set(ensemble)
                    ensemble[position] = self._ctx.placement.replace_bookie(
                        ensemble, position, writable, exclude
                    )
            proposed = md.with_ensemble_change(first_entry, ensemble)
            async with asyncio.timeout(self._config.metadata_timeout_s):
                try:
                    stored = await ledgers.write(proposed, version)  # failpoints metadata.cas_*
                except (BadVersion, CasResultUnknown):
                    current = await ledgers.read(self._id)
                    md, version = current.metadata, current.version
                    _require_open(md)
                    if md.ensembles[-1] != (first_entry, tuple(ensemble)):
                        continue
                    stored = current  # our write did land (its answer was lost)
            self._metadata, self._version = stored.metadata, stored.version
            self._ensemble = stored.metadata.current_ensemble
            self._write_sets = self._bookie_write_sets(self._ensemble)
            self._write_conns = [None] * self._ensemble_size
            self.ensemble_changes += 1
            if self._metrics is not None:
                self._metrics.ensemble_changed(self._id)
            log.info(
                "ensemble.changed",
                ledger_id=self._id,
                first_entry=first_entry,
                replaced=sorted(failed),
                ensemble=list(self._ensemble),
            )
            return
        raise NotEnoughBookies(f"ledger {self._id}: ensemble change lost the metadata race too often")

    def _bookie_write_sets(self, ensemble: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        """Bookie ids of the write set starting at each ensemble position (entry id mod E)."""
        return tuple(tuple(ensemble[i] for i in positions) for positions in self._schedule.write_sets())

    def _resend_outstanding(self) -> None:
        write_sets = self._write_sets
        quorum = self._ack_quorum
        for op in self._pending:
            write_set = write_sets[op.entry_id % len(write_sets)]
            if write_set == op.write_set:
                continue
            # Acks of replaced bookies no longer count; the others move to their new positions.
            old_set, old_acked, acked = op.write_set, op.acked, 0
            for position, bookie_id in enumerate(write_set):
                if bookie_id in old_set and old_acked >> old_set.index(bookie_id) & 1:
                    acked |= 1 << position
            op.write_set = write_set
            op.acked = acked
            op.quorum = acked.bit_count() >= quorum
            for bookie_id in write_set:
                if bookie_id not in op.sent_to:
                    self._resend(op, bookie_id)

    # ------------------------------------------------------------------ close / abort
    async def close(self) -> None:
        """Wait for outstanding adds, then close the ledger in metadata at the LAC (seed 000).

        Idempotent. Raises LedgerFenced (the ledger is being recovered by someone else) or
        MetadataConflict (closed by someone else at another last entry). Cancelling leaves the
        handle closable again.
        """
        if self._state is HandleState.CLOSED:
            return
        if self._state is HandleState.WRITABLE:
            self._state = HandleState.CLOSING
            self._fail_waiters_closed()
        if self._close_task is None:
            self._close_task = self._loop.create_task(self._close(), name=f"close {self._id}")
            self._close_task.add_done_callback(_retrieve)
        task = self._close_task
        try:
            # Shielded: a cancelled caller leaves the close running; calling close() again joins it.
            await asyncio.shield(task)
        finally:
            if task.done():
                self._close_task = None

    def _fail_waiters_closed(self) -> None:
        for waiter in self._slot_waiters:
            if not waiter.done():
                waiter.set_result(None)
                self._slots_reserved += 1
        self._slot_waiters.clear()

    async def _close(self) -> None:
        if self._pending:
            self._drained = asyncio.Event()
            await self._drained.wait()
        while self._change_task is not None:
            await asyncio.shield(self._change_task)
        if self._lac_timer is not None:
            self._lac_timer.cancel()
            self._lac_timer = None
        try:
            await self._close_metadata()
        except TimeoutError as error:
            raise BKTimeout(f"ledger {self._id}: metadata did not answer the close in time") from error
        except BKError as error:
            self._fail(error)
            raise
        except MetadataError as error:
            raise MetadataConflict(f"ledger {self._id}: close failed: {error!r}") from error
        self._state = HandleState.CLOSED
        log.info("ledger.closed", ledger_id=self._id, last_entry=self._lac, length=self._length_confirmed)

    async def _close_metadata(self) -> None:
        lac, length = self._lac, self._length_confirmed
        md, version = self._metadata, self._version
        ledgers = self._ctx.ledgers
        for _ in range(self._config.ensemble_change_attempts_max):
            if md.state is LedgerState.CLOSED:
                if md.last_entry_id == lac:
                    self._metadata, self._version = md, version
                    return
                raise MetadataConflict(
                    f"ledger {self._id} was closed elsewhere at entry {md.last_entry_id}, we acked {lac}"
                )
            if md.state is LedgerState.IN_RECOVERY:
                raise LedgerFenced(f"ledger {self._id} is being recovered: our close at {lac} lost")
            async with asyncio.timeout(self._config.metadata_timeout_s):
                try:
                    stored = await ledgers.write(md.closed(lac, length), version)  # failpoints metadata.cas_*
                except (BadVersion, CasResultUnknown):
                    current = await ledgers.read(self._id)
                    md, version = current.metadata, current.version
                    continue
            self._metadata, self._version = stored.metadata, stored.version
            return
        raise MetadataConflict(f"ledger {self._id}: close lost the metadata race too often")

    def abort(self) -> None:
        """Stop now: outstanding adds fail with LedgerClosed, metadata is left OPEN (a reader's
        recovery will close it)."""
        if self._state is HandleState.CLOSED:
            return
        error = LedgerClosed(f"ledger {self._id} handle aborted")
        if self._change_task is not None:
            self._change_task.cancel()
        if self._close_task is not None:
            self._close_task.cancel()
        if self._lac_timer is not None:
            self._lac_timer.cancel()
            self._lac_timer = None
        self._state = HandleState.CLOSED
        self._error = error
        self._fail_outstanding(error)


def _require_open(md: LedgerMetadata) -> None:
    if md.state is LedgerState.IN_RECOVERY:
        raise LedgerFenced(f"ledger {md.ledger_id} is in recovery: outstanding adds have unknown outcome")
    if md.state is LedgerState.CLOSED:
        raise LedgerClosed(f"ledger {md.ledger_id} was closed at entry {md.last_entry_id}")


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


def _ignore_result(context: Any, bookie_id: str, result: Result) -> None:
    return None
