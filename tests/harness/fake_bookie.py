"""In-process fake bookies speaking the real wire protocol over real TCP (port 0), scriptable.

For client unit tests and scripted recovery interleavings: fast, deterministic enough, and able to
do what a real bookie process only does by accident — answer late, answer with any status, drop
answers, hold every answer (a SIGSTOP twin), die and come back, serve a corrupt replica.

    async with FakeCluster(4) as cluster:
        b0 = cluster.bookies[0]
        b0.script = lambda req: Reply.error(StatusCode.EIO) if isinstance(req, m.AddEntryRequest) else None
        b0.pause(); ...; b0.resume()        # answers held, then released in order
        await b0.kill(); await b0.restart()  # connections aborted; same port afterwards

Storage is a dict; the fenced bit, master key and LAC are kept per ledger like a real bookie
(recovery adds pass a fence; a wrong master key gets EUA). ``requests`` records every request.
``corrupt_reads`` serves chosen entries with a flipped byte (READ_ENTRY and BATCH_READ);
``unreadable_reads`` makes chosen entries fail the bookie's own record check, as the real bookie
answers then: EIO for a read of them, and a fencing read of entry -1 whose last entry is one of them
is EOK with no body and ``unreadable`` set (docs/protocol.md §7.2);
``batch_read_limit`` makes BATCH_READ answers short; ``batch_step = False`` makes it ignore a
BATCH_READ's ``step`` (consecutive entries, no echo), as a bookie older than the field does.
Long polls (LONG_POLL + ENTRY_PIGGYBACK) wait for the LAC like docs/protocol.md §7.3 says.

Scripted interleavings (recovery traces): ``Reply.hold(event)`` processes the request only once
``event`` is set (an add that reaches the bookie *late*, after a fence); ``Reply.drop()`` loses it
(a fence that never arrives).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any, cast

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import (
    BATCH_READ_COUNT_MAX,
    FEATURE_ADD_ACKS,
    FRAME_BYTES_MAX,
    LAST_ENTRY,
    NO_ENTRY,
    PROTOCOL_VERSION,
    AddFlag,
    OpCode,
    ReadFlag,
    StatusCode,
)
from bookkeeper_aio.protocol.digest import peek_header
from bookkeeper_aio.protocol.errors import ProtocolError
from bookkeeper_aio.protocol.framing import FrameDecoder

REQUESTS_RECORDED_MAX = 1_000_000


@dataclasses.dataclass(frozen=True)
class Reply:
    """What a script wants done with one request. ``None`` from a script means "normal"."""

    kind: str  # "normal" | "error" | "drop" | "delay" | "hold"
    status: StatusCode = StatusCode.EOK
    delay_s: float = 0.0
    event: asyncio.Event | None = None

    @staticmethod
    def error(status: StatusCode) -> Reply:
        return Reply("error", status=status)

    @staticmethod
    def drop() -> Reply:
        return Reply("drop")

    @staticmethod
    def delay(seconds: float) -> Reply:
        return Reply("delay", delay_s=seconds)

    @staticmethod
    def hold(event: asyncio.Event) -> Reply:
        """Process the request (not just answer it) only when ``event`` is set."""
        return Reply("hold", event=event)


Script = Callable[[m.Request], Reply | None]


@dataclasses.dataclass
class LedgerState:
    master_key: bytes | None = None
    fenced: bool = False
    lac: int = NO_ENTRY
    entries: dict[int, bytes] = dataclasses.field(default_factory=dict)
    waiters: list[_LongPoll] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _LongPoll:
    conn: _Conn
    request: m.ReadEntryRequest
    timer: asyncio.TimerHandle | None = None


class _Conn(asyncio.Protocol):
    def __init__(self, bookie: FakeBookie) -> None:
        self.bookie = bookie
        self.decoder = FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.add_acks = False  # FEATURE_ADD_ACKS agreed in HELLO
        self._acks: list[int] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self.transport = transport
        self.bookie._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.bookie._conns.discard(self)

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        while (body := self.decoder.next_frame()) is not None:
            try:
                request = m.decode_request(body)
            except ProtocolError as error:
                if error.request_id is not None and error.op is not None:
                    self.send(m.encode_error(error.op, error.request_id, StatusCode.EBADREQ, str(error)))
                    continue
                assert self.transport is not None
                self.transport.abort()
                return
            self.bookie._handle(self, request)

    def send(self, frame: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame)

    def queue_ack(self, request_id: int) -> None:
        """An EOK add answer, sent with the others of this tick in one ADD_ACKS response."""
        if not self._acks:
            asyncio.get_running_loop().call_soon(self._send_acks)
        self._acks.append(request_id)

    def _send_acks(self) -> None:
        acks, self._acks = self._acks, []
        self.bookie.add_acks_sent += 1
        self.bookie._answer(self, m.encode(m.AddAcksResponse(0, StatusCode.EOK, None, acks)))


class FakeBookie:
    def __init__(self, host: str = "127.0.0.1", add_acks: bool = False) -> None:
        self.host = host
        self.port = 0
        self.ledgers: dict[int, LedgerState] = {}
        self.script: Script | None = None
        self.requests: list[m.Request] = []
        self.corrupt_reads: set[tuple[int, int]] = set()
        self.unreadable_reads: set[tuple[int, int]] = set()
        self.add_acks = add_acks
        """Agree to FEATURE_ADD_ACKS when a client asks: EOK add answers of a tick go out as one
        ADD_ACKS response (as the real bookie does per journal group)."""
        self.add_acks_sent = 0
        self.batch_read_limit: int | None = None
        self.batch_step = True
        """When set, a BATCH_READ answer holds at most this many bodies (a short batch, as a bookie
        answers when it stops early: byte budget, unreadable entry)."""
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._paused = False
        self._held: list[tuple[_Conn, bytes]] = []
        self._timers: set[asyncio.TimerHandle] = set()
        self._holds: set[asyncio.Task[None]] = set()

    @property
    def id(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def kill(self) -> None:
        """Stop listening and abort every connection (like kill -9; the data survives here)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.abort()
        self._conns.clear()
        self._held.clear()
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        for task in self._holds:
            task.cancel()
        self._holds.clear()
        for state in self.ledgers.values():
            for poll in state.waiters:
                if poll.timer is not None:
                    poll.timer.cancel()
            state.waiters.clear()

    async def restart(self) -> None:
        await self.start()

    def pause(self) -> None:
        """Hold every answer (requests are still processed), like a SIGSTOPped process."""
        self._paused = True

    def resume(self) -> None:
        """Release held answers in order."""
        self._paused = False
        held, self._held = self._held, []
        for conn, frame in held:
            conn.send(frame)

    def entry(self, ledger_id: int, entry_id: int) -> bytes | None:
        state = self.ledgers.get(ledger_id)
        return None if state is None else state.entries.get(entry_id)

    # ------------------------------------------------------------------ request handling
    def _handle(self, conn: _Conn, request: m.Request) -> None:
        if self.requests is not None and len(self.requests) < REQUESTS_RECORDED_MAX:
            self.requests.append(request)
        reply = self.script(request) if self.script is not None else None
        if reply is not None and reply.kind == "drop":
            return
        if reply is not None and reply.kind == "error":
            op = m.REQUEST_OP[type(request)]
            self._answer(conn, m.encode_error(op, request.request_id, reply.status, "scripted"))
            return
        if reply is not None and reply.kind == "hold":
            assert reply.event is not None
            task = asyncio.get_running_loop().create_task(self._process_later(conn, request, reply.event))
            self._holds.add(task)
            task.add_done_callback(self._holds.discard)
            return
        if isinstance(request, m.ReadEntryRequest) and self._long_poll_waits(conn, request):
            return
        frame = self._process(request)
        if isinstance(request, m.HelloRequest):
            conn.add_acks = self.add_acks and bool(request.features & FEATURE_ADD_ACKS)
        elif (
            conn.add_acks
            and reply is None
            and isinstance(request, m.AddEntryRequest)
            and m.decode_response(frame[4:]).status == StatusCode.EOK
        ):
            conn.queue_ack(request.request_id)
            return
        if reply is not None and reply.kind == "delay":
            loop = asyncio.get_running_loop()
            timer: asyncio.TimerHandle

            def fire() -> None:
                self._timers.discard(timer)
                self._answer(conn, frame)

            timer = loop.call_later(reply.delay_s, fire)
            self._timers.add(timer)
            return
        self._answer(conn, frame)

    async def _process_later(self, conn: _Conn, request: m.Request, event: asyncio.Event) -> None:
        await event.wait()
        if isinstance(request, m.ReadEntryRequest) and self._long_poll_waits(conn, request):
            return
        self._answer(conn, self._process(request))

    # ------------------------------------------------------------------ long polls
    def _long_poll_waits(self, conn: _Conn, req: m.ReadEntryRequest) -> bool:
        """True when ``req`` is a long poll that must wait (it is then answered later)."""
        if not req.flags & ReadFlag.LONG_POLL or req.flags & ReadFlag.FENCE_LEDGER:
            return False
        state = self.ledgers.get(req.ledger_id)
        if state is None or state.lac > req.previous_lac or state.fenced or req.timeout_ms == 0:
            return False
        poll = _LongPoll(conn, req)
        poll.timer = asyncio.get_running_loop().call_later(
            req.timeout_ms / 1000, self._long_poll_expired, state, poll
        )
        state.waiters.append(poll)
        return True

    def _long_poll_expired(self, state: LedgerState, poll: _LongPoll) -> None:
        if poll in state.waiters:
            state.waiters.remove(poll)
            req = poll.request
            self._answer(
                poll.conn,
                m.encode(
                    m.ReadEntryResponse(
                        req.request_id, StatusCode.EOK, None, req.ledger_id, req.entry_id, None, state.lac
                    )
                ),
            )

    def _wake_long_polls(self, state: LedgerState) -> None:
        ready = [p for p in state.waiters if state.fenced or state.lac > p.request.previous_lac]
        for poll in ready:
            state.waiters.remove(poll)
            if poll.timer is not None:
                poll.timer.cancel()
            self._answer(poll.conn, self._long_poll_answer(poll.request, state))

    def _long_poll_answer(self, req: m.ReadEntryRequest, state: LedgerState) -> bytes:
        body = state.entries.get(req.entry_id) if req.flags & ReadFlag.ENTRY_PIGGYBACK else None
        if body is not None and (req.ledger_id, req.entry_id) in self.corrupt_reads:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        return m.encode(
            m.ReadEntryResponse(
                req.request_id, StatusCode.EOK, None, req.ledger_id, req.entry_id, body, state.lac
            )
        )

    def _answer(self, conn: _Conn, frame: bytes) -> None:
        if self._paused:
            self._held.append((conn, frame))
        else:
            conn.send(frame)

    def _process(self, req: m.Request) -> bytes:
        handler = _HANDLERS[m.REQUEST_OP[type(req)]]
        return handler(self, req)

    def _hello(self, req: Any) -> bytes:
        features = req.features & FEATURE_ADD_ACKS if self.add_acks else 0
        return m.encode(
            m.HelloResponse(
                req.request_id, StatusCode.EOK, None, PROTOCOL_VERSION, self.id, FRAME_BYTES_MAX, features
            )
        )

    def _ledger_for_write(self, ledger_id: int, key: bytes) -> LedgerState | StatusCode:
        state = self.ledgers.setdefault(ledger_id, LedgerState())
        if state.master_key is None:
            state.master_key = key
        elif state.master_key != key:
            return StatusCode.EUA
        return state

    def _read_key_refused(self, req: Any, state: LedgerState | None) -> bytes | None:
        """EUA for a read of a keyed ledger without its key (as the real bookie answers)."""
        if state is None or state.master_key is None or state.master_key == req.master_key:
            return None
        op = m.REQUEST_OP[type(req)]
        return m.encode_error(op, req.request_id, StatusCode.EUA, "master key mismatch")

    def _add(self, req: Any) -> bytes:
        state = self._ledger_for_write(req.ledger_id, req.master_key)
        if isinstance(state, StatusCode):
            return m.encode_error(OpCode.ADD_ENTRY, req.request_id, state, "bad master key")
        if state.fenced and not req.flags & AddFlag.RECOVERY_ADD:
            return m.encode_error(OpCode.ADD_ENTRY, req.request_id, StatusCode.EFENCED, "fenced")
        state.entries[req.entry_id] = req.body
        state.lac = max(state.lac, peek_header(req.body).lac)
        if state.waiters:
            self._wake_long_polls(state)
        return m.encode(m.AddEntryResponse(req.request_id, StatusCode.EOK, None, req.ledger_id, req.entry_id))

    def _read(self, req: Any) -> bytes:
        state = self.ledgers.get(req.ledger_id)
        if req.flags & ReadFlag.FENCE_LEDGER:
            if req.master_key is None:
                return m.encode_error(OpCode.READ_ENTRY, req.request_id, StatusCode.EBADREQ, "no key")
            got = self._ledger_for_write(req.ledger_id, req.master_key)
            if isinstance(got, StatusCode):
                return m.encode_error(OpCode.READ_ENTRY, req.request_id, got, "bad master key")
            state = got
            state.fenced = True
            if state.waiters:
                self._wake_long_polls(state)
        if state is None:
            return m.encode_error(OpCode.READ_ENTRY, req.request_id, StatusCode.ENOLEDGER, "no ledger")
        if (refused := self._read_key_refused(req, state)) is not None:
            return refused
        if req.flags & ReadFlag.LONG_POLL and not req.flags & ReadFlag.FENCE_LEDGER:
            return self._long_poll_answer(req, state)  # answered at once (LAC passed, fenced, timeout 0)
        entry_id = req.entry_id
        if entry_id == LAST_ENTRY:
            entry_id = max(state.entries, default=NO_ENTRY)
            if entry_id == NO_ENTRY:
                return m.encode(
                    m.ReadEntryResponse(
                        req.request_id, StatusCode.EOK, None, req.ledger_id, NO_ENTRY, None, state.lac
                    )
                )
        body = state.entries.get(entry_id)
        if body is None:
            return m.encode_error(OpCode.READ_ENTRY, req.request_id, StatusCode.ENOENTRY, "no entry")
        if (req.ledger_id, entry_id) in self.unreadable_reads:
            if req.entry_id == LAST_ENTRY and req.flags & ReadFlag.FENCE_LEDGER:
                return m.encode(
                    m.ReadEntryResponse(
                        req.request_id, StatusCode.EOK, None, req.ledger_id, entry_id, None, state.lac, True
                    )
                )
            return m.encode_error(OpCode.READ_ENTRY, req.request_id, StatusCode.EIO, "record corrupt")
        if (req.ledger_id, entry_id) in self.corrupt_reads:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        return m.encode(
            m.ReadEntryResponse(
                req.request_id, StatusCode.EOK, None, req.ledger_id, entry_id, body, state.lac
            )
        )

    def _read_lac(self, req: Any) -> bytes:
        state = self.ledgers.get(req.ledger_id)
        if state is None:
            return m.encode_error(OpCode.READ_LAC, req.request_id, StatusCode.ENOLEDGER, "no ledger")
        if (refused := self._read_key_refused(req, state)) is not None:
            return refused
        return m.encode(m.ReadLacResponse(req.request_id, StatusCode.EOK, None, req.ledger_id, state.lac))

    def _write_lac(self, req: Any) -> bytes:
        state = self._ledger_for_write(req.ledger_id, req.master_key)
        if isinstance(state, StatusCode):
            return m.encode_error(OpCode.WRITE_LAC, req.request_id, state, "bad master key")
        state.lac = max(state.lac, req.lac)
        if state.waiters:
            self._wake_long_polls(state)
        return m.encode(m.WriteLacResponse(req.request_id, StatusCode.EOK, None, req.ledger_id))

    def _force(self, req: Any) -> bytes:
        return m.encode(m.ForceLedgerResponse(req.request_id, StatusCode.EOK, None, req.ledger_id))

    def _batch_read(self, req: Any) -> bytes:
        state = self.ledgers.get(req.ledger_id)
        if req.flags & ReadFlag.FENCE_LEDGER:
            if req.master_key is None:
                return m.encode_error(OpCode.BATCH_READ, req.request_id, StatusCode.EBADREQ, "no key")
            got = self._ledger_for_write(req.ledger_id, req.master_key)
            if isinstance(got, StatusCode):
                return m.encode_error(OpCode.BATCH_READ, req.request_id, got, "bad master key")
            state = got
            state.fenced = True
            if state.waiters:
                self._wake_long_polls(state)
        if state is None:
            return m.encode_error(OpCode.BATCH_READ, req.request_id, StatusCode.ENOLEDGER, "no ledger")
        if (refused := self._read_key_refused(req, state)) is not None:
            return refused
        bodies: list[bytes] = []
        size = 0
        entry_id = req.start_entry_id
        step = req.step if self.batch_step else 1
        count_max = min(req.max_count, BATCH_READ_COUNT_MAX)
        if self.batch_read_limit is not None:
            count_max = min(count_max, self.batch_read_limit)
        while len(bodies) < count_max:
            body = state.entries.get(entry_id)
            if body is None or (bodies and size + len(body) > req.max_bytes):
                break
            if (req.ledger_id, entry_id) in self.unreadable_reads:
                if not bodies:
                    return m.encode_error(OpCode.BATCH_READ, req.request_id, StatusCode.EIO, "record corrupt")
                break
            if (req.ledger_id, entry_id) in self.corrupt_reads:
                body = body[:-1] + bytes([body[-1] ^ 0xFF])
            bodies.append(body)
            size += len(body)
            entry_id += step
        if not bodies:
            return m.encode_error(OpCode.BATCH_READ, req.request_id, StatusCode.ENOENTRY, "no entry")
        return m.encode(
            m.BatchReadResponse(
                req.request_id,
                StatusCode.EOK,
                None,
                req.ledger_id,
                req.start_entry_id,
                bodies,
                state.lac,
                step,
            )
        )

    def _info(self, req: Any) -> bytes:
        return m.encode(m.GetBookieInfoResponse(req.request_id, StatusCode.EOK, None, {"state": "writable"}))

    def _list_entries(self, req: Any) -> bytes:
        state = self.ledgers.get(req.ledger_id)
        if (refused := self._read_key_refused(req, state)) is not None:
            return refused
        ranges = [[e, e] for e in sorted(state.entries)] if state else []
        return m.encode(
            m.GetListOfEntriesResponse(req.request_id, StatusCode.EOK, None, req.ledger_id, ranges)
        )


_HANDLERS: dict[int, Callable[[FakeBookie, Any], bytes]] = {
    OpCode.HELLO: FakeBookie._hello,
    OpCode.ADD_ENTRY: FakeBookie._add,
    OpCode.READ_ENTRY: FakeBookie._read,
    OpCode.READ_LAC: FakeBookie._read_lac,
    OpCode.WRITE_LAC: FakeBookie._write_lac,
    OpCode.FORCE_LEDGER: FakeBookie._force,
    OpCode.BATCH_READ: FakeBookie._batch_read,
    OpCode.GET_BOOKIE_INFO: FakeBookie._info,
    OpCode.GET_LIST_OF_ENTRIES_OF_LEDGER: FakeBookie._list_entries,
}


class FakeCluster:
    """``n`` fake bookies, started on enter and killed on exit."""

    def __init__(self, n: int, *, add_acks: bool = False) -> None:
        self.bookies = [FakeBookie(add_acks=add_acks) for _ in range(n)]

    @property
    def ids(self) -> list[str]:
        return [b.id for b in self.bookies]

    def by_id(self, bookie_id: str) -> FakeBookie:
        return next(b for b in self.bookies if b.id == bookie_id)

    async def __aenter__(self) -> FakeCluster:
        for bookie in self.bookies:
            await bookie.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for bookie in self.bookies:
            await bookie.kill()
