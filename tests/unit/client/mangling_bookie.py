"""A fake bookie whose ADD answers a test can replace, drop or keep back (client unit tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import msgpack
import pytest

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.framing import LENGTH
from tests.harness.fake_bookie import FakeBookie, FakeCluster, _Conn

Mangle = Callable[[m.AddEntryResponse, bytes], list[bytes]]
"""``mangle(ack, frame)`` -> the frames to send instead of ``frame`` (an ADD answer, any status)."""


class ManglingBookie(FakeBookie):
    """``mangle`` rewrites each ADD answer; ``send_raw`` sends frames on the latest connection
    (an answer kept back by ``mangle``, arriving late)."""

    def __init__(self, add_acks: bool = False) -> None:
        super().__init__(add_acks=add_acks)
        self.mangle: Mangle | None = None
        self._last_conn: _Conn | None = None

    def _answer(self, conn: _Conn, frame: bytes) -> None:
        self._last_conn = conn
        if self.mangle is not None:
            response = m.decode_response(frame[4:])
            if isinstance(response, m.AddEntryResponse):
                for out in self.mangle(response, frame):
                    super()._answer(conn, out)
                return
        super()._answer(conn, frame)

    def send_raw(self, frames: Iterable[bytes]) -> None:
        assert self._last_conn is not None, "nothing was answered yet"
        for frame in frames:
            self._last_conn.send(frame)


def raw_frame(obj: Any) -> bytes:
    """Any msgpack value as a frame (length prefix included), valid or not as a message."""
    body = msgpack.packb(obj, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def mangling(cluster: FakeCluster, bookie_id: str) -> ManglingBookie:
    bookie = cluster.by_id(bookie_id)
    assert isinstance(bookie, ManglingBookie)
    return bookie


async def mangling_cluster(n: int, add_acks: bool = False) -> AsyncIterator[FakeCluster]:
    fakes = FakeCluster(0)
    fakes.bookies = [ManglingBookie(add_acks) for _ in range(n)]
    async with fakes:
        yield fakes


@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    """Overrides conftest's ``cluster``: four mangling bookies (import it into a test module)."""
    async for fakes in mangling_cluster(4):
        yield fakes


class EventLog:
    """A LedgerHandle event listener that records ``(event, value)`` pairs."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __call__(self, event: str, value: int) -> None:
        self.events.append((event, value))

    def saw(self, event: str) -> bool:
        return any(e == event for e, _ in self.events)
