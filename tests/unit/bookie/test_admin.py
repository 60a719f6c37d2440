"""bookie.admin in process: routes, status codes, and the bounds against misbehaving peers.

The admin server gets a snapshot source, so every answer here is checked against a hand-made
snapshot; the real bookie is exercised in tests/integration/bookie/test_admin.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import pytest

from bookie import admin
from bookie.admin import AdminServer, BadRequest, parse_request_line
from bookie.metrics import BookieState, Snapshot
from tests.harness.admin_http import get_json, http_get, http_raw, scrape

from .test_metrics import make_snapshot


class Source:
    def __init__(self) -> None:
        self.snap = make_snapshot()
        self.calls = 0

    def __call__(self) -> Snapshot:
        self.calls += 1
        return self.snap


@pytest.fixture
async def served() -> AsyncIterator[tuple[AdminServer, Source, str, int]]:
    source = Source()
    server = AdminServer(source, "127.0.0.1", 0)
    await server.start()
    assert server.address is not None
    yield server, source, *server.address
    await server.close()


# ---------------------------------------------------------------------- parsing (pure)
def test_parse_request_line() -> None:
    assert parse_request_line(b"GET /metrics HTTP/1.1\r\n") == ("GET", "/metrics")
    assert parse_request_line(b"HEAD /health?verbose=1 HTTP/1.0\n") == ("HEAD", "/health")


@pytest.mark.parametrize(
    ("line", "status"),
    [
        (b"\xff\xfe garbage\r\n", 400),
        (b"GET /metrics\r\n", 400),
        (b"get /metrics HTTP/1.1\r\n", 400),
        (b"GET  /metrics HTTP/1.1\r\n", 400),
        (b"GET http://x/metrics HTTP/1.1\r\n", 400),
        (b"GET /metrics HTTP/2.0\r\n", 505),
    ],
)
def test_parse_request_line__rejects(line: bytes, status: int) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request_line(line)
    assert caught.value.status == status


# ---------------------------------------------------------------------- routes
async def test_routes(served: tuple[AdminServer, Source, str, int]) -> None:
    _, _, host, port = served
    assert await get_json(host, port, "/health") == (
        200,
        {"healthy": True, "problems": [], "state": "writable"},
    )
    assert await get_json(host, port, "/ready") == (200, {"ready": True, "state": "writable"})
    status, state = await get_json(host, port, "/state")
    assert status == 200
    assert state["bookie_id"] == "b-1"
    samples = await scrape(host, port)
    assert samples['bookie_requests_total{op="add_entry"}'] == 300
    status, headers, body = await http_get(host, port, "/metrics", method="HEAD")
    assert (status, body) == (200, b"")
    assert headers["content-type"].startswith("text/plain")
    assert int(headers["content-length"]) > 1000
    assert (await http_get(host, port, "/"))[0] == 200


async def test_health_and_ready_follow_the_snapshot(served: tuple[AdminServer, Source, str, int]) -> None:
    _, source, host, port = served
    source.snap = dataclasses.replace(source.snap, journal_failed="OSError(5)", state=BookieState.FAILED)
    status, body = await get_json(host, port, "/health")
    assert status == 503
    assert body["healthy"] is False
    assert body["problems"][0].startswith("journal failed")
    source.snap = dataclasses.replace(make_snapshot(), state=BookieState.STARTING, ready=False)
    assert await get_json(host, port, "/ready") == (503, {"ready": False, "state": "starting"})
    assert (await get_json(host, port, "/health"))[0] == 200  # liveness: recovering is healthy


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"GET /nope HTTP/1.1\r\n\r\n", 404),
        (b"garbage\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # a TLS hello, roughly
        (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\n" + b"X-Many: a\r\n" * 1000 + b"\r\n", 431),
        (b"GET / HTTP/1.1\r\nHost: x", 400),  # closed inside the head
    ],
)
async def test_bad_requests(
    served: tuple[AdminServer, Source, str, int], request_bytes: bytes, status: int
) -> None:
    _, _, host, port = served
    got, headers, _ = await http_raw(host, port, request_bytes)
    assert got == status
    assert headers["connection"] == "close"
    if status == 405:
        assert headers["allow"] == "GET, HEAD"
    assert (await get_json(host, port, "/health"))[0] == 200  # and the server goes on


async def test_eof_before_a_request_is_closed_quietly(served: tuple[AdminServer, Source, str, int]) -> None:
    _, _, host, port = served
    reader, writer = await asyncio.open_connection(host, port)
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_slow_loris_gets_408_and_is_closed(
    served: tuple[AdminServer, Source, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, host, port = served
    monkeypatch.setattr(admin, "REQUEST_TIMEOUT_S", 0.3)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /hea")
    data = await asyncio.wait_for(reader.read(), 5)
    assert data.startswith(b"HTTP/1.1 408 ")
    writer.close()


async def test_connection_limit(served: tuple[AdminServer, Source, str, int]) -> None:
    server, _, host, port = served
    idle = [await asyncio.open_connection(host, port) for _ in range(admin.CONNECTIONS_MAX)]
    for _, writer in idle:
        writer.write(b"GET /")  # started, not finished: each holds a slot
    await asyncio.sleep(0.2)
    reader, writer = await asyncio.open_connection(host, port)
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at accept
    writer.close()
    assert server.refused >= 1
    for _, idle_writer in idle:
        idle_writer.close()
    await asyncio.sleep(0.2)
    assert (await get_json(host, port, "/health"))[0] == 200


async def test_close_ends_open_connections() -> None:
    server = AdminServer(Source(), "127.0.0.1", 0)
    await server.start()
    assert server.address is not None
    reader, writer = await asyncio.open_connection(*server.address)
    writer.write(b"GET /")
    await asyncio.sleep(0.1)
    await asyncio.wait_for(server.close(), 5)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection(*server.address)


def test_state_json_is_serialisable() -> None:
    from bookie.metrics import state_json

    json.dumps(state_json(make_snapshot()))
