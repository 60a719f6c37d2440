"""A minimal async wire client for bookie integration tests (not the library's client).

Requests are matched to responses by id; ``send_raw`` writes arbitrary bytes for bad-input tests.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
from typing import Any

import metadata
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, ReadFlag
from bookkeeper_aio.protocol.digest import EntryCodec
from bookkeeper_aio.protocol.framing import FrameDecoder
from metadata.ledger_metadata import LedgerMetadata

KEY = b"K" * 32
CODEC = EntryCodec("crc32c")


async def known_ledgers(url: str, *ledger_ids: int) -> None:
    """Create (key format 1) metadata for ``ledger_ids``: a bookie with metadata creates no record
    for a ledger metadata does not know (docs/bookie.md, *Ledger keys*)."""
    async with metadata.connect(url) as conn:
        manager = metadata.LedgerManager(conn.store, conn.root)
        for ledger_id in ledger_ids:
            md = LedgerMetadata.new(ledger_id, ["b0"], write_quorum=1, ack_quorum=1)
            await manager.create_metadata(md)


def entry_body(ledger_id: int, entry_id: int, payload: bytes, lac: int | None = None) -> bytes:
    return CODEC.encode(ledger_id, entry_id, entry_id - 1 if lac is None else lac, 0, payload)


class WireClient(asyncio.Protocol):
    def __init__(self) -> None:
        self.decoder = FrameDecoder()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count(1)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.unmatched: list[Any] = []
        self.add_acks: list[list[int]] = []
        """The request ids of each ADD_ACKS response received (each id's future gets an EOK
        AddEntryResponse with the ledger and entry ids left 0)."""

    @classmethod
    async def connect(cls, host: str, port: int, tls: ssl.SSLContext | None = None) -> WireClient:
        loop = asyncio.get_running_loop()
        if tls is None:
            _, client = await loop.create_connection(cls, host, port)
        else:
            _, client = await loop.create_connection(cls, host, port, ssl=tls, server_hostname=host)
        return client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        while (frame := self.decoder.next_frame()) is not None:
            response = m.decode_response(frame)
            if isinstance(response, m.AddAcksResponse):
                self.add_acks.append(response.request_ids)
                for rid in response.request_ids:
                    waiter = self.pending.pop(rid, None)
                    assert waiter is not None, f"ADD_ACKS names {rid}, not pending"
                    waiter.set_result(m.AddEntryResponse(rid, 0))
                continue
            future = self.pending.pop(response.request_id, None)
            if future is None or future.done():
                self.unmatched.append(response)
            else:
                future.set_result(response)

    def connection_lost(self, exc: Exception | None) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ConnectionError("connection lost"))
        if not self.closed.done():
            self.closed.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def send_raw(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def request(self, make: Any, *fields: Any, request_id: int | None = None) -> asyncio.Future[Any]:
        rid = next(self.ids) if request_id is None else request_id
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.closed.done():
            future.set_exception(ConnectionError("connection lost"))
            return future
        self.pending[rid] = future
        self.send_raw(m.encode(make(rid, *fields)))
        return future

    # ------------------------------------------------------------------ typed helpers
    def add(
        self, ledger_id: int, entry_id: int, payload: bytes, *, lac: int | None = None,
        key: bytes = KEY, recovery: bool = False,
    ) -> asyncio.Future[Any]:  # fmt: skip
        flags = AddFlag.RECOVERY_ADD if recovery else 0
        body = entry_body(ledger_id, entry_id, payload, lac)
        return self.request(m.AddEntryRequest, ledger_id, entry_id, int(flags), key, body)

    def read(
        self, ledger_id: int, entry_id: int, *, flags: int = 0, key: bytes | None = KEY,
        previous_lac: int = -1, timeout_ms: int = 0,
    ) -> asyncio.Future[Any]:  # fmt: skip
        return self.request(m.ReadEntryRequest, ledger_id, entry_id, flags, key, previous_lac, timeout_ms)

    def fence(self, ledger_id: int, entry_id: int = -1, key: bytes = KEY) -> asyncio.Future[Any]:
        return self.read(ledger_id, entry_id, flags=ReadFlag.FENCE_LEDGER, key=key)

    def read_lac(self, ledger_id: int, key: bytes | None = KEY) -> asyncio.Future[Any]:
        return self.request(m.ReadLacRequest, ledger_id, key)

    def write_lac(self, ledger_id: int, lac: int, key: bytes = KEY) -> asyncio.Future[Any]:
        return self.request(m.WriteLacRequest, ledger_id, key, lac)
