"""Request deadlines on one connection: standard-timeout requests grouped per loop tick and expired
by a periodic sweep, other timeouts on their own timer; late answers dropped; forgotten (cancelled)
requests leave the connection usable.

A request fails with BKTimeout no earlier than its timeout and no later than its timeout plus one
sweep interval (plus scheduling slack) — also when request ids on the connection do not increase
(an id taken earlier and used later: a recovery read's speculative second replica, or the request
that opened a connection whose hello took the next id).

What is the client's own backlog does not count against the bookie: a request's deadline runs from
when the kernel took its bytes (a transport that takes nothing for the timeout fails the
connection), and a loop held past a deadline does not expire a request whose answer waits unread.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import pytest
import uvloop

from bookkeeper_aio import BKTimeout, BookieConnectionLost, BookKeeper, ClientConfig
from bookkeeper_aio.client.bookie_client import BookiePool, check
from bookkeeper_aio.client.connection import BookieConnection, ConnectionState, Result
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from bookkeeper_aio.protocol.digest import DigestType, EntryCodec
from bookkeeper_aio.protocol.messages import encode_add_request
from metadata.ledger_manager import LedgerManager
from tests.harness.fake_bookie import FakeBookie, FakeCluster, Reply
from tests.unit.client.conftest import make_client

TIMEOUT_S = 0.3
SWEEP_S = max(0.01, TIMEOUT_S / 20)  # connection.SWEEP_INTERVAL_S_MIN, standard_timeout_s / 20
SLACK_S = 0.06  # event-loop scheduling on a busy test machine
CONFIG = ClientConfig(add_timeout_s=TIMEOUT_S, reconnect_backoff_initial_s=0.01, reconnect_backoff_max_s=0.02)


@pytest.fixture
async def bookie() -> AsyncIterator[FakeBookie]:
    fake = FakeBookie()
    await fake.start()
    yield fake
    await fake.kill()


@pytest.fixture
async def pool() -> AsyncIterator[BookiePool]:
    client_pool = BookiePool(CONFIG)
    yield client_pool
    await client_pool.close()


class Recorder:
    """Callback recording ``(time, result)`` per request context."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.results: dict[object, list[tuple[float, Result]]] = {}
        self.sent_at: dict[object, float] = {}

    def send(self, conn: BookieConnection, rid: int, frame: bytes, key: object, timeout_s: float) -> None:
        self.sent_at[key] = self.loop.time()
        conn.request(rid, frame, self, key, timeout_s)

    def __call__(self, key: object, bookie_id: str, result: Result) -> None:
        self.results.setdefault(key, []).append((self.loop.time(), result))

    def elapsed(self, key: object) -> float:
        (at, _), *_ = self.results[key]
        return at - self.sent_at[key]

    async def wait(self, *keys: object, timeout_s: float = 3.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not all(k in self.results for k in keys):  # noqa: ASYNC110 (callbacks, no event)
                await asyncio.sleep(0.002)


def add_frame(rid: int, entry_id: int = 0) -> bytes:
    body = EntryCodec(DigestType.CRC32C).encode(1, entry_id, -1, 1, b"x")
    return encode_add_request(rid, 1, entry_id, 0, b"k" * 32, body)


def info_frame(rid: int) -> bytes:
    return m.encode(m.GetBookieInfoRequest(rid))


async def ready(pool: BookiePool, bookie: FakeBookie) -> BookieConnection:
    check(await pool.request(bookie.id, m.GetBookieInfoRequest, 1.0))  # connected, hello done
    conn = pool.connection(bookie.id)
    assert conn.state is ConnectionState.READY
    return conn


def assert_timed_out_on_time(rec: Recorder, key: object, timeout_s: float = TIMEOUT_S) -> None:
    (_, result), *more = rec.results[key]
    assert not more, "one callback per request"
    assert isinstance(result, BKTimeout)
    assert timeout_s - 0.005 <= rec.elapsed(key) <= timeout_s + SWEEP_S + SLACK_S, rec.elapsed(key)


async def test_add_nobody_answers__bktimeout_within_timeout_plus_one_sweep_and_late_answer_ignored(
    pool: BookiePool, bookie: FakeBookie
) -> None:
    conn = await ready(pool, bookie)
    bookie.script = lambda req: Reply.delay(TIMEOUT_S + 0.15) if isinstance(req, m.AddEntryRequest) else None
    rec = Recorder()
    rids = [pool.next_request_id() for _ in range(3)]
    for i, rid in enumerate(rids):
        rec.send(conn, rid, add_frame(rid, i), rid, TIMEOUT_S)
    await rec.wait(*rids)
    for rid in rids:
        assert_timed_out_on_time(rec, rid)
    await asyncio.sleep(0.25)  # the late answers arrive now
    assert all(len(rec.results[rid]) == 1 for rid in rids)  # dropped, not delivered a second time
    assert conn.state is ConnectionState.READY
    assert conn.pending_count == 0
    bookie.script = None
    rid = pool.next_request_id()
    rec.send(conn, rid, add_frame(rid, 9), "after", TIMEOUT_S)
    await rec.wait("after")
    ((_, result),) = rec.results["after"]
    assert isinstance(result, m.AddEntryResponse)
    assert result.status == StatusCode.EOK


async def test_requests_of_later_ticks_keep_their_own_deadline(pool: BookiePool, bookie: FakeBookie) -> None:
    conn = await ready(pool, bookie)
    bookie.script = lambda req: Reply.drop() if isinstance(req, m.GetBookieInfoRequest) else None
    rec = Recorder()
    keys = []
    for step in range(4):  # four ticks, a quarter timeout apart, two requests each
        for _ in range(2):
            rid = pool.next_request_id()
            rec.send(conn, rid, info_frame(rid), rid, TIMEOUT_S)
            keys.append(rid)
        if step < 3:
            await asyncio.sleep(TIMEOUT_S / 4)
    await rec.wait(*keys)
    for key in keys:
        assert_timed_out_on_time(rec, key)
    assert conn.state is ConnectionState.READY


async def test_own_timer_timeout_is_not_the_standard_one(pool: BookiePool, bookie: FakeBookie) -> None:
    conn = await ready(pool, bookie)
    bookie.script = lambda req: Reply.drop() if isinstance(req, m.GetBookieInfoRequest) else None
    rec = Recorder()
    short, long_, standard = (pool.next_request_id() for _ in range(3))
    rec.send(conn, short, info_frame(short), "short", 0.1)
    rec.send(conn, long_, info_frame(long_), "long", TIMEOUT_S * 2)
    rec.send(conn, standard, info_frame(standard), "standard", TIMEOUT_S)
    await rec.wait("short", "long", "standard")
    assert_timed_out_on_time(rec, "short", 0.1)
    assert_timed_out_on_time(rec, "standard")
    assert_timed_out_on_time(rec, "long", TIMEOUT_S * 2)


async def test_lower_request_id_sent_later__earlier_requests_still_expire_on_time(
    pool: BookiePool, bookie: FakeBookie
) -> None:
    """An id taken before and used after others (recovery's speculative read to a second replica
    is sent ``speculative_read_delay_ms`` after its id was taken) opens the next group: the
    earlier group must still expire at its own deadline, not when the later one does."""
    conn = await ready(pool, bookie)
    bookie.script = lambda req: Reply.drop() if isinstance(req, m.GetBookieInfoRequest) else None
    rec = Recorder()
    taken_early = pool.next_request_id()  # taken now, used half a timeout later
    early = pool.next_request_id()
    rec.send(conn, early, info_frame(early), "first", TIMEOUT_S)
    await asyncio.sleep(TIMEOUT_S / 2)
    rec.send(conn, taken_early, info_frame(taken_early), "late-used", TIMEOUT_S)
    await rec.wait("first", "late-used")
    assert_timed_out_on_time(rec, "first")
    assert_timed_out_on_time(rec, "late-used")


async def test_lower_request_id_sent_later__does_not_expire_early(
    pool: BookiePool, bookie: FakeBookie
) -> None:
    """The group opened by a request that was answered, followed in the same tick by a lower id:
    when the previous group expires, the lower id (half a timeout younger) must not go with it."""
    conn = await ready(pool, bookie)
    rec = Recorder()
    first = pool.next_request_id()
    taken_early = pool.next_request_id()
    answered = pool.next_request_id()
    bookie.script = lambda req: (
        Reply.drop() if isinstance(req, m.GetBookieInfoRequest) and req.request_id != answered else None
    )
    rec.send(conn, first, info_frame(first), "first", TIMEOUT_S)
    await asyncio.sleep(TIMEOUT_S / 2)
    rec.send(conn, answered, info_frame(answered), "answered", TIMEOUT_S)  # opens the group
    rec.send(conn, taken_early, info_frame(taken_early), "late-used", TIMEOUT_S)
    await rec.wait("answered", "first", "late-used")
    assert isinstance(rec.results["answered"][0][1], m.GetBookieInfoResponse)
    assert_timed_out_on_time(rec, "first")
    assert_timed_out_on_time(rec, "late-used")


async def test_first_request_on_a_new_connection__hello_took_the_next_id(bookie: FakeBookie) -> None:
    """``_start_add`` takes the request id, then ``pool.connection()`` opens the connection and
    its hello takes the next id: the request goes on the wire after a higher id. It still times
    out on time, and so do requests of later ticks."""
    pool = BookiePool(CONFIG)
    bookie.script = lambda req: Reply.drop() if isinstance(req, m.AddEntryRequest) else None
    rec = Recorder()
    rid = pool.next_request_id()
    conn = pool.connection(bookie.id)  # hello: rid + 1
    rec.send(conn, rid, add_frame(rid), "first", TIMEOUT_S)
    await asyncio.sleep(TIMEOUT_S / 2)
    later = pool.next_request_id()
    rec.send(conn, later, add_frame(later, 1), "later", TIMEOUT_S)
    await rec.wait("first", "later")
    assert_timed_out_on_time(rec, "first")
    assert_timed_out_on_time(rec, "later")
    await pool.close()


async def test_forgotten_requests__never_called_back_and_connection_stays_usable(
    pool: BookiePool, bookie: FakeBookie
) -> None:
    conn = await ready(pool, bookie)
    bookie.script = lambda req: Reply.delay(0.1) if isinstance(req, m.AddEntryRequest) else None
    rec = Recorder()
    standard, own = pool.next_request_id(), pool.next_request_id()
    rec.send(conn, standard, add_frame(standard, 0), "standard", TIMEOUT_S)
    rec.send(conn, own, add_frame(own, 1), "own", TIMEOUT_S * 2)
    await asyncio.sleep(0.02)
    conn.forget(standard)
    conn.forget(own)
    assert conn.pending_count == 0
    await asyncio.sleep(TIMEOUT_S * 2 + SWEEP_S + SLACK_S)  # answers arrive; deadlines pass
    assert rec.results == {}
    assert conn.state is ConnectionState.READY
    bookie.script = None
    rid = pool.next_request_id()
    rec.send(conn, rid, add_frame(rid, 2), "after", TIMEOUT_S)
    await rec.wait("after")
    assert isinstance(rec.results["after"][0][1], m.AddEntryResponse)


async def test_cancelled_pool_request__late_answer_ignored_next_request_succeeds(
    pool: BookiePool, bookie: FakeBookie
) -> None:
    await ready(pool, bookie)
    bookie.script = lambda req: Reply.delay(0.1) if isinstance(req, m.GetBookieInfoRequest) else None
    for timeout_s in (TIMEOUT_S, 1.0):  # standard group, own timer
        task = asyncio.ensure_future(pool.request(bookie.id, m.GetBookieInfoRequest, timeout_s))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    conn = pool.connection(bookie.id)
    assert conn.pending_count == 0
    await asyncio.sleep(0.15)  # both late answers arrive and are dropped
    assert conn.state is ConnectionState.READY
    bookie.script = None
    assert check(await pool.request(bookie.id, m.GetBookieInfoRequest, TIMEOUT_S)).status == StatusCode.EOK


async def test_ledger__silent_bookie_replaced_within_add_timeout_plus_one_sweep(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    """The ensemble change starts no later than add_timeout_s + one sweep after the add; the
    stalled bookie's answers, released afterwards, complete nothing twice."""
    config = ClientConfig(
        add_timeout_s=TIMEOUT_S, explicit_lac_interval_ms=0, reconnect_backoff_initial_s=0.01
    )
    bk: BookKeeper = make_client(ledgers, StaticDirectory(cluster.ids), config)
    lh = await bk.create_ledger(3, 2, 2)
    loop = asyncio.get_running_loop()
    events: list[tuple[float, str, int]] = []
    lh.set_event_listener(lambda event, value: events.append((loop.time(), event, value)))
    await lh.append(b"warm-up")
    stalled = cluster.by_id(lh.metadata.current_ensemble[1])
    stalled.pause()
    sent_at = loop.time()
    futures = [await lh.append_async(b"%d" % i) for i in range(1, 4)]  # entries 1..3: all touch B
    assert await asyncio.gather(*futures) == [1, 2, 3]
    started = [at for at, event, _ in events if event == "ensemble_change.started"]
    assert len(started) == 1
    assert TIMEOUT_S - 0.005 <= started[0] - sent_at <= TIMEOUT_S + SWEEP_S + SLACK_S
    stalled.resume()
    await asyncio.sleep(0.05)
    assert await lh.append(b"4") == 4
    assert [v for _, e, v in events if e == "add.completed"] == [0, 1, 2, 3, 4]
    assert stalled.id not in lh.metadata.current_ensemble
    await lh.close()
    await bk.close()


# ---------------------------------------------------------------- the client's own backlog


class _BacklogTransport:
    """A transport whose write buffer the test sets: ``waiting`` bytes not taken by the kernel."""

    def __init__(self) -> None:
        self.written = 0
        self.waiting = 0

    def get_extra_info(self, name: str) -> None:
        return None

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_write_buffer_size(self) -> int:
        return min(self.waiting, self.written)

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass

    close = abort


def _connection_on(transport: object) -> BookieConnection:
    conn = BookieConnection("b", standard_timeout_s=TIMEOUT_S, pending_max=100, frame_bytes_max=1 << 20)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn


async def test_bytes_waiting_in_the_transport__the_deadline_runs_from_when_the_kernel_took_them() -> None:
    """A burst the kernel has not taken yet is the client's backlog, not the bookie's slowness."""
    transport = _BacklogTransport()
    transport.waiting = 1 << 30  # every byte written waits
    conn = _connection_on(transport)
    rec = Recorder()
    rec.send(conn, 1, add_frame(1), "add", TIMEOUT_S)
    held_s = 0.2  # < TIMEOUT_S: the buffer drains slowly meanwhile, it is no stall
    for _ in range(int(held_s / 0.02)):
        await asyncio.sleep(0.02)
        transport.written += 1  # more bytes of other requests, a little taken: progress
    assert "add" not in rec.results
    transport.waiting = 0
    await rec.wait("add")
    assert_timed_out_on_time(rec, "add", held_s + TIMEOUT_S)
    conn.abort()


async def test_a_transport_that_takes_nothing_for_the_timeout__fails_the_connection() -> None:
    transport = _BacklogTransport()
    transport.waiting = 1 << 30
    conn = _connection_on(transport)
    rec = Recorder()
    rec.send(conn, 1, add_frame(1), "add", TIMEOUT_S)
    await rec.wait("add")
    ((_, result),) = rec.results["add"]
    assert isinstance(result, BookieConnectionLost)
    assert isinstance(result.__cause__, BKTimeout)
    assert conn.state is ConnectionState.CLOSED
    assert TIMEOUT_S - 0.005 <= rec.elapsed("add") <= TIMEOUT_S + 2 * SWEEP_S + SLACK_S, rec.elapsed("add")


def test_loop_held_past_a_deadline_with_the_answer_unread__no_timeout() -> None:
    """uvloop runs due timers before it polls the sockets: after the loop was held in a socket's
    callback (a client busy with a backlog of answers), the sweep runs first and must not expire a
    request whose answer came meanwhile and waits unread."""

    def tcp_pair() -> tuple[socket.socket, socket.socket]:  # TCP: the connection sets NODELAY
        with socket.create_server(("127.0.0.1", 0)) as server:
            ours = socket.create_connection(server.getsockname())
            theirs, _ = server.accept()
        return ours, theirs

    async def scenario() -> Result:
        loop = asyncio.get_running_loop()
        ours, theirs = tcp_pair()
        busy_ours, busy_theirs = tcp_pair()
        conn = BookieConnection("b", standard_timeout_s=TIMEOUT_S, pending_max=100, frame_bytes_max=1 << 20)
        await loop.create_connection(lambda: conn, sock=ours)

        class Busy(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:  # the poll phase, like a burst of answers
                theirs.sendall(m.encode(m.AddEntryResponse(1, 0, None, 1, 0)))
                time.sleep(TIMEOUT_S + 0.1)  # the loop is held past the deadline; the answer waits

        busy, _ = await loop.create_connection(Busy, sock=busy_ours)
        rec = Recorder()
        rec.send(conn, 1, add_frame(1), "add", TIMEOUT_S)
        await asyncio.sleep(0.05)  # written, and a sweep ran on time
        busy_theirs.sendall(b"x")
        await rec.wait("add")
        conn.abort()
        busy.abort()
        theirs.close()
        busy_theirs.close()
        ((_, result),) = rec.results["add"]
        return result

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(scenario())
    assert isinstance(result, m.AddEntryResponse), result
