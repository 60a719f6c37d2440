"""One multiplexed TCP connection to one bookie: framing, request matching, timeouts, loss.

Rules (docs/internals.md §6 for the performance choices):

- ``asyncio.Protocol`` with a :class:`FrameDecoder` over a bytearray (3x faster than streams).
- Requests are matched to answers by request id in one dict; answers may come out of order. An
  answer whose id is unknown (the request timed out or was failed) is dropped: late responses never
  reach the caller.
- No Future per request: the caller registers ``callback(context, bookie_id, result)``; ``result``
  is the decoded response (any status) or a :class:`BKError` the connection produced (timeout, loss).
  Callbacks are never called re-entrantly from :meth:`request`; failures discovered there are
  delivered on the next loop iteration. An add may also register ``acks``
  (:data:`AcksCallback`): an ADD_ACKS answer's adds of one ``acks`` come in one call of it, one
  per ledger and answer rather than one per add. An add's write set is registered in one call
  (:meth:`BookieConnection.request_each`).
- Frames queued in one event-loop tick go out in one ``transport.write`` (coalescing is worth 2.4x).
- Every request has a deadline. Requests with the connection's standard timeout carry no
  per-request state for it: they are grouped by the write tick that sends them (one mark per
  group: the group's first request id, the end of its bytes in the connection's output, and the
  time it was *sent* plus the timeout) and expired by one periodic sweep from the head of the
  (insertion-ordered) dict; others (long polls) get their own timer. The sweep relies on grouped
  request ids increasing along the dict, so a request whose id is not above every id already sent
  on the connection also gets its own timer: ids come from the pool's counter but are not always
  used at once (a recovery read's speculative second replica; the first request of a connection
  whose hello took the next id).
- The client's own backlog is not the bookie's slowness. A group is sent once the kernel took its
  last byte: until then (bytes wait in the transport's buffer behind a burst of many ledgers' adds)
  its deadline does not run; the sweep starts it when it sees the bytes gone. A transport whose
  buffer does not drain at all for the standard timeout (a peer that stopped reading) fails the
  connection instead. And a sweep that runs late (the loop was held: the answers may sit unread in
  the socket, and uvloop runs timers before it polls sockets) expires only what was already due at
  the previous sweep, after which the loop polled the socket at least once.
- Responses are framed straight out of the receive buffer (no per-frame copy) and decoded by
  :func:`~bookkeeper_aio.protocol.messages.decode_answer`, which reduces a successful ADD answer,
  the hot path, to its request id.
- With an auth provider, HELLO and the first AUTH go out at connect and the connection stays
  CONNECTING (requests queue, nothing else is written) until the bookie says the handshake is
  complete; a refusal fails the connection with :class:`Unauthorized`. Without one, nothing
  changes: HELLO is pipelined ahead of the first requests.
- Losing the connection fails every pending request with :class:`BookieConnectionLost` whose
  ``__cause__`` is the trigger. ``close()`` is graceful (sends what is queued, unless the socket still
  holds bytes the bookie has not taken: then it aborts, as a partitioned bookie may never take
  them), ``abort()`` immediate; both fail pending requests.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import socket
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, cast

import structlog

from bookkeeper_aio.errors import (
    BKError,
    BKTimeout,
    BookieConnectionLost,
    ProtocolVersionMismatch,
    TooManyRequests,
    Unauthorized,
)
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import (
    FEATURE_ADD_ACKS,
    PROTOCOL_VERSION,
    OpCode,
    StatusCode,
)
from bookkeeper_aio.protocol.errors import FrameTooLarge, ProtocolError
from bookkeeper_aio.protocol.framing import LENGTH, LENGTH_BYTES

if TYPE_CHECKING:
    from bookkeeper_aio.client.auth import ClientAuthProvider

log = structlog.get_logger(__name__)

Result = m.Response | BKError
ResponseCallback = Callable[[Any, str, Result], None]
"""``callback(context, bookie_id, result)``: exactly one call per request. A successful ADD_ENTRY
is answered with the shared :data:`ADD_OK` (the ack was matched by request id; its ledger and
entry ids were validated, not repeated)."""

AcksCallback = Callable[[list[Any], str], None]
"""``acks(contexts, bookie_id)``: the EOK answers of several ADD_ENTRY requests at once, those of
one ADD_ACKS answer made with this same ``acks``, in the answer's order (one call per run of them,
not one per request). Each such request gets this instead of ``callback(context, bookie_id,
ADD_OK)``; anything else (a single ADD answer, a failure) still goes to its ``callback``."""

ADD_OK = m.AddEntryResponse(0, 0, None, 0, 0)
"""The result of every successful ADD_ENTRY (one object, not a tuple per ack)."""

SWEEP_INTERVAL_S_MIN = 0.01
"""Timeout sweeps run at most this often: a deadline fires within one sweep interval after it."""


class ConnectionState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    CLOSED = "closed"


# (callback, context, op of the request, acks callback or None)
_Pending = tuple[ResponseCallback, Any, int, AcksCallback | None]
_CONNECTING = ConnectionState.CONNECTING  # enum members as module names: a member lookup is slow
_CLOSED = ConnectionState.CLOSED  # on Python 3.11 (a thousand instructions)
_READY = ConnectionState.READY
_EOK = StatusCode.EOK
_OPEN_GROUP = float("inf")
_ADD = int(OpCode.ADD_ENTRY)
_ADD_ACKS = int(OpCode.ADD_ACKS)
_decode_answer = m.decode_answer
_RESPONSE_OP = m.RESPONSE_OP
_ADD_ACKS_RESPONSE = m.AddAcksResponse
_length_at = LENGTH.unpack_from


class BookieConnection(asyncio.Protocol):
    """A connection to ``bookie_id``. Created by :class:`~bookkeeper_aio.client.bookie_client.BookiePool`
    before the TCP connect finishes; requests made meanwhile are queued and sent on connect."""

    def __init__(
        self,
        bookie_id: str,
        *,
        standard_timeout_s: float,
        pending_max: int,
        frame_bytes_max: int,
        write_eager_bytes: int = 256 * 1024,
        write_eager_frames: int = 256,
        client_name: str = "bookkeeper-aio",
        loop: asyncio.AbstractEventLoop | None = None,
        on_close: Callable[[BookieConnection], None] | None = None,
        auth: ClientAuthProvider | None = None,
        next_request_id: Callable[[], int] | None = None,
    ) -> None:
        self.bookie_id = bookie_id
        self.state = _CONNECTING
        self._loop = loop or asyncio.get_running_loop()
        self._time = self._loop.time
        self._standard_timeout_s = standard_timeout_s
        self._sweep_interval_s = max(SWEEP_INTERVAL_S_MIN, standard_timeout_s / 20)
        self._pending_max = pending_max
        self._pending: dict[int, _Pending] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}  # requests with their own deadline
        # Standard-timeout requests: one [expires_at, first request id, end byte] per group (see
        # module doc); expires_at is infinite while the group is open (its tick is not flushed) or
        # not sent (its bytes wait in the transport's buffer: ``_unsent``).
        self._marks: collections.deque[list[float]] = collections.deque()
        self._group_open = False
        self._unsent = False
        self._bytes_written = 0  # handed to the transport since connect
        self._taken_seen = 0  # bytes the kernel had taken at the last look
        self._moved_at = 0.0  # when that last grew (or nothing waited)
        self._swept_at = -_OPEN_GROUP  # when the previous sweep ran
        self._rid_max = -1  # highest request id sent on this connection
        self._frame_bytes_max = frame_bytes_max
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._write_eager_bytes = write_eager_bytes
        self._write_eager_frames = write_eager_frames
        self._flush_scheduled = False
        self._sweep: asyncio.TimerHandle | None = None
        self._error: BKError | None = None
        self._closed = self._loop.create_future()
        self._client_name = client_name
        self._on_close = on_close
        self.ever_ready = False
        self.hello_answered = False  # the bookie answered HELLO (a TLS-only one hangs up on plaintext)
        self.peer_frame_bytes_max = frame_bytes_max
        self._add_acks = False  # the bookie agreed in HELLO to batch EOK add answers (ADD_ACKS)
        self._auth = auth
        self._next_request_id = next_request_id
        self._handshake_out: list[bytes] = []
        """HELLO and AUTH frames, written at connect ahead of everything (with an auth provider)."""

    # ------------------------------------------------------------------ public
    @property
    def is_usable(self) -> bool:
        return self.state is not _CLOSED

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def error(self) -> BKError | None:
        """Why the connection closed (None while usable or after a clean close)."""
        return self._error

    def start_hello(self, request_id: int) -> None:
        """Queue the HELLO handshake as the first frame (pipelined: requests need not wait for it)."""
        hello = m.HelloRequest(request_id, PROTOCOL_VERSION, self._client_name, FEATURE_ADD_ACKS)
        if self._auth is None:
            self.request(request_id, m.encode(hello), _on_hello, self, self._standard_timeout_s)
            return
        self._handshake_request(request_id, m.encode(hello), _on_hello)
        self._send_auth(self._auth.initial_payload())

    def _handshake_request(self, request_id: int, frame: bytes, callback: ResponseCallback) -> None:
        """A HELLO or AUTH request: its own deadline, written before any queued request."""
        self._rid_max = max(self._rid_max, request_id)
        self._pending[request_id] = (callback, self, frame[5], None)
        self._timers[request_id] = self._loop.call_at(
            self._time() + self._standard_timeout_s, self._expire_one, request_id
        )
        if self._transport is not None:
            self._transport.write(frame)
        else:
            self._handshake_out.append(frame)

    def _send_auth(self, payload: bytes) -> None:
        assert self._auth is not None
        assert self._next_request_id is not None
        request_id = self._next_request_id()
        frame = m.encode(m.AuthRequest(request_id, self._auth.name, payload))
        self._handshake_request(request_id, frame, _on_auth)

    def _authenticated(self) -> None:
        """The bookie accepted the AUTH handshake: send what queued meanwhile."""
        if self.state is not _CONNECTING or self._transport is None:
            return
        self.state = _READY
        self.ever_ready = True
        if self._out:
            self._flush()

    def request(
        self,
        request_id: int,
        frame: bytes,
        callback: ResponseCallback,
        context: Any,
        timeout_s: float,
        acks: AcksCallback | None = None,
    ) -> None:
        """Send ``frame`` (a whole encoded request whose id is ``request_id``, unique among the
        requests pending on this connection; normally higher than any earlier one); exactly one
        ``callback(context, bookie_id, result)`` follows, or for an ADD_ENTRY with ``acks``, its
        EOK answer may come in a call of ``acks`` instead (:data:`AcksCallback`)."""
        BookieConnection.request_each((self,), request_id, frame, callback, context, timeout_s, acks)

    @staticmethod
    def request_each(
        conns: Iterable[BookieConnection],
        request_id: int,
        frame: bytes,
        callback: ResponseCallback,
        context: Any,
        timeout_s: float,
        acks: AcksCallback | None = None,
    ) -> None:
        """:meth:`request` of the same request on each of ``conns``, in one call (an add's write
        set: one request id and one frame for all of them, one Python call per add, not per
        bookie)."""
        # Every request frame is [len:4][fixarray][op as a positive fixint]...: frame[5] is the op,
        # kept to check that the answer is for a request of that op.
        entry = (callback, context, frame[5], acks)
        size = len(frame)
        for conn in conns:
            if conn.state is _CLOSED:
                error = BookieConnectionLost(f"connection to {conn.bookie_id} is closed")
                error.__cause__ = conn._error
                conn._loop.call_soon(callback, context, conn.bookie_id, error)
                continue
            pending = conn._pending
            if len(pending) >= conn._pending_max:
                overload = TooManyRequests(f"{conn._pending_max} requests pending on {conn.bookie_id}")
                conn._loop.call_soon(callback, context, conn.bookie_id, overload)
                continue
            if request_id > conn._rid_max and timeout_s == conn._standard_timeout_s:
                conn._rid_max = request_id
                if not conn._group_open:
                    conn._group_open = True
                    conn._marks.append([_OPEN_GROUP, request_id, 0])
                    if conn._sweep is None:
                        conn._sweep = conn._loop.call_later(conn._sweep_interval_s, conn._sweep_expired)
            else:  # a long poll, or an id below one already sent: grouping would misorder the sweep
                if request_id > conn._rid_max:
                    conn._rid_max = request_id
                conn._timers[request_id] = conn._loop.call_at(
                    conn._time() + timeout_s, conn._expire_one, request_id
                )
            pending[request_id] = entry
            out = conn._out
            out.append(frame)
            conn._out_bytes += size
            if (
                conn._out_bytes >= conn._write_eager_bytes or len(out) >= conn._write_eager_frames
            ) and conn._transport is not None:
                conn._write_out()  # a large burst: the bookie starts on it while we build the rest
            elif not conn._flush_scheduled and conn._transport is not None:
                conn._flush_scheduled = True
                conn._loop.call_soon(conn._flush)

    def forget(self, request_id: int) -> None:
        """Drop a pending request without calling its callback (its answer will be ignored)."""
        self._pending.pop(request_id, None)
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        """Graceful: queued frames are written, then the connection closes (aborts if the bookie has
        not taken all it was sent: it may be unreachable); pending requests fail."""
        if self.state is _CLOSED:
            return
        self._flush()
        self._shutdown(None, abort=False)

    def abort(self) -> None:
        """Immediate: drop queued frames and close; pending requests fail."""
        self._shutdown(None, abort=True)

    def fail(self, cause: BaseException) -> None:
        """Close with an error (a connect failure, a protocol violation)."""
        self._shutdown(cause, abort=True)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        if self.state is _CLOSED:  # closed while connecting
            transport.abort()
            return
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._auth is not None:
            handshake, self._handshake_out = self._handshake_out, []
            transport.write(b"".join(handshake))
            return  # READY once the bookie completes the AUTH handshake (_on_auth)
        self.state = _READY
        self.ever_ready = True
        if self._out:
            self._flush()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pending = self._pending
        timers = self._timers
        bookie_id = self.bookie_id
        pos, size = 0, len(buf)
        try:
            with memoryview(buf) as view:
                while size - pos >= LENGTH_BYTES:
                    (length,) = _length_at(buf, pos)
                    if length > self._frame_bytes_max:
                        raise FrameTooLarge(length, self._frame_bytes_max)
                    start = pos + LENGTH_BYTES
                    end = start + length
                    if end > size:
                        break
                    pos = end
                    answer = _decode_answer(view[start:end])
                    response: m.Response
                    if type(answer) is int:  # the hot path: an EOK ADD_ENTRY answer, its request id
                        rid, response, op = answer, ADD_OK, _ADD
                    elif type(answer) is _ADD_ACKS_RESPONSE:
                        self._ack_adds(answer.request_ids)
                        continue
                    else:
                        response = cast(m.Response, answer)
                        rid, op = response.request_id, _RESPONSE_OP[type(response)]
                        if op == _ADD and response.status == 0:
                            response = ADD_OK  # e.g. an ack with fields beyond the known ones
                    entry = pending.pop(rid, None)
                    if entry is None:
                        continue  # late (timed out / failed / forgotten) or unknown: ignored
                    if entry[2] != op:
                        self._wrong_op(rid, entry, op)
                    if timers and (timer := timers.pop(rid, None)) is not None:
                        timer.cancel()
                    entry[0](entry[1], bookie_id, response)
        except ProtocolError as error:
            log.warning("bookie.protocol_error", bookie=bookie_id, error=str(error))
            self.fail(error)
            return
        finally:
            if pos and self._buf is buf:
                del buf[:pos]

    def _ack_adds(self, request_ids: list[int]) -> None:
        """Complete the ADD_ENTRY requests of one ADD_ACKS response (validated by the decoder):
        each run of requests made with the same ``acks`` in one call of it (a journal group's adds
        of one ledger, usually the whole answer), the others one callback each, in order."""
        if not self._add_acks:
            raise ProtocolError("ADD_ACKS without FEATURE_ADD_ACKS agreed in HELLO")
        pending, timers, bookie_id = self._pending, self._timers, self.bookie_id
        run: AcksCallback | None = None
        contexts: list[Any] = []
        try:
            for rid in request_ids:
                entry = pending.pop(rid, None)
                if entry is None:
                    continue
                if entry[2] != _ADD:
                    self._wrong_op(rid, entry, _ADD_ACKS)
                if timers and (timer := timers.pop(rid, None)) is not None:
                    timer.cancel()
                acks = entry[3]
                if acks is not run:
                    if contexts:  # the run before ends here
                        done, contexts = contexts, []
                        run(done, bookie_id)  # type: ignore[misc]
                    run = acks
                if acks is None:
                    entry[0](entry[1], bookie_id, ADD_OK)
                else:
                    contexts.append(entry[1])
        finally:  # popped requests get their answer even when a later id breaks the protocol
            if contexts:
                run(contexts, bookie_id)  # type: ignore[misc]

    def _wrong_op(self, request_id: int, entry: _Pending, op: int) -> NoReturn:
        """An answer of ``op`` to a request of another op: a protocol error. The request goes back
        to the pending ones, which the error fails (each gets its one callback)."""
        self._pending[request_id] = entry
        raise ProtocolError(f"an answer of op {op} to request {request_id} of op {entry[2]}")

    def connection_lost(self, exc: Exception | None) -> None:
        cause: BaseException = exc or ConnectionResetError(f"{self.bookie_id} closed the connection")
        self._shutdown(cause, abort=True)

    # ------------------------------------------------------------------ internals
    def _flush(self) -> None:
        self._flush_scheduled = False
        self._write_out()

    def _write_out(self) -> None:
        """Write the queued frames (at the end of a tick, or early once many bytes are queued)."""
        if self._out and self._transport is not None and self.state is _READY:
            out = self._out
            self._out = []
            self._bytes_written += self._out_bytes
            self._out_bytes = 0
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))
        if self._group_open:
            self._close_group()

    def _close_group(self) -> None:
        """Every request of the open group was made by now: if the kernel took all its bytes, its
        deadline is now + the timeout; else the sweep starts it once they are gone."""
        self._group_open = False
        mark = self._marks[-1]
        mark[2] = end = self._bytes_written + self._out_bytes
        if self._unsent:
            return
        taken = self._bytes_taken()
        if end <= taken:
            mark[0] = self._time() + self._standard_timeout_s
        else:  # bytes wait: from now on the kernel must take some within the standard timeout
            self._unsent = True
            self._taken_seen, self._moved_at = taken, self._time()

    def _bytes_taken(self) -> int:
        """Bytes of the output the kernel took (handed over, less what the transport still holds)."""
        transport = self._transport
        if transport is None:
            return 0
        return self._bytes_written - transport.get_write_buffer_size()

    def _start_sent_deadlines(self, now: float) -> None:
        """Start the deadline of every group whose bytes are gone by now; fail the connection if
        the kernel took nothing for the standard timeout while bytes waited (the peer stopped
        reading)."""
        taken = self._bytes_taken()
        if taken > self._taken_seen or taken == self._bytes_written:
            self._taken_seen, self._moved_at = taken, now
        elif now - self._moved_at > self._standard_timeout_s:
            waiting = self._bytes_written - taken
            self.fail(BKTimeout(f"{self.bookie_id} took none of the {waiting} bytes waiting for it in time"))
            return
        unsent: list[list[float]] = []
        for mark in reversed(self._marks):  # the groups not sent yet are the newest
            if mark[0] != _OPEN_GROUP:
                break
            unsent.append(mark)
        self._unsent = False
        deadline = now + self._standard_timeout_s
        for mark in reversed(unsent):
            if mark[2] > taken:
                self._unsent = True
                break
            mark[0] = deadline

    def _sweep_expired(self) -> None:
        self._sweep = None
        if self.state is _CLOSED:
            return
        if self._group_open:
            self._close_group()
        now = self._time()
        if self._unsent:
            self._start_sent_deadlines(now)
            if self.state is _CLOSED:
                return
        # On time: what is due now. Late (the loop was held, answers may wait unread in the
        # socket): only what was due at the previous sweep; the loop polled the socket since.
        due = now if now - self._swept_at <= 2 * self._sweep_interval_s else self._swept_at
        self._swept_at = now
        marks = self._marks
        if marks and marks[0][0] <= due:
            while marks and marks[0][0] <= due:
                marks.popleft()
            # Standard requests below the first live group's first id have expired.
            limit = marks[0][1] if marks else _OPEN_GROUP
            timers = self._timers
            expired: list[int] = []
            for request_id in self._pending:
                if request_id >= limit:
                    break
                if request_id not in timers:
                    expired.append(request_id)
            for request_id in expired:
                self._expire_one(request_id)
        if marks and self.state is not _CLOSED:
            self._sweep = self._loop.call_later(self._sweep_interval_s, self._sweep_expired)

    def _expire_one(self, request_id: int) -> None:
        self._timers.pop(request_id, None)
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        callback, context, _, _ = entry
        callback(context, self.bookie_id, BKTimeout(f"no answer from {self.bookie_id} in time"))

    def _shutdown(self, cause: BaseException | None, *, abort: bool) -> None:
        if self.state is _CLOSED:
            return
        self.state = _CLOSED
        if cause is not None:
            error = BookieConnectionLost(f"connection to {self.bookie_id} lost: {cause!r}")
            error.__cause__ = cause
            self._error = error
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        if self._on_close is not None:
            self._on_close(self)
        self._out.clear()
        self._handshake_out.clear()
        self._out_bytes = 0
        transport, self._transport = self._transport, None
        if transport is not None:
            if abort or transport.get_write_buffer_size():
                # A graceful close waits until the peer took every byte: one that does not (partitioned,
                # stopped) would keep the socket open until the kernel gives up, long after its
                # requests failed below. Abort it instead.
                transport.abort()
            else:
                transport.close()
        pending, self._pending = self._pending, {}
        timers, self._timers = self._timers, {}
        self._marks.clear()
        self._group_open = False
        self._unsent = False
        for timer in timers.values():
            timer.cancel()
        entries = list(pending.values())
        pending.clear()  # a data_received loop still holding the dict finds nothing to answer twice
        for callback, context, _, _ in entries:
            lost = BookieConnectionLost(f"connection to {self.bookie_id} closed with the request pending")
            lost.__cause__ = cause
            callback(context, self.bookie_id, lost)
        if not self._closed.done():
            self._closed.set_result(None)


def _on_hello(conn: BookieConnection, bookie_id: str, result: Result) -> None:
    if isinstance(result, BKError):
        return  # the connection's own failure path reports it to every request
    if result.status != _EOK or not isinstance(result, m.HelloResponse):
        conn.fail(ProtocolVersionMismatch(f"{bookie_id} refused hello: {result.status} {result.message}"))
        return
    if result.protocol_version != PROTOCOL_VERSION:
        conn.fail(ProtocolVersionMismatch(f"{bookie_id} speaks protocol {result.protocol_version}"))
        return
    conn.hello_answered = True
    conn.peer_frame_bytes_max = result.frame_bytes_max
    conn._add_acks = bool(result.features & FEATURE_ADD_ACKS)


def _on_auth(conn: BookieConnection, bookie_id: str, result: Result) -> None:
    if isinstance(result, BKError):
        return  # the connection's own failure path reports it to every request
    if result.status != _EOK or not isinstance(result, m.AuthResponse):
        log.warning("bookie.auth_refused", bookie=bookie_id, message=result.message)
        conn.fail(
            Unauthorized(
                f"{bookie_id} refused authentication: {result.message} (check the client's "
                "auth_provider and its token or credentials)"
            )
        )
        return
    if result.complete:
        conn._authenticated()
        return
    assert conn._auth is not None
    try:
        answer = conn._auth.answer(result.payload)
    except BKError as error:
        conn.fail(error)
        return
    conn._send_auth(answer)
