"""bookie.tarpit on real loopback sockets: refused connections are held unread, then reset (the
peer sees ECONNRESET, not a FIN), no more than the bounds per address and in total (beyond: the
caller resets at once), and closing the tarpit resets everything held at once."""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Iterator

import pytest

from bookie.tarpit import Tarpit, reset


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock
    sock.close()


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A client socket and the server's accepted end of it."""
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return client, server


async def _outcome(client: socket.socket, timeout_s: float = 5.0) -> str:
    """How the server's end went: "reset", "closed" (a FIN) or "open" (still held at the timeout)."""
    loop = asyncio.get_running_loop()
    client.setblocking(False)
    try:
        data = await asyncio.wait_for(loop.sock_recv(client, 1), timeout_s)
    except ConnectionResetError:
        return "reset"
    except TimeoutError:
        return "open"
    return "closed" if data == b"" else "data"


async def test_held_connections_are_reset_after_the_hold_in_order(listener: socket.socket) -> None:
    tarpit = Tarpit(hold_s=0.2, per_address_max=8, total_max=8)
    pairs = [_pair(listener) for _ in range(3)]
    for _, server in pairs:
        assert tarpit.hold("10.0.0.1", functools.partial(reset, server))
    assert tarpit.held == tarpit.held_total == 3
    assert await _outcome(pairs[0][0], timeout_s=0.05) == "open"  # held, unread, not closed yet
    assert [await _outcome(client) for client, _ in pairs] == ["reset"] * 3
    assert tarpit.held == 0
    assert tarpit.held_total == 3
    for client, _ in pairs:
        client.close()


async def test_bounds_per_address_and_in_total(listener: socket.socket) -> None:
    tarpit = Tarpit(hold_s=10.0, per_address_max=2, total_max=3)
    pairs = [_pair(listener) for _ in range(5)]
    held = [
        tarpit.hold(address, functools.partial(reset, server))
        for (_, server), address in zip(pairs, "aaabb", strict=True)
    ]
    assert held == [True, True, False, True, False]  # a's third: its bound; b's second: the total
    assert tarpit.held == 3
    tarpit.close()  # the server stops: everything held is reset at once
    assert [await _outcome(pairs[i][0]) for i in (0, 1, 3)] == ["reset"] * 3
    assert tarpit.held == 0
    assert tarpit.hold("a", functools.partial(reset, pairs[2][1]))  # room again
    tarpit.close()
    for client, server in pairs:
        client.close()
        server.close()
