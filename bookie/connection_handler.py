"""One client connection: framing over a bytearray, permits, deadlines, coalesced responses.

An ``asyncio.Protocol`` (3x cheaper than streams here, docs/internals.md §6). Rules:

- The length prefix is checked against ``frame_bytes_max`` before a byte of the frame is kept; a
  frame over it closes the connection (the stream cannot be resynchronised).
- A permit is taken before each request is decoded; at ``in_flight_max`` unanswered requests the
  connection stops reading (``pause_reading``) and leaves the rest of its buffer undecoded until
  answers free permits. The server pauses every connection when all of them together hold
  ``in_flight_total_max`` unanswered requests (:class:`ServerLoad`), or the journal backlog is high.
- A frame that has started must complete within ``frame_read_timeout_s`` of the last completed
  frame (a client dribbling one byte every few seconds is closed): one timer per connection,
  re-armed on progress, so the hot path pays nothing per frame.
- Responses are appended to a list and written once per event-loop tick (coalescing: 2.4x).
- Answers a client does not read are bounded: above ``answer_bytes_buffered_max`` queued in the
  transport (``pause_writing``) the connection stops being read, and reads wait before touching
  the disk; at most ``reads_in_flight_max`` reads of a connection hold an entry at once. So a client
  that asks for large entries and never reads the answers holds at most that buffer plus that many
  entries, not one entry per request.
- A connection with nothing in flight and nothing buffered for ``idle_timeout_s`` is closed (one
  timer per connection, re-armed every half timeout: nothing per request; each connection's first
  check is spread over that half, so connections made together are not closed — and their clients
  do not reconnect — all in one loop turn); one peer address holds
  at most ``connections_per_address_max`` connections, so it cannot lock others out.
- Answers honest clients do not get in numbers (EUA, EBADREQ, ETOOMANYREQUESTS: a wrong key, a
  bad request, a refused flood; ENOLEDGER at a tenth; a connection closed without a byte) are
  budgeted per peer address (:class:`ErrorBudget`): while the address is in deficit, each of its
  connections that errs again stops being read until the deficit is paid back, and one closed for
  its error gets its answer and close only then, so a client that only earns refusals gets
  ``bad_requests_per_address_per_s`` of them and no more of the bookie's time (reconnecting does not
  help); its connections that do not err, and other addresses, go on. Its new connections are read
  at once (a client behind the same NAT is not queued) but on probation: one request at a time and
  a first frame of at most :data:`PROBATION_FRAME_BYTES_MAX` until one is answered unrefused.
- Unread answers of all connections together are bounded too (:class:`AnswerBudget`), and so are
  parked long polls (per address and in all, apart from the request permits).
- Log lines about a connection's bad input are bounded in size, in number per connection, and in
  rate over all connections.
- Every connection goes away: one whose writes stay paused with its client reading none of its
  answers for ``frame_read_timeout_s`` is aborted, and so is one the bookie closed whose transport
  has not flushed (or whose TLS close is unanswered) ``frame_read_timeout_s`` after the close: a
  graceful close waits for the peer to read. Until then a closing connection keeps its slot and
  its answers stay counted; a full bookie aborts it first for a newcomer.
- One connection handles at most :data:`ANSWERS_PER_TURN_MAX` requests answered at once per loop
  turn (the rest of its buffer waits for the next turn), and before AUTH at most
  :data:`HELLOS_BEFORE_AUTH_MAX` HELLOs: a burst of small requests does not hold the loop.
- A bad request gets an error response when its request id can be read, else the connection closes.
  Nothing a peer sends can raise out of ``data_received``.
- The handshake (HELLO, AUTH) is handled here before the processor sees a frame. With auth
  providers configured, a frame over :data:`HANDSHAKE_FRAME_BYTES_MAX` before a successful AUTH
  closes the connection at its length prefix, any other request than HELLO or AUTH is answered EUA
  and the connection closes, and so does a refused AUTH or a connection not authenticated within
  ``auth_timeout_s``; an AUTH step runs as a task while the connection is not read. Without
  providers the first frame that is neither HELLO nor AUTH ends the handshake phase: from then on
  frames go straight to the processor (the hot path pays one attribute test per socket read).
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, cast

import structlog

from bookie.auth import AuthRefused, Challenge
from bookie.budgets import (
    BUDGETED_STATUSES,
    ERROR_BURST_S,
    LOG_LINES_BURST,
    LOG_LINES_PER_S,
    ErrorBudget,
    LogLines,
    Refusals,
    refused_frame_cost,
)
from bookie.tarpit import Tarpit
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import OpCode, StatusCode
from bookkeeper_aio.protocol.errors import ProtocolError

if TYPE_CHECKING:
    from bookie.auth import BookieAuthProvider
    from bookie.processor import Processor

log = structlog.get_logger(__name__)


_LENGTH = struct.Struct(">I")


class ServerLoad:
    """Requests unanswered across every connection. At ``limit`` the server stops reading every
    socket (``on_change(True)``) until half of them are answered (``on_change(False)``)."""

    __slots__ = ("in_flight", "limit", "on_change", "over", "sockets_paused")

    def __init__(self, limit: int, on_change: Callable[[bool], None] | None = None) -> None:
        self.in_flight = 0
        self.limit = limit
        self.over = False
        self.sockets_paused = False  # set by the server: new connections start paused too
        self.on_change = on_change

    def release(self, count: int) -> None:
        """``count`` requests answered (or dropped with their connection): resume every socket
        once half of the limit is free again."""
        self.in_flight -= count
        if self.over and self.in_flight <= self.limit // 2:
            self.check()

    def check(self) -> None:
        over = self.in_flight >= self.limit if not self.over else self.in_flight > self.limit // 2
        if over != self.over:
            self.over = over
            if self.on_change is not None:
                self.on_change(over)


ANSWER_BYTES_FREE = 1024 * 1024
"""Unread answer bytes a connection may hold while the bookie is over ``answer_bytes_total_max``
(:class:`AnswerBudget`): a client that reads its answers holds less than this between two of its
reads, and goes on."""


class AnswerBudget:
    """Answer bytes held for clients across the bookie: what each connection's transport holds
    unwritten (taken at each write to it, and when it pauses or resumes), plus the read answers a
    connection queued in this turn of the loop (counted as they are queued).

    At ``limit`` the bookie is *over*: every connection holding more than ``free`` is throttled
    (:meth:`ServerConnection.throttle_answers`: its transport's high-water mark is lowered to
    ``free``, so it stops being read and its reads wait before loading an entry until it has read
    its answers down to a quarter of that); connections that read their answers hold less than
    ``free`` and go on. It is under again at three quarters of ``limit``. A connection's count
    may be stale (its client read its answers since its last write): going over first takes every
    holder's count again (O(holders), only then). What the hot path pays: one
    ``get_write_buffer_size`` per write to a transport (a turn's answers of a connection, a
    journal group's acks), and a counter per read answer."""

    __slots__ = ("estimate", "free", "half", "held", "holders", "limit", "loading", "over", "throttles")

    def __init__(self, limit: int, free: int = ANSWER_BYTES_FREE) -> None:
        self.limit = limit
        self.free = min(free, limit)
        self.held = 0
        self.holders: set[ServerConnection] = set()
        """Connections whose count is not 0."""
        self.over = False
        self.half = False
        """Past half of ``limit`` (where reads load one at a time) since it was last under a quarter:
        every holder's count was taken again when it passed (:meth:`pass_half`)."""
        self.loading = 0
        """Reads loading an entry, all connections (their size is known once loaded)."""
        self.estimate = self.free
        """What a loading read is taken to hold: the largest recent answer (decaying by 1/8 per
        answer), 1 MiB at first."""
        self.throttles = 0
        """Connections throttled since start (the metric ``bookie_answer_throttles_total``)."""

    def pass_half(self) -> None:
        """``held`` passed half of ``limit``: take every holder's count again, once (stale counts of
        quiet connections whose clients read their answers since would make reads wait for
        nothing); again only after ``held`` has been under a quarter."""
        self.half = True  # first: a recount that raises a count does not come back here
        for conn in list(self.holders):
            conn.recount_answers()

    def go_over(self) -> None:
        """``held`` passed ``limit``: take every holder's count again (stale ones drop), and if
        still over, throttle every connection holding more than ``free``."""
        self.over = True  # first: a recount that raises a count does not come back here
        for conn in list(self.holders):
            conn.recount_answers()
        if self.held <= self.limit:
            self.over = False
            return
        log.warning("bookie.answer_bytes_over", held=self.held, limit=self.limit, holders=len(self.holders))
        for conn in list(self.holders):
            if conn.answers_held > self.free:
                conn.throttle_answers()


class ConnectionLimits:
    """Per-connection bounds (validated by :mod:`bookie.config`) and the server-wide load."""

    __slots__ = (
        "answer_bytes_buffered_max",
        "answers",
        "auth_providers",
        "auth_timeout_s",
        "connections_max",
        "connections_per_address_max",
        "errors",
        "frame_bytes_max",
        "frame_read_timeout_s",
        "idle_spread",
        "idle_timeout_s",
        "in_flight_max",
        "load",
        "log_lines",
        "long_polls",
        "long_polls_per_address",
        "per_address",
        "reads_in_flight_max",
        "refusals",
        "tarpit",
    )

    def __init__(
        self,
        frame_bytes_max: int,
        in_flight_max: int,
        frame_read_timeout_s: float,
        load: ServerLoad | None = None,
        *,
        answer_bytes_buffered_max: int = 8 * 1024 * 1024,
        answer_bytes_total_max: int = 1 << 62,
        reads_in_flight_max: int = 16,
        idle_timeout_s: float = 0.0,
        connections_per_address_max: int = 1 << 30,
        connections_max: int = 1 << 30,
        auth_providers: dict[str, BookieAuthProvider] | None = None,
        auth_timeout_s: float = 10.0,
        bad_requests_per_address_per_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.frame_bytes_max = frame_bytes_max
        self.in_flight_max = in_flight_max
        self.frame_read_timeout_s = frame_read_timeout_s
        self.load = load if load is not None else ServerLoad(1 << 62)
        self.answer_bytes_buffered_max = answer_bytes_buffered_max
        self.answers = AnswerBudget(answer_bytes_total_max)
        """Unread answer bytes of every connection together."""
        self.reads_in_flight_max = reads_in_flight_max
        self.idle_timeout_s = idle_timeout_s
        """0: never close an idle connection."""
        self.idle_spread = itertools.count()
        """Connections established so far: the n-th's first idle check comes after ``timeout / 2 *
        (1 + frac(n * golden ratio))``, evenly spread whatever the order, the same run after run."""
        self.connections_per_address_max = connections_per_address_max
        self.connections_max = connections_max
        self.per_address: Counter[str] = Counter()
        self.long_polls = 0
        """Long polls parked, all connections (at most :data:`LONG_POLLS_MAX`)."""
        self.long_polls_per_address: Counter[str] = Counter()
        self.auth_providers: dict[str, BookieAuthProvider] = dict(auth_providers or {})
        """By the name clients send in AUTH; empty: no authentication (AUTH is answered EOK)."""
        self.auth_timeout_s = auth_timeout_s
        """With providers: a connection not authenticated this soon after connecting is closed."""
        rate = bad_requests_per_address_per_s
        self.errors = ErrorBudget(rate, rate * ERROR_BURST_S, clock)
        """Refusals per peer address (rate 0: not budgeted)."""
        self.log_lines = LogLines(LOG_LINES_PER_S, LOG_LINES_BURST, clock)
        self.refusals = Refusals()
        self.tarpit = Tarpit()
        """Connections over ``connections_per_address_max``, held unread, then reset."""

    def admits(self, address: str) -> bool:
        """Whether ``address`` may have one more connection (``connections_per_address_max``);
        else the refusal is noted (:class:`Refusals`) and the caller closes the socket."""
        if self.per_address.get(address, 0) < self.connections_per_address_max:
            return True
        self.refusals.note("connections_per_address_max", self.connections_per_address_max, address)
        return False

    def refusal(self, address: str, registry: set[ServerConnection]) -> str | None:
        """Why a new connection of ``address`` is refused (noted in :class:`Refusals`): the limit's
        name (``connections_per_address_max``: held in the tarpit; ``connections_max``: every slot
        taken and none to free, reset at once), or None: admitted (a slot may have been freed
        for it by :meth:`make_room`)."""
        if not self.admits(address):
            return "connections_per_address_max"
        if len(registry) >= self.connections_max and not self.make_room(address, registry):
            self.refusals.note("connections_max", self.connections_max, address)
            return "connections_max"
        return None

    def make_room(self, address: str, registry: set[ServerConnection]) -> bool:
        """Every slot of ``connections_max`` is taken and ``address`` wants one: abort a connection
        the bookie is closing (its peer is not reading its last answers: it goes anyway), else
        close an idle or unauthenticated connection of the address holding the most, if it holds
        more than ``address`` would (so two addresses at the same count do not take turns evicting
        each other); False: none to close (the caller refuses). O(connections), only when full."""
        for conn in registry:
            if conn.closing:
                self.refusals.note("evicted_closing", self.connections_max, conn.peer)
                conn.abort()  # its slot is given back by connection_lost
                return True
        if not self.per_address:
            return False
        holder, count = max(self.per_address.items(), key=lambda item: item[1])
        if count <= self.per_address.get(address, 0) + 1:
            return False
        victim: ServerConnection | None = None
        victim_rank = 0.0
        for conn in registry:
            if conn.peer_address == holder:
                rank = conn.eviction_rank()
                if rank is not None and (victim is None or rank < victim_rank):
                    victim, victim_rank = conn, rank
        if victim is None:
            return False
        self.refusals.note("evicted_for_another_address", self.connections_max, victim.peer)
        victim.abort()  # its slot is given back by connection_lost
        return True


def tls_budget_key(address: str) -> str:
    """The refusal budget failed TLS handshakes of ``address`` are charged to: a new handshake
    waits only for that one (:meth:`ErrorBudget.turn`), not for the refusals its address's
    authenticated connections earn, so a client behind the NAT of a host flooding bad requests over
    TLS still connects at once; only failed handshakes make the next ones wait (they cannot be told
    apart before theirs is done)."""
    return "tls " + address


_GOLDEN = 0.6180339887498949

LOG_LINES_PER_CONNECTION = 5
"""Warnings about one connection's bad input; beyond, they are only counted (and said once)."""
LOG_DETAIL_CHARS_MAX = 200
PROBATION_FRAME_BYTES_MAX = 64 * 1024
"""The largest first frame of a connection made while its address is in refusal deficit (HELLO,
AUTH and small requests fit; a new connection of an address sending garbage frames of a MiB is
closed at the length prefix instead of read)."""
HANDSHAKE_FRAME_BYTES_MAX = 64 * 1024
"""The largest frame a connection may send before it authenticates, on a bookie that requires AUTH
(HELLO and AUTH, whose payload is at most 16 KiB, fit; a larger length prefix closes the connection
unread): 1,024 unauthenticated connections hold at most 64 MiB of partial frames, not 5 GiB."""
NO_LEDGER_COST = 0.1
"""An ENOLEDGER answer (a read, LAC read, long poll or entry list of a ledger this bookie does not
hold) is charged this fraction of a refusal: honest clients get them in numbers (recovery and
re-replication read ledgers from bookies that never got an entry, LAC reads go to the whole
ensemble), so 1,000/s per address before a flood of them is throttled."""
LONG_POLLS_PER_ADDRESS_MAX = 4096
"""Long polls parked at once by one peer address (a reader tailing that many ledgers); beyond,
ETOOMANYREQUESTS."""
LONG_POLLS_MAX = 16384
"""Long polls parked at once, all addresses together (a parked poll is a waiter, a timer and its
request: about a KiB)."""
AUTH_STEPS_MAX = 8
"""AUTH steps one connection may take (a multi-step mechanism needs 2 or 3)."""
HELLOS_BEFORE_AUTH_MAX = 2
"""HELLOs a connection may send before its AUTH when authentication is required (a client sends
one); another is refused (EBADREQ, charged) and the connection closed: unauthenticated, a HELLO
flood would be answered without end."""
ANSWERS_PER_TURN_MAX = 256
"""Answers one connection queues in one turn of the loop before its frames wait for the next turn
(:meth:`ServerConnection.complete`): a socket read of requests answered at once (GET_BOOKIE_INFO,
READ_LAC, HELLO: 20,000 in a 256 KiB read) does not hold the loop for the others."""


class ServerConnection(asyncio.Protocol):
    def __init__(
        self, processor: Processor, limits: ConnectionLimits, registry: set[ServerConnection]
    ) -> None:
        self._processor = processor
        self._limits = limits
        self._registry = registry
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.in_flight = 0
        self.request_ids: set[int] = set()
        self.add_acks = False
        """HELLO agreed on FEATURE_ADD_ACKS: a journal group's EOK adds are answered in ADD_ACKS."""
        self._paused_by_permits = False
        self._paused_by_server = False
        self._paused_by_errors = False
        self._close_at_turn: bytes | bool = False
        """It erred in a way that closes it while its address was in deficit: its answer (True: none)
        is sent, and it is closed, at its turn in the queue (:meth:`errors_paid`)."""
        self._frame_max = limits.frame_bytes_max
        self._in_flight_max = limits.in_flight_max
        """``in_flight_max``, or 1 while on probation (connected while its address was in deficit,
        and no request answered without a refusal yet)."""
        self._charges = 0
        """Refusals charged for this connection."""
        self._probation_charges = -1
        """On probation: ``_charges`` when it began (-1: not on probation)."""
        """``frame_bytes_max``, or less until its first frame is handled if it connected while its
        address was in deficit (:data:`PROBATION_FRAME_BYTES_MAX`)."""
        self._paused_by_keys = False
        self._held = False
        """Bytes arrived while reading was to be paused and were not processed (data_received)."""
        self.halted = False
        """Closed, or not to be read for now (its address's error budget is in deficit, or its
        address has too many requests waiting for key checks): the processor's frame loop stops at
        the next frame (one test, as for ``closed`` before)."""
        self._reading_paused = False
        self._deadline: asyncio.TimerHandle | None = None
        self._frames_since_arm = 0
        """Non-zero once a read completed a frame since the deadline was armed."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self.peer = "?"
        self._address: str | None = None
        self._paused_by_writes = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._out_counted: list[bytes] | None = None
        self._out_bytes = 0
        """Bytes of read answers queued in ``_out_counted`` (:meth:`take_read_slot`)."""
        self.answers_held = 0
        """Unread answer bytes charged to the bookie-wide :class:`AnswerBudget`."""
        self._loading = 0
        """Reads of this connection loading an entry (:meth:`take_read_slot`)."""
        self._loaded = asyncio.Event()
        self._load_waiters = False
        """A read waits on ``_loaded`` for this connection's loads to end (:meth:`take_read_slot`
        clears it first); :meth:`give_read_slot` sets it, only then, once none is loading."""
        self._answers_throttled = False
        """Over the budget, this connection's high-water mark is lowered (:meth:`throttle_answers`)."""
        self._reads = asyncio.Semaphore(limits.reads_in_flight_max)
        self._last_active = self._loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._log_budget = LOG_LINES_PER_CONNECTION
        self._handshake = True
        """HELLO and AUTH frames are handled by :meth:`_handshake_frames` until this is False."""
        self._auth_busy = False
        self._auth_steps = 0
        self._auth_session: dict[str, Any] = {}
        self._auth_timer: asyncio.TimerHandle | None = None
        self.principal: str | None = None
        """Who authenticated on this connection (None: no authentication)."""
        self.refused_full = False
        self._spoke = False
        """Bytes came from the peer (else its close is charged like a refusal)."""
        self.long_polls = 0
        """Long polls of this connection parked (not counted in ``in_flight``)."""
        self._hellos = 0
        self._turn_full = False
        """It queued :data:`ANSWERS_PER_TURN_MAX` answers in this turn: its frames wait for the next."""
        self._aborted = False
        self._drain_timer: asyncio.TimerHandle | None = None
        """Armed by :meth:`close`: a transport that has not flushed its answers by then is aborted."""
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stall_size = 0
        """Bytes its transport held when its writes paused (or at the last check): a check that finds
        no fewer aborts it (:meth:`_on_write_stall`)."""
        """Refused at accept because every slot of ``connections_max`` is taken (reset at once)."""

    @property
    def processor(self) -> Processor:
        return self._processor

    @property
    def peer_address(self) -> str:
        """The peer's address (no port): what per-address limits count ("" before it is known)."""
        return self._address or ""

    # ------------------------------------------------------------------ asyncio.Protocol
    def reserve(self, peername: Any, admitted: bool = False) -> bool:
        """Count this connection (per peer address, and towards ``connections_max`` through the
        registry) from the moment it is accepted; False: the address holds its maximum already
        (the caller closes the socket). A TLS server calls this before the handshake
        (:meth:`bookie.server.BookieServer`), so sockets in their handshake are bounded like
        the others (having checked :meth:`ConnectionLimits.refusal` itself: ``admitted``); a
        plaintext one from :meth:`connection_made`."""
        self.peer = str(peername)
        limits = self._limits
        address = _address_of(peername, self.peer)
        refused = None if admitted else limits.refusal(address, self._registry)
        if refused is not None:
            self.closed = self.halted = True
            self.refused_full = refused == "connections_max"
            return False
        self._address = address
        limits.per_address[address] += 1
        self._registry.add(self)
        return True

    def handshake_failed(self, error: BaseException) -> None:
        """The TLS handshake of a reserved connection failed, timed out or was cut: logged, charged
        to its address's error budget like a refusal, and the reservation given back."""
        if self.closed:
            return
        if not isinstance(error, asyncio.CancelledError) and self._address is not None:
            self.warn("connection.tls_failed", error=f"{type(error).__name__}: {error}")
            self._limits.errors.charge(tls_budget_key(self._address))
        self._spoke = True  # charged (to its handshakes' budget) already
        self.connection_lost(None)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        if self._address is None and not self.reserve(peername := stream.get_extra_info("peername")):
            stream.pause_reading()  # held unread in the tarpit, so a reconnect loop runs at its pace
            if self.refused_full or not self._limits.tarpit.hold(
                _address_of(peername, self.peer), stream.abort
            ):
                stream.abort()
            return
        sock = stream.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._established(stream)

    def _established(self, transport: asyncio.Transport) -> None:
        """The connection is ready for requests (after its TLS handshake, if any)."""
        if self.closed:  # the server closed it during its handshake
            transport.abort()
            return
        self._transport = transport
        limits = self._limits
        transport.set_write_buffer_limits(high=limits.answer_bytes_buffered_max)
        if limits.load.sockets_paused:
            self.pause_by_server(True)
        if limits.idle_timeout_s > 0:
            spread = (next(limits.idle_spread) * _GOLDEN) % 1.0
            self._idle_timer = self._loop.call_later(
                limits.idle_timeout_s / 2 * (1 + spread), self._on_idle_check
            )
        if limits.auth_providers:
            self._auth_timer = self._loop.call_later(limits.auth_timeout_s, self._on_auth_timeout)
        if limits.errors.deficit_s(self.peer_address) > 0:
            # Its address earns refusals, but this connection did not (a client behind the same
            # NAT): it is read at once. Its first frame may not be large (a reconnect loop of large
            # bad frames would make the bookie read each before refusing it): over
            # PROBATION_FRAME_BYTES_MAX the connection is closed at the length prefix, and charged.
            # Nor may it pipeline: one request at a time until one is answered without a refusal
            # (else an attacker's reconnect would get a window of refusals past the queue).
            self._frame_max = min(PROBATION_FRAME_BYTES_MAX, limits.frame_bytes_max)
            self._in_flight_max = 1
            self._probation_charges = self._charges

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.halted = True
        if self._address is None:
            return  # refused in connection_made
        self._registry.discard(self)
        errors = self._limits.errors
        if self._paused_by_errors:  # it left while it waited its turn after erring: charged once
            errors.unwait(self._address, self)  # more (hanging up is no way out of the queue)
            errors.charge(self._address)
        elif not self._spoke:  # connected (TLS handshake and all) and closed without a byte: a
            errors.charge(self._address)  # connect-and-close loop costs the bookie, so it is charged
        if self.in_flight:  # requests whose answers are dropped with it (a read cancelled, a long
            self._limits.load.release(self.in_flight)  # poll, a fence) give their permits back here
            self.in_flight = 0
        if self.long_polls:  # cancelled with it (Processor.connection_lost)
            self._unpark(self.long_polls)
        per_address = self._limits.per_address
        per_address[self._address] -= 1
        if per_address[self._address] <= 0:
            del per_address[self._address]
            errors.release(self._address)
        self._address = None
        if self.answers_held:
            self._charge_answers(-self.answers_held)
        self._writable.set()  # wake reads waiting to answer: they see the connection closed
        for timer in (
            self._deadline,
            self._idle_timer,
            self._auth_timer,
            self._drain_timer,
            self._stall_timer,
        ):
            if timer is not None:
                timer.cancel()
        self._deadline = self._idle_timer = self._auth_timer = self._drain_timer = self._stall_timer = None
        self._transport = None  # gone: nothing it held is counted any more (recount_answers)
        for task in list(self._tasks):
            task.cancel()
        self._processor.connection_lost(self)
        self._buf = bytearray()
        self._out = []

    def data_received(self, data: bytes) -> None:
        self._last_active = self._loop.time()
        self._spoke = True
        if not self._buf and not self._reading_paused and not self._handshake:
            self._process_buffer(data)  # nothing buffered (most reads): no copy of the read
            return
        self._buf += data
        if self._reading_paused:  # uvloop starts reading after connection_made, whatever it asked
            if self._transport is not None:
                self._transport.pause_reading()
            self._held = True
            self._update_deadline()
            return  # processed once reading resumes (_update_reading)
        self._process_buffer()

    def pause_writing(self) -> None:
        """The transport holds over ``answer_bytes_buffered_max`` of answers the peer has not read:
        read no more requests, and let reads wait before they load an entry."""
        self._paused_by_writes = True
        self._writable.clear()
        self._update_reading()
        self.recount_answers()
        if self._stall_timer is None and self._transport is not None and not self.closed:
            self._stall_size = self._transport.get_write_buffer_size()
            self._stall_timer = self._loop.call_later(self._limits.frame_read_timeout_s, self._on_write_stall)

    def resume_writing(self) -> None:
        self._paused_by_writes = False
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self._answers_throttled and self._transport is not None and not self.closed:
            self._answers_throttled = False  # read down to a quarter of ``free``: back to its own limit
            self._transport.set_write_buffer_limits(high=self._limits.answer_bytes_buffered_max)
        self._writable.set()
        self._update_reading()
        self.recount_answers()
        if self._buf and not self.closed:
            self._loop.call_soon(self._process_buffer)

    def _on_write_stall(self) -> None:
        """Its writes have been paused ``frame_read_timeout_s``: if its client read nothing of its
        answers since the last check (a peer that stopped reading, or that only acknowledges
        zero-window probes), the connection is aborted (closing it would wait for those answers to
        be read, holding its slot and memory for good); else checked again as long after."""
        self._stall_timer = None
        transport = self._transport
        if transport is None or not self._paused_by_writes or self._aborted:
            return
        size = transport.get_write_buffer_size()
        if size < self._stall_size:
            self._stall_size = size
            self._stall_timer = self._loop.call_later(self._limits.frame_read_timeout_s, self._on_write_stall)
            return
        self.warn("connection.write_stalled", unread_bytes=size, timeout_s=self._limits.frame_read_timeout_s)
        self.abort()

    async def take_read_slot(self) -> None:
        """Taken by a read before it loads its entry, given back (:meth:`give_read_slot`) once its
        answer is queued: waits while the peer is not reading its answers, at most
        ``reads_in_flight_max`` at once (in the order they asked).

        Answers are queued for the end of the loop's turn (:meth:`send`), and a read of an entry
        in the page cache does not yield: many reads could each take a slot, load, queue and give
        the slot back within one turn, before the transport sees any byte of them and can say it
        is over its limit (``pause_writing``). Measured: 2 connections x 1,024 unread reads of a
        1 MiB entry queued a GiB on one of them. So once the answers queued in this turn pass
        ``answer_bytes_buffered_max``, they go to the transport at once, which pauses the next read.

        Bookie-wide (:class:`AnswerBudget`): each answer is counted as it is queued, and once the
        answers held pass half the budget a connection's reads load their entries one at a time,
        so the entries loading when the budget is reached are at most one per connection (16 each
        before: 24 connections went 60 MiB over a 32 MiB budget).

        A plain pair of calls, not a context manager: one per read, and the generator-based one
        cost more than the rest of a cached read's answer."""
        await self._reads.acquire()
        try:
            if not self._writable.is_set():
                await self._writable.wait()
            budget = self._limits.answers
            while (
                self._loading
                and budget.held + budget.loading * budget.estimate > budget.limit // 2
                and not self.closed
            ):
                # past half the budget: this connection loads one at a time (set again, waking
                # every read waiting here, once none of its reads is loading: give_read_slot)
                self._loaded.clear()
                self._load_waiters = True
                await self._loaded.wait()
                await self._writable.wait()
        except BaseException:  # cancelled while waiting: the slot goes to the next read
            self._reads.release()
            raise
        self._loading += 1
        budget.loading += 1

    def give_read_slot(self, answered: bool) -> None:
        """Give back the slot of :meth:`take_read_slot`; ``answered``: the read queued its answer
        (the last frame queued), which is counted now (False: it failed or was cancelled)."""
        try:
            self._loading -= 1
            budget = self._limits.answers
            budget.loading -= 1
            if not self._loading and self._load_waiters:
                self._load_waiters = False
                self._loaded.set()
            out = self._out
            if answered and out:
                if out is not self._out_counted:  # flushed since: a new turn's list
                    self._out_counted = out
                    self._out_bytes = 0
                size = len(out[-1])
                budget.estimate = max(size, budget.estimate - (budget.estimate >> 3))
                self._out_bytes += size
                self._charge_answers(size)  # counted at once: cached reads queue many in one turn
                if self._out_bytes > self._limits.answer_bytes_buffered_max:
                    self._flush()
        finally:
            self._reads.release()

    def recount_answers(self) -> None:
        """Take this connection's count again from its transport (and the answers of this turn
        not written yet)."""
        transport = self._transport
        size = 0
        if transport is not None:  # closing too: what it holds is held until connection_lost
            size = transport.get_write_buffer_size()
            if self._out and self._out is self._out_counted and not self.closed:
                size += self._out_bytes
        if size != self.answers_held:
            self._charge_answers(size - self.answers_held)

    def _charge_answers(self, delta: int) -> None:
        """Change this connection's count in the :class:`AnswerBudget` by ``delta`` bytes; over
        the budget, a connection holding more than its free share is throttled."""
        budget = self._limits.answers
        before = self.answers_held
        held = self.answers_held = before + delta
        budget.held += delta
        if held > 0:
            if before <= 0:
                budget.holders.add(self)
        else:
            budget.holders.discard(self)
        if delta > 0:
            if budget.held > budget.limit >> 1 and not budget.half:
                budget.pass_half()
            if budget.held > budget.limit:
                if not budget.over:
                    budget.go_over()  # may recount and throttle this connection too
                if budget.over and self.answers_held > budget.free and not self._answers_throttled:
                    self.throttle_answers()
        elif budget.half:
            if budget.over and budget.held <= budget.limit - budget.limit // 4:
                budget.over = False
                log.info("bookie.answer_bytes_under", held=budget.held, limit=budget.limit)
            if budget.held <= budget.limit >> 2:
                budget.half = False

    def throttle_answers(self) -> None:
        """The bookie is over its answer budget and this connection holds more than its free share:
        its answers go to the transport and its high-water mark is lowered to that share, so (the
        transport calling :meth:`pause_writing`) it stops being read and its reads wait until its
        client has read them (:meth:`resume_writing` gives it its own limit back)."""
        transport = self._transport
        if transport is None or self.closed or self._answers_throttled:
            return
        free = self._limits.answers.free
        if self._out:
            self._flush()  # may throttle it already (its count rises once written)
            if cast(bool, self._answers_throttled) or self.closed:  # set by the flush
                return
        if transport.get_write_buffer_size() <= free:
            self.recount_answers()  # its client reads them: not one of those holding the most
            return
        self._answers_throttled = True
        self._limits.answers.throttles += 1
        transport.set_write_buffer_limits(high=free, low=free // 4)  # pauses it (pause_writing)

    def long_poll_refusal(self) -> str | None:
        """Why one more long poll of this connection may not park (None: it may)."""
        limits = self._limits
        if limits.long_polls >= LONG_POLLS_MAX:
            return f"this bookie holds {LONG_POLLS_MAX} long polls: retry later"
        if limits.long_polls_per_address[self.peer_address] >= LONG_POLLS_PER_ADDRESS_MAX:
            return f"this address holds {LONG_POLLS_PER_ADDRESS_MAX} long polls: retry later"
        return None

    def long_poll_parked(self) -> None:
        """A long poll parks: counted apart (per address and in all), and its request permit is
        given back, so parked polls never hold the bookie-wide count (64 ledgers x 1,024 polls of
        one tenant paused every socket for 60 s)."""
        self.long_polls += 1
        limits = self._limits
        limits.long_polls += 1
        limits.long_polls_per_address[self.peer_address] += 1
        self._release(1)

    def long_poll_woken(self) -> None:
        """A parked long poll is to be answered: it takes a permit again (its answer gives it back)."""
        self._unpark(1)
        self.in_flight += 1
        self._limits.load.in_flight += 1

    def _unpark(self, count: int) -> None:
        self.long_polls -= count
        limits = self._limits
        limits.long_polls -= count
        address = self.peer_address
        left = limits.long_polls_per_address[address] - count
        if left > 0:
            limits.long_polls_per_address[address] = left
        else:
            del limits.long_polls_per_address[address]

    def eviction_rank(self) -> float | None:
        """None: this connection is not to be closed for a newcomer (:meth:`ConnectionLimits.make_room`);
        else the lower, the sooner: unauthenticated ones first, then the one idle the longest.
        Closing ones are not ranked: :meth:`ConnectionLimits.make_room` aborts them first."""
        if self._transport is None or self.closed:
            return None
        if self._handshake and self._limits.auth_providers:
            return self._last_active - 1e12
        if self.in_flight or self.long_polls or self._buf or self._out or self.answers_held:
            return None
        return self._last_active

    @property
    def closing(self) -> bool:
        """Closed by the bookie, its transport flushing its last answers (:meth:`close`): it holds
        its slot until they are read or its drain deadline aborts it."""
        return self.closed and not self._aborted and self._transport is not None

    def _on_idle_check(self) -> None:
        self._idle_timer = None
        if self.closed:
            return
        self.recount_answers()  # a quiet connection's count is taken at its writes only
        timeout = self._limits.idle_timeout_s
        idle_s = self._loop.time() - self._last_active
        if (
            self.in_flight == 0
            and not self.long_polls
            and not self._buf
            and not self._out
            and idle_s >= timeout
        ):
            log.info("connection.idle_closed", peer=self.peer, idle_s=round(idle_s, 1))
            self.close()
            return
        self._idle_timer = self._loop.call_later(timeout / 2, self._on_idle_check)

    def charge_error(self, status: int, cost: float = 1.0) -> None:
        """An answer of ``status`` was sent: a budgeted one (:data:`BUDGETED_STATUSES`) is charged
        (``cost`` refusals) to this peer address; in deficit, this connection stops being read
        until it is paid."""
        if status not in BUDGETED_STATUSES:
            if status != StatusCode.ENOLEDGER:
                return
            cost *= NO_LEDGER_COST
        if self._address is None:
            return
        self._charges += 1
        wait_s = self._limits.errors.charge(self._address, cost)
        if wait_s > 0 and not self._paused_by_errors:
            self._throttle()

    def _throttle(self) -> None:
        """Stop reading until the address's deficit is paid and this connection's turn comes
        (:meth:`ErrorBudget.wait`)."""
        assert self._address is not None
        self._paused_by_errors = self.halted = True
        self._update_reading()
        self._limits.errors.wait(self._address, self)

    def errors_paid(self) -> None:
        """This connection's turn to be read again (:meth:`ErrorBudget.wait`), or, if it erred in a
        way that closes it, to get its answer and be closed (:meth:`close_erred`)."""
        if self.closed:
            return
        if self._close_at_turn:
            self._paused_by_errors = False
            answer, self._close_at_turn = self._close_at_turn, False
            if answer is not True:
                self.send(answer)
            self.close()
            return
        self._paused_by_errors = False
        self.halted = self._paused_by_keys or self._turn_full
        self._update_reading()
        if self._buf:
            self._loop.call_soon(self._process_buffer)

    def pause_by_keys(self, paused: bool) -> None:
        """Stop (or resume) reading: this peer address has too many requests waiting for key
        checks against metadata (:mod:`bookie.ledger_keys`), which is backpressure, not a refusal."""
        if self.closed:
            return
        self._paused_by_keys = paused
        self.halted = paused or self._paused_by_errors or self._turn_full
        self._update_reading()
        if not paused and not self.halted and self._buf:
            self._loop.call_soon(self._process_buffer)

    def warn(self, event: str, **fields: Any) -> None:
        """A warning about this connection's input: details cut to ``LOG_DETAIL_CHARS_MAX``, at most
        ``LOG_LINES_PER_CONNECTION`` per connection (one more line says the rest are dropped), and
        at most :data:`LOG_LINES_PER_S` over all connections (a flood of connections, each with its
        one bad request, is not a flood of lines: the next line says how many were dropped)."""
        if self._log_budget <= 0:
            return
        self._log_budget -= 1
        dropped = self._limits.log_lines.take()
        if dropped is None:
            return
        bounded = {k: (v[:LOG_DETAIL_CHARS_MAX] if isinstance(v, str) else v) for k, v in fields.items()}
        if self._log_budget == 0:
            bounded["more"] = "further warnings about this connection are not logged"
        if dropped:
            bounded["dropped"] = dropped
        log.warning(event, peer=self.peer, **bounded)

    def eof_received(self) -> bool | None:
        return False  # close our side too

    # ------------------------------------------------------------------ framing
    def _process_buffer(self, data: bytes | None = None) -> None:
        """Handle the buffered frames, or those of ``data``, a read that came with nothing buffered
        (then only what is left of it after the frames handled is buffered)."""
        if self._handshake and not self._handshake_frames():
            self._update_deadline()
            return
        buf: bytes | bytearray = self._buf if data is None else data
        size_total = len(buf)
        limit = self._in_flight_max
        frame_max = self._frame_max
        load = self._limits.load
        # All the complete frames of this read in one loop (Processor.dispatch_frames). The views it
        # decodes are dropped before the buffer is compacted (msgpack copies what it keeps): no copy
        # of the frame on the hot path.
        with memoryview(buf) as view:
            pos = self._processor.dispatch_frames(self, buf, view, 0, limit, frame_max, load)
            if data is not None and pos < size_total:
                self._buf += view[pos:]  # (still empty: a read is not re-entered)
        if size_total - pos >= 4 and not self.halted and self.in_flight < limit:
            (size,) = _LENGTH.unpack_from(buf, pos)
            if size > frame_max:
                self.warn("connection.frame_too_large", size=size, limit=frame_max)
                self._processor.count_error(StatusCode.EBADREQ, self)
                self.close_erred(None)
                return
        if pos:
            self._frames_since_arm += 1  # progress (read as a flag by the deadline)
            if data is None:
                del self._buf[:pos]
            if frame_max != self._limits.frame_bytes_max:  # a frame handled: out of probation
                self._frame_max = self._limits.frame_bytes_max
        if self.closed:
            return
        if load.in_flight >= load.limit and not load.over:
            load.check()
        if self.in_flight >= limit and not self._paused_by_permits:
            self._paused_by_permits = True
            self._update_reading()
        if self._buf or self._deadline is not None:  # every frame handled and no timer (most reads): no call
            self._update_deadline()

    def _update_deadline(self) -> None:
        if self._buf and self._deadline is None and not self._paused_by_permits:
            self._frames_since_arm = 0
            self._deadline = self._loop.call_later(self._limits.frame_read_timeout_s, self._on_deadline)
        elif not self._buf and self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.closed or not self._buf:
            return
        if (
            self._frames_since_arm
            or self._auth_busy
            or self._paused_by_permits
            or self._paused_by_server
            or self._paused_by_writes
            or self._paused_by_errors
            or self._paused_by_keys
        ):
            self._update_deadline()  # progress was made, or we are the slow side: re-arm
            return
        self.warn("connection.frame_read_timeout", buffered=len(self._buf))
        self.close()

    # ------------------------------------------------------------------ handshake
    def _handshake_frames(self) -> bool:
        """Handle the HELLO and AUTH frames at the head of the buffer; True once the handshake
        phase is over and the rest of the buffer is the processor's."""
        buf = self._buf
        required = bool(self._limits.auth_providers)
        # Before AUTH only HELLO and AUTH (a payload of at most 16 KiB) are legal: an unauthenticated
        # connection may not make the bookie buffer a frame of frame_bytes_max (5 MiB) each.
        frame_max = min(HANDSHAKE_FRAME_BYTES_MAX, self._frame_max) if required else self._frame_max
        while not self.halted and not self._auth_busy and not self._paused_by_writes:
            if len(buf) < 4:
                return False
            (size,) = _LENGTH.unpack_from(buf, 0)
            if size > frame_max:
                if not required:
                    return True  # the processor's path refuses it (and closes)
                self.warn("connection.frame_too_large", size=size, limit=frame_max, before="auth")
                self._processor.count_error(StatusCode.EBADREQ, self)
                self.close_erred(None)
                return False
            end = 4 + size
            if len(buf) < end:
                return False
            try:
                request = m.decode_request(bytes(buf[4:end]))
            except ProtocolError as exc:
                if not required:
                    self._handshake = False
                    return True  # answered (or closed) by the processor's path, as always
                self._refuse(
                    exc.op or 0,
                    exc.request_id,
                    StatusCode.EBADREQ,
                    f"bad request: {exc}",
                    refused_frame_cost(exc, size),
                )
                return False
            if type(request) is m.HelloRequest:
                self._hellos += 1
                if required and self._hellos > HELLOS_BEFORE_AUTH_MAX:
                    self._refuse(
                        OpCode.HELLO,
                        request.request_id,
                        StatusCode.EBADREQ,
                        f"more than {HELLOS_BEFORE_AUTH_MAX} HELLOs before AUTH",
                    )
                    return False
                one = bytearray(buf[:end])
                with memoryview(one) as view:
                    self._processor.dispatch_frames(
                        self,
                        one,
                        view,
                        0,
                        self.in_flight + 1,
                        self._frame_max,
                        self._limits.load,
                    )
                del buf[:end]
                self._frames_since_arm += 1
            elif type(request) is m.AuthRequest:
                del buf[:end]
                self._frames_since_arm += 1
                self._auth_step(request)
            elif required:
                self._refuse(
                    m.REQUEST_OP[type(request)],
                    request.request_id,
                    StatusCode.EUA,
                    "authenticate first: this bookie needs an AUTH handshake before any request "
                    "(set the client's auth_provider and its credentials)",
                )
                return False
            else:
                self._handshake = False
                return True
        return False

    def _auth_step(self, request: m.AuthRequest) -> None:
        providers = self._limits.auth_providers
        rid = request.request_id
        if not providers:  # nothing to check: a client configured for auth still works
            self.send(m.encode(m.AuthResponse(rid, 0, None, request.provider, b"", 1)))
            return
        provider = providers.get(request.provider)
        if provider is None:
            known = ", ".join(sorted(providers))
            message = f"unknown auth provider {request.provider!r}: this bookie accepts {known}"
            self._refuse(OpCode.AUTH, rid, StatusCode.EUA, message)
            return
        self._auth_steps += 1
        if self._auth_steps > AUTH_STEPS_MAX:
            self._refuse(OpCode.AUTH, rid, StatusCode.EUA, f"more than {AUTH_STEPS_MAX} AUTH steps")
            return
        self._auth_busy = True
        self._update_reading()
        self.spawn(self._run_auth_step(provider, request))

    async def _run_auth_step(self, provider: BookieAuthProvider, request: m.AuthRequest) -> None:
        rid = request.request_id
        try:
            step = await provider.authenticate(request.payload, self._auth_session)
        except AuthRefused as exc:
            self._auth_busy = False
            self._refuse(OpCode.AUTH, rid, StatusCode.EUA, str(exc) or "refused")
            return
        except Exception:  # a provider's bug refuses the client; the bookie goes on
            log.exception("connection.auth_provider_failed", peer=self.peer, provider=provider.name)
            self._auth_busy = False
            self._refuse(OpCode.AUTH, rid, StatusCode.EUA, f"auth provider {provider.name} failed")
            return
        self._auth_busy = False
        if self.closed:
            return
        if isinstance(step, Challenge):
            self.send(m.encode(m.AuthResponse(rid, 0, None, provider.name, step.payload, 0)))
        else:
            self.principal = step.principal
            self._handshake = False
            if self._auth_timer is not None:
                self._auth_timer.cancel()
                self._auth_timer = None
            log.info(
                "connection.authenticated", peer=self.peer, provider=provider.name, principal=step.principal
            )
            self.send(m.encode(m.AuthResponse(rid, 0, None, provider.name, b"", 1)))
        self._update_reading()
        if self._buf:
            self._loop.call_soon(self._process_buffer)

    def _refuse(
        self, op: int, request_id: int | None, status: StatusCode, message: str, cost: float = 1.0
    ) -> None:
        """End a connection that failed the handshake (charged ``cost`` refusals): the answer (when
        the request id is known), then close."""
        self._processor.count_error(status, self, cost)
        self.warn("connection.auth_refused", reason=message, status=status.name)
        self.close_erred(None if request_id is None else m.encode_error(op, request_id, status, message))

    def close_erred(self, answer: bytes | None) -> None:
        """Close a connection for its error (already charged), after ``answer``. If that put its
        address in deficit, both wait for its turn in the address's queue, unread: a loop that
        reconnects once refused and closed then runs at the budget's pace."""
        if self._paused_by_errors and not self.closed:
            self._close_at_turn = True if answer is None else answer
            self._held = False
            return
        if answer is not None:
            self.send(answer)
        self.close()

    def _on_auth_timeout(self) -> None:
        self._auth_timer = None
        if self.closed or not self._handshake:
            return
        if self._paused_by_errors:  # waiting its turn is not the client's delay: the timer waits too
            self._auth_timer = self._loop.call_later(self._limits.auth_timeout_s, self._on_auth_timeout)
            return
        self.warn("connection.auth_timeout", timeout_s=self._limits.auth_timeout_s)
        self.close()

    # ------------------------------------------------------------------ responses and permits
    def send(self, frame: bytes) -> None:
        """Queue one response frame; written with the others of this tick."""
        if self.closed:
            return
        self._out.append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.closed or self._transport is None:
            return
        out, self._out = self._out, []
        if out:  # complete_adds may have written them already
            transport = self._transport
            transport.write(b"".join(out) if len(out) > 1 else out[0])
            size = transport.get_write_buffer_size()
            if size != self.answers_held:
                self._charge_answers(size - self.answers_held)

    def complete(self, request_id: int | None, frame: bytes | None) -> None:
        """Answer one request (``frame`` None: no answer) and give its permit back."""
        if frame is not None and not self.closed:  # send(), inlined: this runs once per request
            out = self._out
            out.append(frame)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
            elif len(out) >= ANSWERS_PER_TURN_MAX and not self._turn_full:
                self._end_turn()
        if request_id is not None:
            self.request_ids.discard(request_id)
        self._release(1)

    def _end_turn(self) -> None:
        """Its answers of this turn reached :data:`ANSWERS_PER_TURN_MAX`: its frame loop stops at the
        next frame (``halted``) and the rest of its buffer is handled in the next turn, after its
        answers are written and the other connections have had theirs. It is not read meanwhile (a
        peer sending faster than its turns handle would grow its buffer without bound)."""
        self._turn_full = self.halted = True
        self._update_reading()
        self._loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_full = False
        if self.closed:
            return
        self.halted = self._paused_by_errors or self._paused_by_keys
        if self._buf and not self.halted:
            self._process_buffer()  # may end this turn too: not read until its buffer is handled
        if not self._turn_full:
            self._update_reading()

    def complete_adds(self, request_ids: list[int], frames: list[bytes]) -> None:
        """Answer a run of requests at once (a journal group's adds): ``frames`` are the parts of
        their responses, written at once with anything queued before them (one write per
        connection and group: left for the end of the tick, they waited behind the parsing of
        the next socket reads); each gives its permit back."""
        transport = self._transport
        if not self.closed and transport is not None:
            out = self._out
            if out:
                out.append(b"".join(frames))
                self._out = []
                transport.write(b"".join(out))
            else:
                transport.write(b"".join(frames))
            size = transport.get_write_buffer_size()  # acks not read count towards the answer budget
            if size != self.answers_held:
                self._charge_answers(size - self.answers_held)
        self.request_ids.difference_update(request_ids)  # one C loop, not a discard call per add
        self._release(len(request_ids))

    def _release(self, count: int) -> None:
        """Give back ``count`` permits (this connection's and the server's); resume reading once
        half of either limit is free again. Once closed, nothing: ``connection_lost`` gave back
        every permit the connection held, answered or not."""
        if self.closed:
            return
        self.in_flight -= count
        self._limits.load.release(count)
        if self._paused_by_permits and self.in_flight < self._limits.in_flight_max // 2 + 1:
            if self._probation_charges >= 0 and self._probation_charges == self._charges:
                self._probation_charges = -1  # a request answered, none refused: off probation
                self._in_flight_max = self._limits.in_flight_max
            self._paused_by_permits = False
            self._update_reading()
            if self._buf and not self.closed:
                self._loop.call_soon(self._process_buffer)

    def pause_by_server(self, paused: bool) -> None:
        self._paused_by_server = paused
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None or self.closed:
            return
        want_paused = (
            self._paused_by_permits
            or self._paused_by_server
            or self._paused_by_writes
            or self._paused_by_errors
            or self._paused_by_keys
            or self._auth_busy
            or self._turn_full
        )
        if want_paused != self._reading_paused:
            self._reading_paused = want_paused
            if want_paused:
                transport.pause_reading()
            else:
                transport.resume_reading()
                if self._held:  # what arrived while paused (data_received) waits for this
                    self._held = False
                    self._loop.call_soon(self._process_buffer)

    # ------------------------------------------------------------------ ownership
    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a request handler that awaits (reads); cancelled if the connection goes away."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Graceful: queued responses are flushed, then the socket closes. Within
        ``frame_read_timeout_s``: a transport still holding answers its peer does not read (or a
        TLS close it does not answer) is aborted then, so a closed connection always gives back its
        slot and what it holds (``connection_lost``)."""
        if self._transport is not None and not self.closed:
            if self._out:
                self._flush()
            self.closed = self.halted = True
            self._transport.close()  # connection_lost comes in a later callback, and cancels this
            self._drain_timer = self._loop.call_later(
                self._limits.frame_read_timeout_s, self._on_drain_timeout
            )

    def _on_drain_timeout(self) -> None:
        self._drain_timer = None
        if self._transport is None or self._aborted:
            return
        unread = self._transport.get_write_buffer_size()
        self.warn(
            "connection.close_stalled", unread_bytes=unread, timeout_s=self._limits.frame_read_timeout_s
        )
        self.abort()

    def abort(self) -> None:
        if self._transport is not None and not self._aborted:
            self.closed = self.halted = self._aborted = True
            self._transport.abort()


def _address_of(peername: Any, peer: str) -> str:
    """The address part of a peer name (what per-address limits count): :func:`address_key`."""
    return address_key(str(peername[0])) if isinstance(peername, tuple) and peername else peer


def address_key(host: str) -> str:
    """What per-address limits and budgets count a peer as: its IPv4 address (an IPv4-mapped IPv6
    one too), or its IPv6 /64 (a host is given a /64: one address each would let it take any
    number of slots)."""
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return f"{ipaddress.IPv6Address(int(ip) >> 64 << 64)}/64"
