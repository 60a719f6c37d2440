"""Request processing: one handler per op; storage errors become wire statuses in one table.

The add path (hot): decode -> check the body's header names the request's ledger and entry ->
master key (EUA) -> fenced unless RECOVERY_ADD (EFENCED) -> journal -> after the covering fdatasync
the storage updates the index and LAC -> the response is queued on the connection. Nothing is
acknowledged before it is durable. Handlers that read the disk run as tasks owned by the connection.

Status table (:data:`STATUS_FOR`): NoLedger -> ENOLEDGER, NoEntry -> ENOENTRY, Fenced -> EFENCED,
Unauthorized -> EUA, EntryCorrupt / JournalError / OSError -> EIO, BadRequest -> EBADREQ,
TooManyRequests -> ETOOMANYREQUESTS, ReadOnly -> EREADONLY. Anything unexpected is logged and
answered EIO: a bug in one handler must not take the connection, let alone the server, down.

Read-only mode (:mod:`bookie.mode`): while ``read_only`` is set (by the server, on a mode
transition) an add asks the mode machine first, after the body checks: a normal add gets EREADONLY
with the reason, a recovery add passes while the disk reserve lasts. A WRITE_LAC for a ledger this
bookie does not hold is refused too (it would start a new ledger); reads, fences and the rest are
unaffected.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import struct
from collections.abc import Callable
from typing import Any

import crc32c
import msgpack
import structlog

from bookie import journal_format as fmt
from bookie.connection_handler import ServerConnection, ServerLoad
from bookie.journal import JournalError
from bookie.ledger_state import LedgerState, Waiter, WakeReason
from bookie.mode import ModeMachine, ReadOnly
from bookie.storage import (
    AddBatch,
    AddCompletion,
    AddItem,
    EntryCorrupt,
    Fenced,
    NoEntry,
    NoLedger,
    Storage,
    StorageError,
    Unauthorized,
)
from bookkeeper_aio.common import failpoints
from bookkeeper_aio.common.failpoints import (
    _active as _failpoints_active,  # the live table (configure() mutates it)
)
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import (
    FEATURE_ADD_ACKS,
    ID_MAX,
    MASTER_KEY_BYTES_MAX,
    PROTOCOL_VERSION,
    REQUEST_ID_MAX,
    AddFlag,
    OpCode,
    ReadFlag,
    StatusCode,
)
from bookkeeper_aio.protocol.errors import ProtocolError

log = structlog.get_logger(__name__)

_BODY_HEADER = struct.Struct(">qqq")  # ledger id, entry id, piggybacked LAC (digest.py header)
_LENGTH = struct.Struct(">I")
_BODY_HEADER_BYTES = 32
RESPONSE_OVERHEAD_BYTES = 1024
"""Room for a response's envelope beside its entry bodies when bounding a batch by frame size."""


class BadRequest(StorageError):
    pass


class TooManyRequests(StorageError):
    pass


STATUS_FOR: dict[type[BaseException], StatusCode] = {
    NoLedger: StatusCode.ENOLEDGER,
    NoEntry: StatusCode.ENOENTRY,
    Fenced: StatusCode.EFENCED,
    Unauthorized: StatusCode.EUA,
    EntryCorrupt: StatusCode.EIO,
    JournalError: StatusCode.EIO,
    OSError: StatusCode.EIO,
    BadRequest: StatusCode.EBADREQ,
    TooManyRequests: StatusCode.ETOOMANYREQUESTS,
    ReadOnly: StatusCode.EREADONLY,
}


def status_for(error: BaseException) -> StatusCode:
    for cls in type(error).__mro__:
        status = STATUS_FOR.get(cls)
        if status is not None:
            return status
    return StatusCode.EIO


_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_unpackb = msgpack.unpackb
_UNPACK_ERRORS = (ValueError, TypeError, OverflowError, msgpack.UnpackException)
_FAST_ADD_BYTES_MAX = m.PLAIN_REQUEST_BYTES_MAX
_REQUEST_ID_MAX = REQUEST_ID_MAX
_ID_MAX = ID_MAX
_MASTER_KEY_BYTES_MAX = MASTER_KEY_BYTES_MAX
_ADD_OP = int(OpCode.ADD_ENTRY)
_BEFORE_ACK = failpoints.BEFORE_ACK
_AddEntryRequest = m.AddEntryRequest
_RECOVERY_ADD = int(AddFlag.RECOVERY_ADD)
_unpack_body_header = _BODY_HEADER.unpack_from
_crc32c = crc32c.crc32c
_compare_digest = hmac.compare_digest
_ENTRY_TYPE = int(fmt.RecordType.ENTRY)
_pack_crc_prefix = struct.Struct(">IBqq").pack  # body length, type, ledger id, entry id
_pack_entry_head = struct.Struct(">IIIBqq").pack  # the record header, then the ENTRY id prefix
_ENTRY_PREFIX_BYTES = fmt.ENTRY_PREFIX_BYTES
_RECORD_BODY_BYTES_MAX = fmt.RECORD_BODY_BYTES_MAX
_RECORD_HEADER_BYTES = fmt.RECORD_HEADER_BYTES
_RECORD_MAGIC = fmt.RECORD_MAGIC


def encode_add_ok(request_id: int, ledger_id: int, entry_id: int) -> bytes:
    """``m.encode(m.AddEntryResponse(request_id, EOK, None, ledger_id, entry_id))``, without the
    NamedTuple and lookups (the hot path; a unit test pins the two to the same bytes)."""
    body = _packb((_ADD_OP, request_id, 0, None, ledger_id, entry_id))
    return _LENGTH.pack(len(body)) + body


_FRAME_PREFIX = [_LENGTH.pack(size) for size in range(64)]
"""Length prefixes of the short frames an ADD answer is (its body is at most 31 bytes)."""


class _AddReplies(AddBatch):
    """The adds of one journal group: answer them, one ``complete_adds`` per connection run."""

    __slots__ = ()

    def on_durable(self, items: list[AddItem], error: BaseException | None) -> None:
        if error is not None:
            status = status_for(error)
            frame_of = m.encode_error
            for item in items:
                target: ServerConnection = item[6]
                target.processor.count_error(status)
                target.complete(item[7], frame_of(_ADD_OP, item[7], status, str(error)))
            return
        # ``count:N:kill`` counts acks, so the failpoint is passed once per ack, as before batching;
        # the table is checked once per batch, not a call per ack, while no failpoint is set.
        hit = failpoints.hit if _failpoints_active else None
        packb = _packb
        prefix = _FRAME_PREFIX
        conn: ServerConnection | None = None
        batched = False  # the connection agreed to ADD_ACKS: one frame for its run, not one per add
        frames: list[bytes] = []
        rids: list[int] = []
        for entry_id, _, _, _, state, _, target, rid in items:
            if target is not conn:
                if conn is not None:
                    conn.complete_adds(rids, m.encode_add_acks(rids) if batched else frames)
                    frames, rids = [], []
                conn = target
                batched = target.add_acks
            if hit is not None:
                hit(_BEFORE_ACK)
            if not batched:
                body = packb((_ADD_OP, rid, 0, None, state.ledger_id, entry_id))
                frames.append(prefix[len(body)])
                frames.append(body)
            rids.append(rid)
        if conn is not None:
            conn.complete_adds(rids, m.encode_add_acks(rids) if batched else frames)


class _AddReply(AddCompletion):
    """One add's completion: queue the response on its connection."""

    __slots__ = ("conn", "ledger_id", "request_id")

    def __init__(self, conn: ServerConnection, request_id: int, ledger_id: int) -> None:
        self.conn = conn
        self.request_id = request_id
        self.ledger_id = ledger_id

    def on_durable(self, error: BaseException | None) -> None:
        if error is None:
            failpoints.hit(failpoints.BEFORE_ACK)
            frame = encode_add_ok(self.request_id, self.ledger_id, self.entry_id)
        else:
            status = status_for(error)
            self.conn.processor.count_error(status)
            frame = m.encode_error(_ADD_OP, self.request_id, status, str(error))
        self.conn.complete(self.request_id, frame)


class Processor:
    """Dispatches decoded requests to handlers; owns no connection state of its own."""

    def __init__(
        self, storage: Storage, bookie_id: str, frame_bytes_max: int, mode: ModeMachine | None = None
    ) -> None:
        self.storage = storage
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
        buf: bytearray,
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

        The frames of one socket read in one loop (the add hot path): a well-formed ADD is checked
        field by field (as ``messages._fast_add_request`` does), then the ledger checks and the
        record of :meth:`Storage.add_entry` run here, and the record goes into the journal batch
        this read holds open (:meth:`Journal.open_batch`), its completion one item of the group's
        batch: no call per add. Anything the inline checks do not accept (another op, a malformed ADD,
        a duplicate request id) goes to the generic path at its place in the stream, which decodes
        again and answers precisely. ``view`` is ``buf``'s
        memoryview: the slices decoded here are dropped before the caller compacts ``buf``.
        """
        size_total = len(buf)
        unpack_length = _LENGTH.unpack_from
        generic = self._dispatch_generic
        request_ids = conn.request_ids
        storage = self.storage
        ledgers = storage.ledgers
        journal = storage.journal
        fast_max = _FAST_ADD_BYTES_MAX
        adds = 0
        # The journal batch open for this read (see Journal.open_batch): ``parts`` is None while
        # none is; closed before anything else may append to the journal (the generic path, a new
        # ledger's key record) and at the end.
        parts: list[bytes] | None = None
        segment_id = offset = end_max = record_max = records = 0
        batch: Any = None
        try:
            while size_total - pos >= 4 and conn.in_flight < limit and not conn.closed:
                (size,) = unpack_length(buf, pos)
                if size > frame_max:
                    break
                start = pos + 4
                end = start + size
                if end > size_total:
                    break
                conn.in_flight += 1
                load.in_flight += 1
                pos = end
                fast = False
                if 2 < size <= fast_max and buf[start] == 0x97 and buf[start + 1] == _ADD_OP:
                    try:
                        _, rid, lid, eid, flags, key, entry = _unpackb(
                            view[start:end], max_array_len=7, max_map_len=0
                        )
                    except _UNPACK_ERRORS:
                        pass
                    else:
                        fast = (
                            type(rid) is int
                            and type(lid) is int
                            and type(eid) is int
                            and type(flags) is int
                            and type(key) is bytes
                            and type(entry) is bytes
                            and 0 <= rid <= _REQUEST_ID_MAX
                            and 0 <= lid <= _ID_MAX
                            and 0 <= eid <= _ID_MAX
                            and 0 <= flags <= 0xFF
                            and len(key) <= _MASTER_KEY_BYTES_MAX
                            and len(entry) >= _BODY_HEADER_BYTES
                            and rid not in request_ids
                        )
                if not fast:
                    if parts is not None:
                        parts = None  # first: the batch is closed once even if close_batch raises
                        journal.close_batch(offset, records, batch)
                    generic(conn, view[start:end])
                    continue
                request_ids.add(rid)
                adds += 1
                ledger_id, entry_id, lac = _unpack_body_header(entry)
                if ledger_id != lid or entry_id != eid:
                    message = f"entry body does not carry ledger {lid} entry {eid}"
                    self._add_error(conn, rid, BadRequest(message))
                    continue
                try:
                    recovery = flags & _RECOVERY_ADD != 0
                    if self.read_only and self.mode is not None:
                        self.mode.check_add(recovery)
                    # The ledger checks and record of an add (Storage.add_entry's, with the
                    # completion one item of the group's batch).
                    state = ledgers.get(lid)
                    if (
                        state is None
                        or state.master_key is None
                        or not _compare_digest(state.master_key, key)
                    ):
                        if parts is not None:  # a new ledger journals its key first
                            parts = None
                            journal.close_batch(offset, records, batch)
                        state = storage.ledger_for_write(lid, key)
                    if state.fenced and not recovery:
                        self._add_error(conn, rid, Fenced(f"ledger {lid} is fenced"))
                        continue
                    length = _ENTRY_PREFIX_BYTES + len(entry)
                    if length > _RECORD_BODY_BYTES_MAX:
                        message = f"entry of {len(entry)} bytes exceeds the journal record maximum"
                        self._add_error(conn, rid, JournalError(message))
                        continue
                    crc = _crc32c(entry, _crc32c(_pack_crc_prefix(length, _ENTRY_TYPE, lid, eid)))
                    head = _pack_entry_head(_RECORD_MAGIC, length, crc, _ENTRY_TYPE, lid, eid)
                    record_size = length + _RECORD_HEADER_BYTES
                    if parts is None:
                        parts, segment_id, offset, end_max, record_max, batch = journal.open_batch(
                            _AddReplies
                        )
                        records = 0
                    if offset + record_size > end_max or record_size > record_max:
                        # Past the segment's end (or the configured record maximum): the one-record
                        # path rolls the segment (or raises).
                        parts = None
                        journal.close_batch(offset, records, batch)
                        seg, at, one = journal.append_batched(head, entry, _AddReplies)
                        one.items.append((eid, seg, at, record_size, state, lac, conn, rid))
                        continue
                    parts.append(head)
                    parts.append(entry)
                    batch.items.append((eid, segment_id, offset, record_size, state, lac, conn, rid))
                    offset += record_size
                    records += 1
                except (StorageError, JournalError, OSError) as exc:
                    self._add_error(conn, rid, exc)
                except Exception as exc:  # a handler bug: answer EIO, keep serving
                    log.exception("processor.handler_failed", op=_ADD_OP)
                    self._add_error(conn, rid, exc)
        finally:
            self.adds += adds
            if parts is not None:
                journal.close_batch(offset, records, batch)
        return pos

    def _dispatch_generic(self, conn: ServerConnection, body: memoryview) -> None:
        """Decode one frame body into a request object and run its handler (every op; an ADD the
        inline checks did not accept). Always answers or closes; never raises."""
        try:
            request = m.decode_request(body)
        except ProtocolError as exc:
            self._bad_frame(conn, exc)
            return
        finally:
            body.release()
        rid = request.request_id
        request_ids = conn.request_ids
        if rid in request_ids:
            self.count_error(StatusCode.EBADREQ)
            conn.complete(
                None, m.encode_error(_op_of(request), rid, StatusCode.EBADREQ, "duplicate request id")
            )
            return
        request_ids.add(rid)
        try:
            if type(request) is _AddEntryRequest:  # the hot path skips the table lookup
                self.adds += 1
                self._add(conn, request)
            else:
                self.requests[type(request)] += 1
                self._handlers[type(request)](conn, request)
        except (StorageError, JournalError, OSError) as exc:
            self._error(conn, request, exc)
        except Exception as exc:  # a handler bug: answer EIO, keep serving (logged with trace)
            log.exception("processor.handler_failed", op=_op_of(request))
            self._error(conn, request, exc)

    def count_error(self, status: int) -> None:
        """Count one error response (not on the success path)."""
        self.errors[status] = self.errors.get(status, 0) + 1

    def long_poll_waiters(self) -> int:
        """Long-poll reads parked on this bookie (at scrape time: O(connections))."""
        return sum(len(waiters) for waiters in self._waiters.values())

    def _bad_frame(self, conn: ServerConnection, exc: ProtocolError) -> None:
        self.count_error(StatusCode.EBADREQ)
        if exc.request_id is None:
            log.warning("connection.bad_frame", peer=conn.peer, error=str(exc))
            conn.complete(None, None)
            conn.close()
            return
        op = exc.op if exc.op is not None else 0
        conn.complete(None, m.encode_error(op, exc.request_id, StatusCode.EBADREQ, str(exc)))

    def _add_error(self, conn: ServerConnection, rid: int, exc: BaseException) -> None:
        status = status_for(exc)
        self.count_error(status)
        conn.complete(rid, m.encode_error(_ADD_OP, rid, status, str(exc) or type(exc).__name__))

    def _error(self, conn: ServerConnection, request: Any, exc: BaseException) -> None:
        rid = request.request_id
        status = status_for(exc)
        self.count_error(status)
        conn.complete(rid, m.encode_error(_op_of(request), rid, status, str(exc) or type(exc).__name__))

    def connection_lost(self, conn: ServerConnection) -> None:
        for waiter in self._waiters.pop(conn, ()):
            waiter.cancel()

    # ------------------------------------------------------------------ writes
    def _add(self, conn: ServerConnection, req: m.AddEntryRequest) -> None:
        body = req.body
        if len(body) < _BODY_HEADER_BYTES:
            raise BadRequest(f"entry body of {len(body)} bytes is shorter than its header")
        ledger_id, entry_id, lac = _BODY_HEADER.unpack_from(body)
        if ledger_id != req.ledger_id or entry_id != req.entry_id:
            raise BadRequest(f"entry body does not carry ledger {req.ledger_id} entry {req.entry_id}")
        recovery = req.flags & _RECOVERY_ADD != 0
        if self.read_only and self.mode is not None:
            self.mode.check_add(recovery)
        reply = _AddReply(conn, req.request_id, ledger_id)
        self.storage.add_entry(ledger_id, entry_id, lac, req.master_key, body, recovery, reply)

    def _write_lac(self, conn: ServerConnection, req: m.WriteLacRequest) -> None:
        if self.read_only and self.mode is not None and req.ledger_id not in self.storage.ledgers:
            raise ReadOnly(f"bookie is read-only ({self.mode.reason}): no new ledgers")

        def done(error: BaseException | None) -> None:
            if error is not None:
                self._error(conn, req, error)
            else:
                conn.complete(
                    req.request_id, m.encode(m.WriteLacResponse(req.request_id, 0, None, req.ledger_id))
                )

        self.storage.write_lac(req.ledger_id, req.master_key, req.lac, b"", done)

    def _force(self, conn: ServerConnection, req: m.ForceLedgerRequest) -> None:
        state = self.storage.ledgers.get(req.ledger_id)
        if state is not None and state.master_key is not None and state.master_key != req.master_key:
            raise Unauthorized(f"ledger {req.ledger_id}: master key mismatch")

        def done(error: BaseException | None) -> None:
            if error is not None:
                self._error(conn, req, error)
            else:
                conn.complete(
                    req.request_id, m.encode(m.ForceLedgerResponse(req.request_id, 0, None, req.ledger_id))
                )

        self.storage.force(done)

    # ------------------------------------------------------------------ reads
    def _read_entry(self, conn: ServerConnection, req: m.ReadEntryRequest) -> None:
        if req.flags & ReadFlag.FENCE_LEDGER:
            if req.master_key is None:
                raise BadRequest("a fencing read must carry the master key")
            self.storage.fence(req.ledger_id, req.master_key, lambda e: self._after_fence(conn, req, e))
            return
        if req.flags & ReadFlag.LONG_POLL:
            self._long_poll(conn, req)
            return
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
        rid, lid = req.request_id, req.ledger_id
        try:
            state = self.storage.ledger(lid)
            if not piggyback:
                frame = m.encode(m.ReadEntryResponse(rid, 0, None, lid, req.entry_id, None, state.lac))
            else:
                entry_id, body = await self.storage.read_entry(lid, req.entry_id)
                frame = m.encode(m.ReadEntryResponse(rid, 0, None, lid, entry_id, body, state.lac))
                self.entries_read += 1
        except asyncio.CancelledError:
            raise
        except NoEntry as exc:
            self.count_error(StatusCode.ENOENTRY)
            lac = state.lac
            frame = m.encode(
                m.ReadEntryResponse(rid, StatusCode.ENOENTRY, str(exc), lid, req.entry_id, None, lac)
            )
        except Exception as exc:
            if not isinstance(exc, StorageError | OSError):
                log.exception("processor.read_failed", ledger_id=lid, entry_id=req.entry_id)
            status = status_for(exc)
            self.count_error(status)
            frame = m.encode_error(OpCode.READ_ENTRY, rid, status, str(exc) or type(exc).__name__)
        conn.complete(rid, frame)

    def _long_poll(self, conn: ServerConnection, req: m.ReadEntryRequest) -> None:
        state = self.storage.ledger(req.ledger_id)
        piggyback = bool(req.flags & ReadFlag.ENTRY_PIGGYBACK)
        if state.lac > req.previous_lac or state.fenced or req.timeout_ms == 0:
            self._answer_long_poll(conn, req, state, piggyback)
            return
        waiters = self._waiters.setdefault(conn, set())

        def woken(reason: WakeReason) -> None:
            waiters.discard(waiter)
            if not conn.closed:
                self._answer_long_poll(conn, req, state, piggyback and reason is not WakeReason.TIMEOUT)

        waiter: Waiter | None = state.add_waiter(req.previous_lac, req.timeout_ms / 1000.0, woken, self._loop)
        if waiter is None:
            raise TooManyRequests(f"ledger {req.ledger_id} has too many long-poll readers")
        waiters.add(waiter)

    def _answer_long_poll(
        self, conn: ServerConnection, req: m.ReadEntryRequest, state: LedgerState, piggyback: bool
    ) -> None:
        wanted = piggyback and req.entry_id in state.index
        conn.spawn(self._answer_read(conn, req, piggyback=wanted))

    def _read_lac(self, conn: ServerConnection, req: m.ReadLacRequest) -> None:
        state = self.storage.ledger(req.ledger_id)
        conn.complete(
            req.request_id, m.encode(m.ReadLacResponse(req.request_id, 0, None, req.ledger_id, state.lac))
        )

    def _batch_read(self, conn: ServerConnection, req: m.BatchReadRequest) -> None:
        if req.flags & ReadFlag.FENCE_LEDGER:
            if req.master_key is None:
                raise BadRequest("a fencing read must carry the master key")
            self.storage.fence(
                req.ledger_id,
                req.master_key,
                lambda e: self._error(conn, req, e) if e else self._spawn_batch(conn, req),
            )
            return
        self._spawn_batch(conn, req)

    def _spawn_batch(self, conn: ServerConnection, req: m.BatchReadRequest) -> None:
        if not conn.closed:
            conn.spawn(self._answer_batch(conn, req))

    async def _answer_batch(self, conn: ServerConnection, req: m.BatchReadRequest) -> None:
        rid, lid = req.request_id, req.ledger_id
        bytes_max = min(req.max_bytes, self.frame_bytes_max - RESPONSE_OVERHEAD_BYTES)
        try:
            state = self.storage.ledger(lid)
            bodies = await self.storage.read_range(lid, req.start_entry_id, req.max_count, bytes_max)
            frame = m.encode(m.BatchReadResponse(rid, 0, None, lid, req.start_entry_id, bodies, state.lac))
            self.entries_read += len(bodies)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, StorageError | OSError):
                log.exception("processor.read_failed", ledger_id=lid, entry_id=req.start_entry_id)
            status = status_for(exc)
            self.count_error(status)
            frame = m.encode_error(OpCode.BATCH_READ, rid, status, str(exc) or type(exc).__name__)
        conn.complete(rid, frame)

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

    def _bookie_info(self, conn: ServerConnection, req: m.GetBookieInfoRequest) -> None:
        stat = os.statvfs(self.storage.config.data_dir)
        info: dict[str, int | str] = {
            "free_disk_bytes": stat.f_bavail * stat.f_frsize,
            "total_disk_bytes": stat.f_blocks * stat.f_frsize,
            "ledgers": len(self.storage.ledgers),
            "state": "readonly" if self._is_read_only() else "writable",
            "journal_groups": self.storage.journal.groups_written,
            "journal_records": self.storage.journal.records_written,
        }
        if self.mode is not None and self.mode.reason is not None:
            info["read_only_reason"] = self.mode.reason[: m.TEXT_CHARS_MAX]
        conn.complete(req.request_id, m.encode(m.GetBookieInfoResponse(req.request_id, 0, None, info)))

    def _is_read_only(self) -> bool:
        return self.read_only or self.storage.journal.failed is not None

    def _list_entries(self, conn: ServerConnection, req: m.GetListOfEntriesRequest) -> None:
        state = self.storage.ledger(req.ledger_id)
        ranges: list[list[int]] = []
        for entry_id in state.index.entry_ids():
            if ranges and ranges[-1][1] == entry_id - 1:
                ranges[-1][1] = entry_id
            else:
                if len(ranges) >= m.RANGES_MAX:
                    raise TooManyRequests("ledger has more entry ranges than one response may carry")
                ranges.append([entry_id, entry_id])
        response = m.GetListOfEntriesResponse(req.request_id, 0, None, req.ledger_id, ranges)
        conn.complete(req.request_id, m.encode(response))


def _op_of(request: Any) -> int:
    return m.REQUEST_OP[type(request)]
