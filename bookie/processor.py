"""Request processing: one handler per op; storage errors become wire statuses in one table.

The add path (hot): the frames of one socket read are handled in one loop
(:meth:`Processor.dispatch_frames`); each ADD is decoded by the codec's shortcut
(:meth:`AddRequests.take <bookkeeper_aio.protocol.messages.AddRequests.take>`) and the consecutive ones go to
:meth:`Storage.add_run <bookie.storage.Storage.add_run>` together, which checks them (entry body
header, read-only gate, master key, fence) and journals them. After the covering fdatasync the
storage indexes the entries and advances the LAC, then :class:`_AddReplies` answers them: one
ADD_ACKS frame (or one frame per add) per connection and journal group. Nothing is acknowledged
before it is durable. A frame the shortcut does not take (another op, a malformed or large ADD, a
duplicate request id) is decoded by the generic codec at its place in the stream; an ADD among
them goes to the same ``add_run``. Handlers that read the disk run as tasks owned by the connection.

Status table (:data:`STATUS_FOR`): NoLedger -> ENOLEDGER, NoEntry -> ENOENTRY, Unknown (a ledger
in limbo: bookie/limbo.py) -> EUNKNOWNLEDGERSTATE, Fenced -> EFENCED,
Unauthorized / KeyRefused -> EUA, NotOpen (bookie/ledger_keys.py) -> EFENCED, EntryCorrupt /
JournalError / OSError -> EIO, BadRequest -> EBADREQ, TooManyRequests -> ETOOMANYREQUESTS,
ReadOnly -> EREADONLY. Anything unexpected is logged and
answered EIO: a bug in one handler must not take the connection, let alone the server, down.

Read-only mode (:mod:`bookie.mode`): while ``read_only`` is set (by the server, on a mode
transition) an add asks the mode machine first, after the body checks: a normal add gets EREADONLY
with the reason, a recovery add passes while the disk reserve lasts. A WRITE_LAC for a ledger this
bookie does not hold is refused too (it would start a new ledger); reads, fences and the rest are
unaffected.
"""

from __future__ import annotations

import asyncio
import heapq
import hmac
import struct
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import structlog

from bookie.budgets import refused_frame_cost
from bookie.connection_handler import ServerConnection, ServerLoad
from bookie.journal import JournalError
from bookie.ledger_keys import KeyRefused, NotOpen
from bookie.ledger_state import LedgerState, Waiter, WakeReason
from bookie.mode import ModeMachine, ReadOnly
from bookie.storage import (
    AddBatch,
    BadRequest,
    EntryCorrupt,
    Fenced,
    NoEntry,
    NoLedger,
    Storage,
    StorageError,
    Unauthorized,
    Unknown,
)
from bookkeeper_aio.common import failpoints
from bookkeeper_aio.common.failpoints import (
    _active as _failpoints_active,  # the live table (configure() mutates it)
)
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import (
    BATCH_READ_COUNT_MAX,
    FEATURE_ADD_ACKS,
    LAST_ENTRY,
    PROTOCOL_VERSION,
    OpCode,
    ReadFlag,
    StatusCode,
)
from bookkeeper_aio.protocol.errors import ProtocolError

log = structlog.get_logger(__name__)

_LENGTH = struct.Struct(">I")
RESPONSE_OVERHEAD_BYTES = 1024
"""Room for a response's envelope beside its entry bodies when bounding a batch by frame size."""
BODY_HEADER_BYTES_MAX = 5
"""msgpack's header of one body in a batch answer (bin 32: 5 bytes; bin 8/16: 2/3)."""


def batch_bytes_max(frame_bytes_max: int, max_bytes: int, max_count: int) -> int:
    """The body bytes a batch answer of at most ``max_count`` entries may carry so that its frame,
    each body's header and the envelope included, stays within ``frame_bytes_max`` (and within the
    reader's own ``max_bytes``)."""
    headers = min(max_count, BATCH_READ_COUNT_MAX) * BODY_HEADER_BYTES_MAX
    return min(max_bytes, frame_bytes_max - RESPONSE_OVERHEAD_BYTES - headers)


class TooManyRequests(StorageError):
    pass


STATUS_FOR: dict[type[BaseException], StatusCode] = {
    NoLedger: StatusCode.ENOLEDGER,
    NoEntry: StatusCode.ENOENTRY,
    Unknown: StatusCode.EUNKNOWNLEDGERSTATE,
    Fenced: StatusCode.EFENCED,
    Unauthorized: StatusCode.EUA,
    EntryCorrupt: StatusCode.EIO,
    JournalError: StatusCode.EIO,
    OSError: StatusCode.EIO,
    BadRequest: StatusCode.EBADREQ,
    TooManyRequests: StatusCode.ETOOMANYREQUESTS,
    ReadOnly: StatusCode.EREADONLY,
    KeyRefused: StatusCode.EUA,
    NotOpen: StatusCode.EFENCED,
}


def status_for(error: BaseException) -> StatusCode:
    for cls in type(error).__mro__:
        status = STATUS_FOR.get(cls)
        if status is not None:
            return status
    return StatusCode.EIO


_ADD_OP = int(OpCode.ADD_ENTRY)
# Read flags as plain ints: ``int & IntFlag`` builds a flag object through the enum machinery
# (microseconds per read request).
_FENCE_LEDGER = int(ReadFlag.FENCE_LEDGER)
_LONG_POLL = int(ReadFlag.LONG_POLL)
_ENTRY_PIGGYBACK = int(ReadFlag.ENTRY_PIGGYBACK)
_ENOENTRY = StatusCode.ENOENTRY
"""As a module name, for every refused read: ``StatusCode.ENOENTRY`` goes through
``EnumType.__getattr__``'s slow attribute path on Python 3.11 (about 0.3 us)."""
_BEFORE_ACK = failpoints.BEFORE_ACK
_AddEntryRequest = m.AddEntryRequest
_AddRequests = m.AddRequests

_encode_add_ok = m.encode_add_ok


class _AddReplies(AddBatch):
    """One connection's adds of one journal group (see :class:`~bookie.storage.AddBatch`): one
    ``complete_adds`` for them all once durable; a refused add answered at once."""

    __slots__ = ()

    def on_error(self, request_id: int, error: BaseException) -> None:
        conn: ServerConnection = self.target
        conn.processor.add_error(conn, request_id, error)

    def on_durable(self, error: BaseException | None) -> None:
        conn: ServerConnection = self.target
        rids = self.request_ids
        if error is not None:
            status = status_for(error)
            for rid in rids:
                conn.processor.count_error(status)
                conn.complete(rid, m.encode_error(_ADD_OP, rid, status, str(error)))
            return
        # ``count:N:kill`` counts acks, so the failpoint is passed once per ack, as before batching;
        # the table is checked once per batch, not a call per ack, while no failpoint is set.
        if _failpoints_active:
            for _ in rids:
                failpoints.hit(_BEFORE_ACK)
        if conn.add_acks:  # agreed in HELLO: one ADD_ACKS frame for the lot, not one per add
            conn.complete_adds(rids, m.encode_add_acks(rids))
            return
        frames = []
        entry_ids = self.entry_ids
        for run in self.runs:
            ledger_id = run.state.ledger_id
            for i in range(run.start, run.stop):
                frames.append(_encode_add_ok(rids[i], ledger_id, entry_ids[i]))
        conn.complete_adds(rids, frames)


class Processor:
    """Dispatches decoded requests to handlers; owns no connection state of its own."""

    def __init__(
        self,
        storage: Storage,
        bookie_id: str,
        frame_bytes_max: int,
        mode: ModeMachine | None = None,
        list_executor: Executor | None = None,
    ) -> None:
        self.storage = storage
        self.list_executor = list_executor
        """Where GET_LIST_OF_ENTRIES builds its ranges (None: on the loop, for tests)."""
        self.mode = mode
        self.read_only = False
        """Mirrors ``mode.read_only`` (set by the server on each transition): one attribute load on
        the add path while writable."""
        self.bookie_id = bookie_id
        self.frame_bytes_max = frame_bytes_max
        self._loop = asyncio.get_running_loop()
        self._waiters: dict[ServerConnection, set[Waiter]] = {}
        self._handlers: dict[type[Any], Callable[[ServerConnection, Any], None]] = {
            m.AddEntryRequest: self._add,
            m.HelloRequest: self._hello,
            m.ReadEntryRequest: self._read_entry,
            m.ReadLacRequest: self._read_lac,
            m.WriteLacRequest: self._write_lac,
            m.ForceLedgerRequest: self._force,
            m.BatchReadRequest: self._batch_read,
            m.GetBookieInfoRequest: self._bookie_info,
            m.GetListOfEntriesRequest: self._list_entries,
            m.AuthRequest: self._auth_too_late,
        }
        # Counters read at scrape time by bookie.metrics (plain ints: no metrics library per request).
        self.adds = 0
        self.requests: dict[type[Any], int] = dict.fromkeys(self._handlers, 0)
        """Requests by type, except adds (counted in ``adds``: the hot path skips the dict)."""
        self.entries_read = 0
        self.errors: dict[int, int] = {}
        """Error responses by wire status (including a bad frame that closed its connection)."""

    # ------------------------------------------------------------------ dispatch
    def dispatch_frames(
        self,
        conn: ServerConnection,
        buf: bytes | bytearray,
        view: memoryview,
        pos: int,
        limit: int,
        frame_max: int,
        load: ServerLoad,
    ) -> int:
        """Handle the complete frames in ``buf`` from ``pos``, in order, while ``conn`` is open and
        holds fewer than ``limit`` unanswered requests (taking a permit, and one of ``load``, per
        frame); returns the position after the last frame handled. Stops before an incomplete frame
        or one longer than ``frame_max`` (the caller closes the connection for that one).

        The frames of one socket read in one loop (the add hot path): the ADDs the codec's shortcut
        decodes gather into one list, handed to :meth:`Storage.add_run` (one call, one journal
        batch) before any other frame is handled and when the loop stops, so every answer keeps its
        place in the stream. ``view`` is ``buf``'s memoryview: the slices decoded here are dropped
        before the caller compacts ``buf``.
        """
        size_total = len(buf)
        unpack_length = _LENGTH.unpack_from
        request_ids = conn.request_ids
        adds = _AddRequests()
        take = adds.take
        # Permits taken are counted in ``taken`` and added to ``conn`` and ``load`` before any call
        # that may read or give back permits (two attribute updates per frame saved).
        in_flight = conn.in_flight
        taken = 0
        try:
            while True:
                if size_total - pos < 4 or in_flight + taken >= limit or conn.halted:
                    if not adds.fields or size_total - pos < 4:
                        break  # the ``finally`` journals what gathered: no fresh list for nothing
                    conn.in_flight += taken
                    load.in_flight += taken
                    taken = 0
                    pending, adds = adds, _AddRequests()
                    take = adds.take
                    self._add_run(conn, pending)  # a refused add gives its permit back at once
                    in_flight = conn.in_flight
                    continue
                (size,) = unpack_length(buf, pos)
                if size > frame_max:
                    break
                start = pos + 4
                end = start + size
                if end > size_total:
                    break
                taken += 1
                pos = end
                rid = take(view[start:end])  # the codec's ADD shortcut: -1 if not taken
                if rid >= 0:
                    if rid not in request_ids:
                        request_ids.add(rid)
                        continue
                    adds.drop_last()  # a duplicate of one in flight: the generic path refuses it
                conn.in_flight += taken
                load.in_flight += taken
                taken = 0
                if adds.fields:
                    pending, adds = adds, _AddRequests()
                    take = adds.take
                    self._add_run(conn, pending)
                self._dispatch_generic(conn, view[start:end])
                in_flight = conn.in_flight
        finally:
            conn.in_flight += taken
            load.in_flight += taken
            if adds.fields:  # the end of the read, an incomplete or oversized frame (or raised)
                self._add_run(conn, adds)
        return pos

    def _add_run(self, conn: ServerConnection, adds: m.AddRequests) -> None:
        """Journal (or refuse, answering at once) consecutive adds of ``conn``."""
        self.adds += len(adds.fields)
        check_add = self.mode.check_add if self.read_only and self.mode is not None else None
        self.storage.add_run(adds, conn, _AddReplies, check_add)

    def _dispatch_generic(self, conn: ServerConnection, body: memoryview) -> None:
        """Decode one frame body into a request object and run its handler (every op; an ADD the
        inline checks did not accept). Always answers or closes; never raises."""
        try:
            request = m.decode_request_generic(body)
        except ProtocolError as exc:
            self._bad_frame(conn, exc, len(body))
            return
        finally:
            body.release()
        rid = request.request_id
        request_ids = conn.request_ids
        if rid in request_ids:
            self.count_error(StatusCode.EBADREQ, conn)
            conn.complete(
                None, m.encode_error(_op_of(request), rid, StatusCode.EBADREQ, "duplicate request id")
            )
            return
        request_ids.add(rid)
        if type(request) is _AddEntryRequest:  # the hot path skips the table lookup
            self._handle(conn, request)
            return
        self.requests[type(request)] += 1
        if self._creates_record(request):  # an unknown ledger's key is checked against metadata first
            conn.spawn(self._verify_then_handle(conn, request))
            return
        self._handle(conn, request, verify=True)

    def _handle(self, conn: ServerConnection, request: Any, *, verify: bool = False) -> None:
        """Run ``request``'s handler, answering what it raises. With ``verify``, a key mismatch
        the metadata may settle (a squatter's record: :mod:`bookie.ledger_keys`) is retried once
        the key is checked."""
        try:
            if type(request) is _AddEntryRequest:
                self._add(conn, request)
            else:
                self._handlers[type(request)](conn, request)
        except Unauthorized as exc:
            keys = self.storage.keys
            if (
                verify
                and keys is not None
                and getattr(request, "master_key", None) is not None
                and keys.may_verify(request.ledger_id)
            ):
                conn.spawn(self._verify_then_handle(conn, request))
            else:
                self._error(conn, request, exc)
        except (StorageError, JournalError, OSError, KeyRefused) as exc:
            self._error(conn, request, exc)
        except Exception as exc:  # a handler bug: answer EIO, keep serving (logged with trace)
            log.exception("processor.handler_failed", op=_op_of(request))
            self._error(conn, request, exc)

    def _creates_record(self, request: Any) -> bool:
        """Whether ``request`` would create the record of a ledger this bookie does not hold, or
        give its key to a record that holds none (a fence, a WRITE_LAC), while a key check against
        metadata is configured: a keyless record (a keyless fence's, one replayed after a lost
        forget) takes the first key it is shown, so that key is checked first."""
        if self.storage.keys is None:
            return False
        kind = type(request)
        if kind is m.WriteLacRequest:
            limbo = self.storage.limbo
            if limbo is not None and limbo.wants_write_check(request.ledger_id):
                return True  # its fence may have been cut: metadata must show it OPEN first
            creates = True
        elif kind is m.ReadEntryRequest or kind is m.BatchReadRequest:
            creates = bool(request.flags & _FENCE_LEDGER) and request.master_key is not None
        else:
            return False
        if not creates:
            return False
        state = self.storage.ledgers.get(request.ledger_id)
        return state is None or state.master_key is None

    async def _verify_then_handle(self, conn: ServerConnection, request: Any) -> None:
        keys = self.storage.keys
        assert keys is not None
        try:
            await keys.verify(
                request.ledger_id, request.master_key, conn, writes=type(request) is m.WriteLacRequest
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (refused, busy, metadata unreachable: answered)
            if not conn.closed:
                self._error(conn, request, exc)
            return
        if not conn.closed:
            self._handle(conn, request)

    def count_error(self, status: int, conn: ServerConnection | None = None, cost: float = 1.0) -> None:
        """Count one error response (not on the success path); with ``conn``, charge it (``cost``
        refusals) to the connection's peer address (:meth:`ServerConnection.charge_error`: refusals
        are budgeted)."""
        self.errors[status] = self.errors.get(status, 0) + 1
        if conn is not None:
            conn.charge_error(status, cost)

    def long_poll_waiters(self) -> int:
        """Long-poll reads parked on this bookie (at scrape time: O(connections))."""
        return sum(len(waiters) for waiters in self._waiters.values())

    def _bad_frame(self, conn: ServerConnection, exc: ProtocolError, size: int = 0) -> None:
        """Answer (or close on) a frame that does not decode, charged by its ``size``."""
        self.count_error(StatusCode.EBADREQ, conn, refused_frame_cost(exc, size))
        if exc.request_id is None:
            conn.warn("connection.bad_frame", error=str(exc))
            conn.complete(None, None)
            conn.close_erred(None)  # at its turn if its address is in deficit
            return
        op = exc.op if exc.op is not None else 0
        conn.complete(None, m.encode_error(op, exc.request_id, StatusCode.EBADREQ, str(exc)))

    def add_error(self, conn: ServerConnection, rid: int, exc: BaseException) -> None:
        """Answer an add refused before the journal (for :class:`_AddReplies`)."""
        status = status_for(exc)
        self.count_error(status, conn)
        conn.complete(rid, m.encode_error(_ADD_OP, rid, status, str(exc) or type(exc).__name__))

    def _error(self, conn: ServerConnection, request: Any, exc: BaseException) -> None:
        rid = request.request_id
        status = status_for(exc)
        self.count_error(status, conn)
        conn.complete(rid, m.encode_error(_op_of(request), rid, status, str(exc) or type(exc).__name__))

    def connection_lost(self, conn: ServerConnection) -> None:
        for waiter in self._waiters.pop(conn, ()):
            waiter.cancel()

    # ------------------------------------------------------------------ writes
    def _add(self, conn: ServerConnection, req: m.AddEntryRequest) -> None:
        adds = _AddRequests()
        adds.append(req)
        self._add_run(conn, adds)

    def _write_lac(self, conn: ServerConnection, req: m.WriteLacRequest) -> None:
        if self.read_only and self.mode is not None and req.ledger_id not in self.storage.ledgers:
            raise ReadOnly(f"bookie is read-only ({self.mode.reason}): no new ledgers")

        done = self._answer_once_durable(
            conn, req, m.WriteLacResponse(req.request_id, 0, None, req.ledger_id)
        )
        self.storage.write_lac(req.ledger_id, req.master_key, req.lac, b"", done)

    def _force(self, conn: ServerConnection, req: m.ForceLedgerRequest) -> None:
        state = self.storage.ledgers.get(req.ledger_id)
        if (
            state is not None
            and state.master_key is not None
            and not hmac.compare_digest(state.master_key, req.master_key)
        ):
            raise Unauthorized(f"ledger {req.ledger_id}: master key mismatch")

        self.storage.force(
            self._answer_once_durable(
                conn, req, m.ForceLedgerResponse(req.request_id, 0, None, req.ledger_id)
            )
        )

    def _answer_once_durable(
        self, conn: ServerConnection, req: Any, response: m.Response
    ) -> Callable[[BaseException | None], None]:
        """The journal callback of a write: ``response`` once durable, else the error's answer."""

        def done(error: BaseException | None) -> None:
            if error is not None:
                self._error(conn, req, error)
            else:
                conn.complete(req.request_id, m.encode(response))

        return done

    # ------------------------------------------------------------------ reads
    def _read_entry(self, conn: ServerConnection, req: m.ReadEntryRequest) -> None:
        if req.flags & _FENCE_LEDGER:
            if req.master_key is None:
                raise BadRequest("a fencing read must carry the master key")
            self.storage.fence(req.ledger_id, req.master_key, lambda e: self._after_fence(conn, req, e))
            return
        if req.flags & _LONG_POLL:
            self._long_poll(conn, req)
            return
        self.storage.check_read_key(req.ledger_id, req.master_key)
        conn.spawn(self._answer_read(conn, req))

    def _after_fence(
        self, conn: ServerConnection, req: m.ReadEntryRequest, error: BaseException | None
    ) -> None:
        if error is not None:
            self._error(conn, req, error)
        elif not conn.closed:
            conn.spawn(self._answer_read(conn, req))

    async def _answer_read(
        self, conn: ServerConnection, req: m.ReadEntryRequest, piggyback: bool = True
    ) -> None:
        await conn.take_read_slot()
        answered = False
        try:
            await self._answer_read_in_slot(conn, req, piggyback)
            answered = True
        finally:
            conn.give_read_slot(answered)

    async def _answer_read_in_slot(
        self, conn: ServerConnection, req: m.ReadEntryRequest, piggyback: bool
    ) -> None:
        rid, lid = req.request_id, req.ledger_id
        try:
            state = self.storage.ledger_for_read(lid, req.master_key)
            if not piggyback:
                frame = m.encode(m.ReadEntryResponse(rid, 0, None, lid, req.entry_id, None, state.lac))
            else:
                entry_id, body = await self.storage.read_entry(lid, req.entry_id)
                frame = m.encode_read_ok(rid, lid, entry_id, body, state.lac)
                self.entries_read += 1
        except asyncio.CancelledError:
            raise
        except NoEntry as exc:
            if req.flags & _LONG_POLL:
                # a long poll's piggybacked entry is a bonus: one gone since it was judged present
                # (its ledger re-keyed or forgotten meanwhile) leaves the LAC answer, never ENOENTRY
                frame = m.encode(m.ReadEntryResponse(rid, 0, None, lid, req.entry_id, None, state.lac))
            else:
                self.count_error(_ENOENTRY)
                lac = state.lac
                frame = m.encode(m.ReadEntryResponse(rid, _ENOENTRY, str(exc), lid, req.entry_id, None, lac))
        except (EntryCorrupt, OSError) as exc:
            if req.entry_id == LAST_ENTRY and req.flags & _FENCE_LEDGER:
                frame = self._fenced_last_unreadable(conn, rid, lid, state, exc)
            else:
                frame = self._read_failed(conn, OpCode.READ_ENTRY, rid, lid, req.entry_id, exc)
        except Exception as exc:  # noqa: BLE001 (a bug is logged with its trace by _read_failed)
            frame = self._read_failed(conn, OpCode.READ_ENTRY, rid, lid, req.entry_id, exc)
        conn.complete(rid, frame)

    def _fenced_last_unreadable(
        self, conn: ServerConnection, rid: int, lid: int, state: LedgerState, exc: Exception
    ) -> bytes:
        """The answer to a fencing read of entry -1 whose last entry cannot be read (docs/protocol.md
        §7.2): the fence is durable, so it is EOK and counts toward the recoverer's coverage (an
        EIO would not: two such bookies of a 3-bookie ensemble left the ledger unfenceable for
        good), with no body and ``unreadable`` set. The entry is not absent: the recoverer reads it
        from another replica, and this bookie keeps answering EIO for it."""
        self.count_error(StatusCode.EIO)  # not the peer's doing: no charge to its refusal budget
        entry_id = state.index.last_entry_id
        log.warning(
            "processor.fenced_last_entry_unreadable", ledger_id=lid, entry_id=entry_id, error=str(exc)
        )
        return m.encode(m.ReadEntryResponse(rid, StatusCode.EOK, None, lid, entry_id, None, state.lac, True))

    def _long_poll(self, conn: ServerConnection, req: m.ReadEntryRequest) -> None:
        state = self.storage.ledger_for_read(req.ledger_id, req.master_key)
        piggyback = bool(req.flags & _ENTRY_PIGGYBACK)
        if state.lac > req.previous_lac or state.fenced or req.timeout_ms == 0:
            self._answer_long_poll(conn, req, state, piggyback)
            return
        refused = conn.long_poll_refusal()
        if refused is not None:
            raise TooManyRequests(refused)
        waiters = self._waiters.setdefault(conn, set())

        def woken(reason: WakeReason) -> None:
            waiters.discard(waiter)
            if not conn.closed:
                conn.long_poll_woken()
                self._answer_long_poll(conn, req, state, piggyback and reason is not WakeReason.TIMEOUT)

        waiter: Waiter | None = state.add_waiter(req.previous_lac, req.timeout_ms / 1000.0, woken, self._loop)
        if waiter is None:
            raise TooManyRequests(f"ledger {req.ledger_id} has too many long-poll readers")
        waiters.add(waiter)
        conn.long_poll_parked()  # counted apart: its request permit is given back while it waits

    def _answer_long_poll(
        self, conn: ServerConnection, req: m.ReadEntryRequest, state: LedgerState, piggyback: bool
    ) -> None:
        wanted = piggyback and req.entry_id in state.index
        conn.spawn(self._answer_read(conn, req, piggyback=wanted))

    def _read_lac(self, conn: ServerConnection, req: m.ReadLacRequest) -> None:
        state = self.storage.ledger_for_read(req.ledger_id, req.master_key)
        conn.complete(
            req.request_id, m.encode(m.ReadLacResponse(req.request_id, 0, None, req.ledger_id, state.lac))
        )

    def _batch_read(self, conn: ServerConnection, req: m.BatchReadRequest) -> None:
        if req.flags & _FENCE_LEDGER:
            if req.master_key is None:
                raise BadRequest("a fencing read must carry the master key")
            self.storage.fence(
                req.ledger_id,
                req.master_key,
                lambda e: self._error(conn, req, e) if e else self._spawn_batch(conn, req),
            )
            return
        self.storage.check_read_key(req.ledger_id, req.master_key)
        self._spawn_batch(conn, req)

    def _spawn_batch(self, conn: ServerConnection, req: m.BatchReadRequest) -> None:
        if not conn.closed:
            conn.spawn(self._answer_batch(conn, req))

    async def _answer_batch(self, conn: ServerConnection, req: m.BatchReadRequest) -> None:
        await conn.take_read_slot()
        answered = False
        try:
            await self._answer_batch_in_slot(conn, req)
            answered = True
        finally:
            conn.give_read_slot(answered)

    async def _answer_batch_in_slot(self, conn: ServerConnection, req: m.BatchReadRequest) -> None:
        rid, lid = req.request_id, req.ledger_id
        bytes_max = batch_bytes_max(self.frame_bytes_max, req.max_bytes, req.max_count)
        try:
            state = self.storage.ledger_for_read(lid, req.master_key)
            start, step = req.start_entry_id, req.step
            bodies = await self.storage.read_range(lid, start, req.max_count, bytes_max, step)
            frame = m.encode_batch_read_ok(rid, lid, start, bodies, state.lac, step)
            self.entries_read += len(bodies)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (a bug is logged with its trace by _read_failed)
            frame = self._read_failed(conn, OpCode.BATCH_READ, rid, lid, req.start_entry_id, exc)
        conn.complete(rid, frame)

    def _read_failed(
        self, conn: ServerConnection, op: int, rid: int, lid: int, entry_id: int, exc: Exception
    ) -> bytes:
        """The answer to a read that failed; what is not a storage or disk error is a bug, logged
        with its trace (call from the ``except`` block)."""
        if not isinstance(exc, StorageError | OSError):
            log.exception("processor.read_failed", ledger_id=lid, entry_id=entry_id)
        status = status_for(exc)
        self.count_error(status, conn)
        return m.encode_error(op, rid, status, str(exc) or type(exc).__name__)

    # ------------------------------------------------------------------ misc
    def _hello(self, conn: ServerConnection, req: m.HelloRequest) -> None:
        if req.protocol_version != PROTOCOL_VERSION:
            message = f"bookie speaks protocol version {PROTOCOL_VERSION}, not {req.protocol_version}"
            self.count_error(StatusCode.EBADVERSION)
            conn.complete(
                req.request_id, m.encode_error(OpCode.HELLO, req.request_id, StatusCode.EBADVERSION, message)
            )
            return
        features = req.features & FEATURE_ADD_ACKS  # the ones this bookie knows, of those asked
        conn.add_acks = bool(features & FEATURE_ADD_ACKS)
        response = m.HelloResponse(
            req.request_id, 0, None, PROTOCOL_VERSION, self.bookie_id, self.frame_bytes_max, features
        )
        conn.complete(req.request_id, m.encode(response))

    def _auth_too_late(self, conn: ServerConnection, req: m.AuthRequest) -> None:
        """AUTH is the handshake (bookie.connection_handler), never after other requests."""
        raise BadRequest("AUTH is only accepted before any other request but HELLO")

    def _bookie_info(self, conn: ServerConnection, req: m.GetBookieInfoRequest) -> None:
        # The disk figures of the mode's last check (a worker thread's statvfs, every
        # disk_check_interval_s): a statvfs here would stall the loop on a hung filesystem.
        mode = self.mode
        info: dict[str, int | str] = {
            "ledgers": len(self.storage.ledgers),
            "state": "readonly" if self._is_read_only() else "writable",
            "journal_groups": self.storage.journal.groups_written,
            "journal_records": self.storage.journal.records_written,
            # The highest ledger id held here (0: none): `bkaio cluster raise-ids` keeps the
            # cluster's id counter above it. One pass over the ids, for an operator's request only.
            "ledger_id_max": max(self.storage.ledgers, default=0),
        }
        if mode is not None and mode.free_bytes is not None and mode.total_bytes is not None:
            info["free_disk_bytes"] = mode.free_bytes
            info["total_disk_bytes"] = mode.total_bytes
        if mode is not None and mode.reason is not None:
            info["read_only_reason"] = mode.reason[: m.TEXT_CHARS_MAX]
        conn.complete(req.request_id, m.encode(m.GetBookieInfoResponse(req.request_id, 0, None, info)))

    def _is_read_only(self) -> bool:
        return self.read_only or self.storage.journal.failed is not None

    def _list_entries(self, conn: ServerConnection, req: m.GetListOfEntriesRequest) -> None:
        state = self.storage.ledger_for_read(req.ledger_id, req.master_key)
        if self.storage.in_limbo(req.ledger_id):  # the list would say the rest is absent
            raise Unknown(f"ledger {req.ledger_id} is in limbo on this bookie: its entry list is unknown")
        base, positions, _lengths, overflow = state.index.snapshot()
        # A copy of the dense array (one memcpy), then the ranges off the loop: a Python loop per
        # entry on the loop was 0.9 s at 2M entries, per request, for any holder of the key.
        snapshot = (base, positions.tobytes(), overflow[0::4].tolist())
        if self.list_executor is None:
            self._answer_list(conn, req, entry_ranges(*snapshot))
            return
        conn.spawn(self._list_entries_off_loop(conn, req, snapshot))

    async def _list_entries_off_loop(
        self, conn: ServerConnection, req: m.GetListOfEntriesRequest, snapshot: tuple[int, bytes, list[int]]
    ) -> None:
        try:
            ranges = await self._loop.run_in_executor(self.list_executor, entry_ranges, *snapshot)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (TooManyRequests; a bug is answered EIO)
            self._error(conn, req, exc)
            return
        if self.storage.in_limbo(req.ledger_id):  # not when the list was asked: checked again
            self._error(conn, req, Unknown(f"ledger {req.ledger_id} is in limbo on this bookie"))
            return
        self._answer_list(conn, req, ranges)

    def _answer_list(
        self, conn: ServerConnection, req: m.GetListOfEntriesRequest, ranges: list[list[int]]
    ) -> None:
        response = m.GetListOfEntriesResponse(req.request_id, 0, None, req.ledger_id, ranges)
        conn.complete(req.request_id, m.encode(response))


_FF = [b"\xff" * (8 << i) for i in range(8)]
"""Runs of absent slots (int64 -1: 0xff bytes) of growing sizes, to measure a gap by ``startswith``
(a memcmp, no copy) in O(log gap) calls."""


def entry_ranges(base: int, positions: bytes, overflow_ids: list[int]) -> list[list[int]]:
    """The ``[first, last]`` runs of entry ids held, from an index snapshot
    (:meth:`~bookie.index.LedgerIndex.snapshot`: the dense slots from ``base`` as native int64
    bytes, and the ids outside them): gaps are found by ``bytes.find`` and measured by
    ``startswith`` (C), so the Python work is per run (and log of its gap), not per entry.
    TooManyRequests past ``RANGES_MAX`` runs."""
    ranges: list[list[int]] = []
    slots = len(positions) // 8
    start = 0
    find, startswith = positions.find, positions.startswith
    first, last = _FF[0], len(_FF) - 1
    # A present position is >= 0, so its most significant byte is never 0xff: 8 or more 0xff bytes
    # in a row hold whole absent slots, plus at most 7 bytes of a present neighbour.
    while (gap := find(first, start * 8)) >= 0:
        first_absent = (gap + 7) // 8  # whole slots only, whatever the byte order
        if first_absent > start:
            ranges.append([base + start, base + first_absent - 1])
            if len(ranges) > m.RANGES_MAX:
                raise TooManyRequests("ledger has more entry ranges than one response may carry")
        end, size = gap, 0
        while True:  # the gap's end: steps growing while they fit, then shrinking
            if startswith(_FF[size], end):
                end += 8 << size
                size = min(size + 1, last)
            elif size:
                size -= 1
            else:
                break
        start = end // 8
    if start < slots:
        ranges.append([base + start, base + slots - 1])
    if overflow_ids:  # sparse ids outside the dense slots (rare): merged in order
        singles = [[entry_id, entry_id] for entry_id in sorted(overflow_ids)]
        merged: list[list[int]] = []
        for run in heapq.merge(ranges, singles):
            if merged and merged[-1][1] >= run[0] - 1:
                merged[-1][1] = max(merged[-1][1], run[1])
            else:
                merged.append(run)
        ranges = merged
    if len(ranges) > m.RANGES_MAX:
        raise TooManyRequests("ledger has more entry ranges than one response may carry")
    return ranges


def _op_of(request: Any) -> int:
    return m.REQUEST_OP[type(request)]
