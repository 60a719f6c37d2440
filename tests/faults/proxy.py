"""A fault proxy: an asyncio TCP forwarder between one client and one bookie, with faults.

Each `FaultProxy` listens on its own loopback port and forwards every accepted connection to its
target. Its `mode` applies to every connection, current and future, and can be changed at any time:

- ``pass``: forward as is;
- ``delay``: hold each chunk ``delay_s`` before forwarding it (both directions, order kept);
- ``throttle``: at most ``rate_bytes_per_s`` per direction;
- ``blackhole``: read and drop everything, both directions (a partition: connections stay open);
- ``blackhole_up`` / ``blackhole_down``: drop client->bookie / bookie->client only (``drop
  responses``: the requests arrive, the answers never do);
- ``reset``: close every connection at once (and each new one as it comes);
- ``cut_after``: forward ``cut_after_bytes`` more bytes client->bookie on each connection, then
  close it (a torn request).

Counters (`bytes_up`, `bytes_down`, `connections`) let a test check that traffic really went
through the proxy. It runs in the test's event loop; `close()` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from dataclasses import dataclass

CHUNK_BYTES = 64 * 1024


class Mode(enum.Enum):
    PASS = "pass"
    DELAY = "delay"
    THROTTLE = "throttle"
    BLACKHOLE = "blackhole"
    BLACKHOLE_UP = "blackhole_up"
    BLACKHOLE_DOWN = "blackhole_down"
    RESET = "reset"
    CUT_AFTER = "cut_after"


@dataclass
class Settings:
    mode: Mode = Mode.PASS
    delay_s: float = 0.0
    rate_bytes_per_s: float = 0.0
    cut_after_bytes: int = 0


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; see the module docstring for the modes."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.settings = Settings()
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "start() first"
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    def set(self, mode: Mode | str, **settings: float) -> None:
        """Switch every connection to ``mode`` (``delay_s=``, ``rate_bytes_per_s=``,
        ``cut_after_bytes=`` as the mode needs)."""
        self.settings = Settings(Mode(mode), **settings)  # type: ignore[arg-type]
        if self.settings.mode is Mode.RESET:
            for link in list(self._links):
                link.close()
        if self.settings.mode is Mode.CUT_AFTER:
            for link in self._links:
                link.budget_up = int(self.settings.cut_after_bytes)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for link in list(self._links):
            link.close()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.settings.mode is Mode.RESET:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()  # the bookie is down: the client sees a refused/closed connection
            return
        link = _Link(self, writer, up_writer)
        if self.settings.mode is Mode.CUT_AFTER:
            link.budget_up = int(self.settings.cut_after_bytes)
        self._links.add(link)
        try:
            await asyncio.gather(
                link.pump(reader, up_writer, up=True), link.pump(up_reader, writer, up=False)
            )
        finally:
            link.close()
            self._links.discard(link)


class _Link:
    """One client connection and its bookie connection."""

    def __init__(self, proxy: FaultProxy, client: asyncio.StreamWriter, bookie: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client = client
        self.bookie = bookie
        self.budget_up: int | None = None

    def close(self) -> None:
        for writer in (self.client, self.bookie):
            with contextlib.suppress(Exception):
                writer.close()

    async def pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, up: bool) -> None:
        try:
            while data := await source.read(CHUNK_BYTES):
                await self._forward(data, sink, up=up)
        except (ConnectionError, OSError):
            pass
        finally:
            self.close()

    async def _forward(self, data: bytes, sink: asyncio.StreamWriter, *, up: bool) -> None:
        settings = self.proxy.settings
        mode = settings.mode
        if (
            mode is Mode.BLACKHOLE
            or (mode is Mode.BLACKHOLE_UP and up)
            or (mode is Mode.BLACKHOLE_DOWN and not up)
        ):
            return
        if mode is Mode.RESET:
            self.close()
            return
        if mode is Mode.DELAY:
            await asyncio.sleep(settings.delay_s)
        elif mode is Mode.THROTTLE and settings.rate_bytes_per_s > 0:
            await asyncio.sleep(len(data) / settings.rate_bytes_per_s)
        if up and self.budget_up is not None:
            data = data[: self.budget_up]
            self.budget_up -= len(data)
            if not data or self.budget_up <= 0:
                if data:
                    sink.write(data)
                    self.proxy.bytes_up += len(data)
                    with contextlib.suppress(ConnectionError, OSError):
                        await sink.drain()
                self.close()
                return
        sink.write(data)
        if up:
            self.proxy.bytes_up += len(data)
        else:
            self.proxy.bytes_down += len(data)
        await sink.drain()
