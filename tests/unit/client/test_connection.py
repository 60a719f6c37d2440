"""BookieConnection / BookiePool: matching by id, timeouts, late answers, loss, reconnect, cancel."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import BKTimeout, BookieConnectionLost, ClientConfig
from bookkeeper_aio.client.bookie_client import BookiePool, check
from bookkeeper_aio.client.connection import Result
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.fake_bookie import FakeBookie, Reply

CONFIG = ClientConfig(add_timeout_s=0.2, reconnect_backoff_initial_s=0.01, reconnect_backoff_max_s=0.02)


def _info(rid: int) -> m.Request:
    return m.GetBookieInfoRequest(rid)


@pytest.fixture
async def bookie() -> FakeBookie:
    fake = FakeBookie()
    await fake.start()
    yield fake  # type: ignore[misc]
    await fake.kill()


async def test_pool__request_response_and_hello_first(bookie: FakeBookie) -> None:
    pool = BookiePool(CONFIG)
    response = check(await pool.request(bookie.id, _info, 1.0))
    assert isinstance(response, m.GetBookieInfoResponse)
    assert isinstance(bookie.requests[0], m.HelloRequest)
    await pool.close()


async def test_pool__timeout_then_late_answer_is_ignored_and_connection_stays_usable(
    bookie: FakeBookie,
) -> None:
    pool = BookiePool(CONFIG)
    await pool.request(bookie.id, _info, 1.0)
    bookie.script = lambda req: Reply.delay(0.4) if isinstance(req, m.GetBookieInfoRequest) else None
    with pytest.raises(BKTimeout):
        await pool.request(bookie.id, _info, 0.2)  # standard timeout: expired by the sweep
    with pytest.raises(BKTimeout):
        await pool.request(bookie.id, _info, 0.1)  # own timer
    bookie.script = None
    await asyncio.sleep(0.4)  # the late answers arrive and are dropped
    assert check(await pool.request(bookie.id, _info, 1.0)).status == StatusCode.EOK
    await pool.close()


async def test_pool__loss_fails_every_pending_request_with_cause(bookie: FakeBookie) -> None:
    pool = BookiePool(CONFIG)
    await pool.request(bookie.id, _info, 1.0)
    bookie.script = lambda req: Reply.drop()
    results: list[Result] = []
    conn = pool.connection(bookie.id)
    for _ in range(5):
        conn.request(
            pool.next_request_id(), m.encode(_info(0)), lambda _c, _b, r: results.append(r), None, 5.0
        )
    await asyncio.sleep(0.05)
    await bookie.kill()
    await asyncio.sleep(0.05)
    assert len(results) == 5
    assert all(isinstance(r, BookieConnectionLost) for r in results)
    await pool.close()


async def test_pool__reconnects_after_restart_with_backoff(bookie: FakeBookie) -> None:
    pool = BookiePool(CONFIG)
    await pool.request(bookie.id, _info, 1.0)
    await bookie.kill()
    await asyncio.sleep(0.01)
    with pytest.raises(BookieConnectionLost):
        await pool.request(bookie.id, _info, 1.0)  # connect refused / backoff: fails fast
    await bookie.restart()
    for _ in range(50):
        try:
            await pool.request(bookie.id, _info, 1.0)
            break
        except BookieConnectionLost:
            await asyncio.sleep(0.01)
    else:
        pytest.fail("never reconnected")
    await pool.close()


async def test_pool__cancelled_request_leaves_connection_usable(bookie: FakeBookie) -> None:
    pool = BookiePool(CONFIG)
    bookie.script = lambda req: Reply.delay(0.1) if isinstance(req, m.GetBookieInfoRequest) else None
    task = asyncio.ensure_future(pool.request(bookie.id, _info, 1.0))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.connection(bookie.id).pending_count == 0
    assert check(await pool.request(bookie.id, _info, 1.0)).status == StatusCode.EOK
    await pool.close()


async def test_pool__unknown_host_fails_fast() -> None:
    pool = BookiePool(CONFIG)
    with pytest.raises(BookieConnectionLost):
        await pool.request("127.0.0.1:1", _info, 1.0)
    await pool.close()


class _RecordingTransport:
    """Just enough of a transport for BookieConnection: records each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def get_extra_info(self, name: str) -> None:
        return None

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def get_write_buffer_size(self) -> int:
        return 0  # the kernel takes everything at once

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass


async def test_connection__large_burst_is_written_before_the_tick_ends_in_order() -> None:
    """Frames are coalesced per tick, but once write_eager_bytes are queued they go out at once
    (the bookie starts on a burst while the rest is built); nothing is reordered or lost."""
    from bookkeeper_aio.client.connection import BookieConnection

    conn = BookieConnection(
        "b", standard_timeout_s=1.0, pending_max=1000, frame_bytes_max=1 << 20, write_eager_bytes=1000
    )
    transport = _RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    frames = [bytes([i]) * 300 for i in range(10)]
    for rid, frame in enumerate(frames, start=1):
        conn.request(rid, frame, lambda *_: None, None, 1.0)
    # 4 frames (1,200 bytes) reach the threshold: two early writes within the tick, the rest queued.
    assert [len(w) for w in transport.writes] == [1200, 1200]
    await asyncio.sleep(0)  # the end-of-tick flush
    assert [len(w) for w in transport.writes] == [1200, 1200, 600]
    assert b"".join(transport.writes) == b"".join(frames)
    conn.request(11, b"x" * 10, lambda *_: None, None, 1.0)  # small: waits for the tick
    assert len(transport.writes) == 3
    await asyncio.sleep(0)
    assert transport.writes[-1] == b"x" * 10
    conn.abort()


async def test_connection__many_small_frames_are_written_early_too() -> None:
    """With small entries the byte threshold is rarely reached: write_eager_frames queued frames
    go out at once as well, in order."""
    from bookkeeper_aio.client.connection import BookieConnection

    conn = BookieConnection(
        "b",
        standard_timeout_s=1.0,
        pending_max=1000,
        frame_bytes_max=1 << 20,
        write_eager_bytes=1 << 20,
        write_eager_frames=4,
    )
    transport = _RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    frames = [bytes([i]) * 10 for i in range(10)]
    for rid, frame in enumerate(frames, start=1):
        conn.request(rid, frame, lambda *_: None, None, 1.0)
    assert [len(w) for w in transport.writes] == [40, 40]
    await asyncio.sleep(0)
    assert [len(w) for w in transport.writes] == [40, 40, 20]
    assert b"".join(transport.writes) == b"".join(frames)
    conn.abort()


async def test_connection__close_aborts_when_the_bookie_does_not_take_what_was_sent() -> None:
    """A graceful close of a connection whose bookie stopped reading (partitioned, SIGSTOPped)
    must not wait for it for ever: the socket would stay open (a ResourceWarning at exit in the
    fault suite's netns runs) long after the requests failed. It aborts instead."""
    from bookkeeper_aio.client.connection import BookieConnection

    held: list[asyncio.StreamWriter] = []

    async def never_reads(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(never_reads, "127.0.0.1", 0)
    async with server:
        host, port = server.sockets[0].getsockname()[:2]
        conn = BookieConnection("b", standard_timeout_s=5.0, pending_max=10_000, frame_bytes_max=1 << 24)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_connection(lambda: conn, host, port)
        failed: list[object] = []
        for rid in range(1, 65):  # 64 MiB: far more than both kernel buffers hold
            conn.request(rid, b"x" * (1 << 20), lambda _c, _b, r: failed.append(r), None, 5.0)
        await asyncio.sleep(0.05)
        assert transport.get_write_buffer_size() > 0  # the bookie took only what the kernel held
        conn.close()
        await asyncio.sleep(0.05)
        assert transport.get_write_buffer_size() == 0  # dropped: aborted, not left closing
        assert transport.get_extra_info("socket").fileno() == -1
        assert len(failed) == 64
        assert all(isinstance(r, BookieConnectionLost) for r in failed)
        for writer in held:
            writer.close()


def test_request_ids__count_up_then_start_again_from_the_first() -> None:
    from bookkeeper_aio.client.bookie_client import request_ids

    ids = request_ids(1, 3)
    assert [ids() for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    ids = request_ids()
    assert (ids(), ids()) == (1, 2)


async def test_connection__request_each_sends_one_frame_to_each_and_fails_only_on_a_closed_one() -> None:
    """An add's write set in one call: the open connections queue the frame under the one request
    id; a closed one answers its callback with BookieConnectionLost on the next tick, never inline."""
    from bookkeeper_aio.client.connection import BookieConnection

    def conn(name: str) -> tuple[BookieConnection, _RecordingTransport]:
        c = BookieConnection(name, standard_timeout_s=1.0, pending_max=10, frame_bytes_max=1 << 20)
        transport = _RecordingTransport()
        c.connection_made(transport)  # type: ignore[arg-type]
        return c, transport

    (a, ta), (b, tb), (c, tc) = conn("a"), conn("b"), conn("c")
    b.abort()
    results: list[tuple[str, Result]] = []
    frame = m.encode(_info(5))
    BookieConnection.request_each((a, b, c), 5, frame, lambda _c, bid, r: results.append((bid, r)), None, 1.0)
    assert results == []
    await asyncio.sleep(0)
    assert [bid for bid, _ in results] == ["b"]
    assert isinstance(results[0][1], BookieConnectionLost)
    assert ta.writes == [frame]
    assert tc.writes == [frame]
    assert tb.writes == []
    assert a.pending_count == c.pending_count == 1
    a.abort()
    c.abort()
