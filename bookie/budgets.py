"""What a peer may cost in refusals and log lines, counted per address or over all connections
(the connection handler's budgets, :mod:`bookie.connection_handler`).

- :class:`ErrorBudget`: refusals (EUA, EBADREQ, ETOOMANYREQUESTS) per peer address, a token
  bucket; the connections of an address in deficit wait in a queue of that address and are let
  go one at a time.
- :class:`LogLines`: warnings about connections' input, over all connections.
- :class:`Refusals`: connections closed at accept, counted each and logged once a second.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Protocol

import structlog

from bookkeeper_aio.protocol.codes import StatusCode
from bookkeeper_aio.protocol.errors import ProtocolError, RequestTooComplex

log = structlog.get_logger(__name__)


class Throttled(Protocol):
    """What waits in an :class:`ErrorBudget`'s queue (a
    :class:`~bookie.connection_handler.ServerConnection`)."""

    def errors_paid(self) -> None: ...


class ErrorBudget:
    """Per peer address, a token bucket of ``rate`` refusals per second holding up to ``burst``
    (the module doc); an address may fall ``burst`` deep into deficit, no deeper, so the longest
    wait is ``burst / rate``. Buckets of addresses without connections are dropped once full. An
    address falling into deficit is logged (``connection.throttled``), at most every
    :data:`ERROR_LOG_INTERVAL_S`.

    The connections of an address in deficit wait in a queue of that address (:meth:`wait`) and
    are let go one at a time, in the order they came, once the deficit is paid and then at most
    one every ``1 / rate`` seconds: released together (each on a timer of its own, all set for the
    instant the deficit is paid), 16 reconnect loops were answered, closed and accepted again in
    bursts of 16 every 160 ms, and a well-behaved client's request that fell in one waited behind
    all of them (its p99 2.4x). One at a time, it waits behind one at most."""

    __slots__ = ("_buckets", "_clock", "_sweep_size", "_swept_at", "_timers", "_waiting", "burst", "rate")

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, list[float]] = {}  # address -> [tokens, when last charged, when logged]
        self._waiting: dict[str, dict[Throttled, None]] = {}
        """Address -> its connections waiting for the deficit to be paid (a dict: ordered, and a
        connection that closes leaves it in O(1))."""
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._sweep_size = SWEEP_BUCKETS_MIN
        """A new bucket past this many sweeps the full ones first (then: twice those left)."""
        self._swept_at = clock()

    def charge(self, address: str, cost: float = 1.0) -> float:
        """Take ``cost`` refusals (one, or more for a large refused frame:
        :data:`REFUSED_BYTES_PER_CHARGE`) from ``address``'s budget: seconds until it is out of
        deficit (0: not in deficit)."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        bucket = self._buckets.get(address)
        if bucket is None:
            if len(self._buckets) >= self._sweep_size or now - self._swept_at >= SWEEP_INTERVAL_S:
                self.sweep()
            bucket = self._buckets[address] = [self.burst, now, -ERROR_LOG_INTERVAL_S]
        before = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        tokens = bucket[0] = max(before - cost, -self.burst)
        bucket[1] = now
        if tokens >= 0:
            return 0.0
        if before >= 0 and now - bucket[2] >= ERROR_LOG_INTERVAL_S:
            bucket[2] = now
            log.warning(
                "connection.throttled", address=address, reason="bad_requests_per_address_per_s",
                rate=self.rate, burst=self.burst,
            )  # fmt: skip
        return -tokens / self.rate

    def deficit_s(self, address: str) -> float:
        """Seconds until ``address`` is out of deficit (0: it is not)."""
        bucket = self._buckets.get(address)
        if bucket is None or self.rate <= 0:
            return 0.0
        tokens = bucket[0] + (self._clock() - bucket[1]) * self.rate
        return 0.0 if tokens >= 0 else -tokens / self.rate

    def wait(self, address: str, conn: Throttled) -> None:
        """``conn`` (no longer read) waits its turn: :meth:`Throttled.errors_paid` is called once
        the deficit is paid and the connections that waited before it were let go."""
        queue = self._waiting.get(address)
        if queue is None:
            queue = self._waiting[address] = {}
        queue[conn] = None
        if address not in self._timers:
            self._arm(address, self.deficit_s(address))

    async def turn(self, address: str) -> None:
        """Return once ``address`` is out of deficit and the connections waiting before this one
        were let go (at once when none wait and there is no deficit)."""
        if self.deficit_s(address) <= 0 and not self.waiting(address):
            return
        turn = _Turn(asyncio.get_running_loop().create_future())
        self.wait(address, turn)
        try:
            await turn.future
        finally:
            self.unwait(address, turn)  # cancelled while waiting (let go: a no-op)

    def unwait(self, address: str, conn: Throttled) -> None:
        """``conn`` closed while it waited."""
        queue = self._waiting.get(address)
        if queue is None:
            return
        queue.pop(conn, None)
        if not queue:
            del self._waiting[address]
            timer = self._timers.pop(address, None)
            if timer is not None:
                timer.cancel()

    def waiting(self, address: str) -> int:
        """Connections of ``address`` waiting their turn."""
        return len(self._waiting.get(address, ()))

    def _arm(self, address: str, delay_s: float) -> None:
        self._timers[address] = asyncio.get_running_loop().call_later(delay_s, self._next, address)

    def _next(self, address: str) -> None:
        """Let the first waiting connection of ``address`` go, if its deficit is paid (the one let
        go before may have earned another refusal meanwhile); the next one not before ``1 / rate``."""
        del self._timers[address]
        queue = self._waiting.get(address)
        if not queue:
            return
        wait_s = self.deficit_s(address)
        if wait_s > 0:
            self._arm(address, wait_s)
            return
        conn = next(iter(queue))
        del queue[conn]
        if queue:
            self._arm(address, 1.0 / self.rate)
        else:
            del self._waiting[address]
        conn.errors_paid()

    def release(self, address: str) -> None:
        """``address`` has no connection left: forget its bucket if it is full again (else the next
        :meth:`sweep` does, once it is)."""
        bucket = self._buckets.get(address)
        now = self._clock()
        if bucket is not None and bucket[0] + (now - bucket[1]) * self.rate >= self.burst:
            del self._buckets[address]
        if now - self._swept_at >= SWEEP_INTERVAL_S:
            self.sweep()

    def sweep(self) -> None:
        """Forget the buckets that are full again and have nobody waiting (a full bucket is the
        same as none): run when a new bucket would pass twice the count left by the last sweep,
        or :data:`SWEEP_INTERVAL_S` after it, so their number stays within twice those in
        deficit, amortised O(1) per charge. Without it, addresses that erred once and left
        (100,000 IPv6 /64s) kept their buckets for good."""
        now = self._clock()
        self._swept_at = now
        full = [
            address
            for address, (tokens, stamp, _) in self._buckets.items()
            if tokens + (now - stamp) * self.rate >= self.burst and address not in self._waiting
        ]
        for address in full:
            del self._buckets[address]
        self._sweep_size = max(SWEEP_BUCKETS_MIN, 2 * len(self._buckets))

    @property
    def buckets(self) -> int:
        """Addresses with a bucket kept (in deficit, or not yet swept)."""
        return len(self._buckets)


class _Turn:
    """A wait in an :class:`ErrorBudget` queue by a coroutine (a TLS handshake not started yet)."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future

    def errors_paid(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class LogLines:
    """A token bucket of log lines (``rate`` per second, ``burst`` at once) that counts what it
    drops."""

    __slots__ = ("_clock", "_stamp", "_tokens", "burst", "dropped", "rate")

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._stamp = clock()
        self.dropped = 0

    def take(self) -> int | None:
        """None: drop this line; else log it, and the count dropped since the last one logged."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens < 1:
            self.dropped += 1
            return None
        self._tokens -= 1
        dropped, self.dropped = self.dropped, 0
        return dropped


class Refusals:
    """Connections closed at accept (over ``connections_max`` or ``connections_per_address_max``):
    counted, the first of a quiet spell logged at once and the rest as one line a second with their
    count by reason, so a flood of connections costs one count each, not a log line (nor a clock
    read) each."""

    __slots__ = ("_pending", "_timer", "total")

    def __init__(self) -> None:
        self.total = 0
        self._pending: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    def note(self, reason: str, limit: int, peer: str) -> None:
        self.total += 1
        if self._timer is not None:
            self._pending[reason] += 1
            return
        log.warning("connection.refused", peer=peer, reason=reason, limit=limit)
        self._timer = asyncio.get_running_loop().call_later(REFUSALS_LOG_INTERVAL_S, self._flush)

    def _flush(self) -> None:
        self._timer = None
        if not self._pending:
            return  # a quiet spell: the next refusal is logged at once
        log.warning("connection.refused", refused=dict(self._pending), interval_s=REFUSALS_LOG_INTERVAL_S)
        self._pending.clear()
        self._timer = asyncio.get_running_loop().call_later(REFUSALS_LOG_INTERVAL_S, self._flush)


REFUSALS_LOG_INTERVAL_S = 1.0
LOG_LINES_PER_S = 10.0
"""Warnings about connections' input, over all connections (burst: :data:`LOG_LINES_BURST`)."""
LOG_LINES_BURST = 100.0
ERROR_LOG_INTERVAL_S = 10.0
SWEEP_BUCKETS_MIN = 1024
SWEEP_INTERVAL_S = 60.0
ERROR_BURST_S = 10.0
"""An address's error budget holds this many seconds' worth of refusals (its burst)."""
REFUSED_BYTES_PER_CHARGE = 64 * 1024
"""A refused frame is charged one refusal per this many bytes (at least one): the bookie read the
whole frame before it could refuse it, so 1 MiB frames of garbage at the refusal rate (100/s) made
it read 100 MiB/s on its event loop (a well-behaved client beside it: p99 2.4x); charged by size,
6 MiB/s."""
COMPLEX_REFUSED_BYTES_PER_CHARGE = 256
"""A frame refused for holding too many arrays, maps and extension values
(:class:`~bookkeeper_aio.protocol.errors.RequestTooComplex`) is charged one refusal per this many
bytes: one shaped as an ADD_ENTRY was first unpacked whole by the add shortcut, which counts
nothing (~150-180 ns a byte of nested values: a 54 KB frame held the event loop ~8 ms). At the
default rate an address gets one such frame of 54 KB about every 2 s."""


def refused_frame_cost(error: ProtocolError, size: int) -> float:
    """The refusals a frame of ``size`` bytes refused for ``error`` is charged (at least one)."""
    if isinstance(error, RequestTooComplex):
        return max(1.0, size / COMPLEX_REFUSED_BYTES_PER_CHARGE)
    return max(1.0, size / REFUSED_BYTES_PER_CHARGE)


BUDGETED_STATUSES = frozenset({StatusCode.EUA, StatusCode.EBADREQ, StatusCode.ETOOMANYREQUESTS})
"""The answers charged to a peer's error budget: an honest client gets them rarely (a wrong key or
a bad request is a bug or an attack; ETOOMANYREQUESTS asks it to slow down)."""
