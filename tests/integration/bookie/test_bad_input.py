"""Hostile and broken input: each case gets an error response or a closed connection, the bookie
keeps serving other clients, and its memory stays bounded."""

from __future__ import annotations

import asyncio
import struct
import time
from pathlib import Path

import msgpack
import pytest

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from bookkeeper_aio.protocol.framing import FrameDecoder
from tests.harness.bookie_proc import BookieProcess

from .wire import KEY, WireClient, entry_body

CLOSE_TIMEOUT_S = 5.0


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def packed(obj: object) -> bytes:
    return frame(msgpack.packb(obj, use_bin_type=True))


class Raw:
    """A bare TCP connection: write bytes, collect decoded responses until the bookie closes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()

    @classmethod
    async def connect(cls, bookie: BookieProcess) -> Raw:
        return cls(*await asyncio.open_connection(*bookie.address))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def responses(self, count: int, timeout_s: float = CLOSE_TIMEOUT_S) -> list[m.Response]:
        out: list[m.Response] = []
        async with asyncio.timeout(timeout_s):
            while len(out) < count:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.decoder.feed(data)
                while (body := self.decoder.next_frame()) is not None:
                    out.append(m.decode_response(body))
        return out

    async def raw_responses(self, count: int, timeout_s: float = CLOSE_TIMEOUT_S) -> list[list[object]]:
        """Responses as plain msgpack arrays (an error answer to an unknown op does not decode)."""
        out: list[list[object]] = []
        async with asyncio.timeout(timeout_s):
            while len(out) < count:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.decoder.feed(data)
                while (body := self.decoder.next_frame()) is not None:
                    out.append(msgpack.unpackb(body))
        return out

    async def closed_by_peer(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                while await self.reader.read(65536):
                    pass
            return True
        except (TimeoutError, ConnectionResetError):
            return False

    def close(self) -> None:
        self.writer.close()


def rss_kib(bookie: BookieProcess) -> int:
    assert bookie.proc is not None
    for line in Path(f"/proc/{bookie.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def still_serving(bookie: BookieProcess, entry_id: int) -> None:
    client = await WireClient.connect(*bookie.address)
    response = await client.add(1000, entry_id, b"alive")
    assert response.status == StatusCode.EOK
    assert (await client.read(1000, entry_id)).body == entry_body(1000, entry_id, b"alive")
    client.close()


CLOSING_CASES = {
    "frame_over_max_size": struct.pack(">I", 2**31) + b"x" * 100,
    "not_msgpack": frame(b"\xc1\xc1\xc1 not msgpack"),
    "array_length_bomb": frame(b"\xdd\xff\xff\xff\xff" + b"\x01" * 16),
    "str_length_bomb": frame(b"\xdb\xff\xff\xff\xf0abc"),
    "map_length_bomb": frame(b"\xdf\xff\xff\xff\xff\x01\x02"),
    "deep_nesting": frame(b"\x91" * 100_000 + b"\x01"),
    "not_an_array": packed({"op": 1}),
    "negative_request_id": packed([1, -1, 1, 0, 0, KEY, b"x" * 40]),
    "request_id_not_int": packed([1, "seven", 1, 0, 0, KEY, b"x" * 40]),
}


@pytest.mark.parametrize("case", sorted(CLOSING_CASES))
async def test_unrecoverable_frames_close_the_connection(bookie: BookieProcess, case: str) -> None:
    raw = await Raw.connect(bookie)
    await raw.send(CLOSING_CASES[case])
    assert await raw.closed_by_peer(), f"{case}: connection left open"
    raw.close()
    await still_serving(bookie, 0)


ERROR_CASES = {
    "unknown_op": ([99, 5], 5),
    "wrong_field_type": ([1, 6, "ledger", 0, 0, KEY, b"x" * 40], 6),
    "negative_ledger_id": ([1, 7, -1, 0, 0, KEY, b"x" * 40], 7),
    "ledger_id_2_pow_64_minus_1": ([1, 8, 2**64 - 1, 0, 0, KEY, b"x" * 40], 8),
    "entry_id_negative": ([1, 9, 1, -5, 0, KEY, b"x" * 40], 9),
    "too_few_fields": ([2, 10, 1], 10),
    "bool_as_int": ([4, 11, True], 11),
    "body_shorter_than_header": ([1, 12, 1, 0, 0, KEY, b"short"], 12),
    "huge_timeout": ([2, 13, 1, 0, 4, None, -1, 10**9], 13),
}


RAW_ERROR_CASES = {  # docs/protocol.md §1: readable head -> EBADREQ, the connection stays
    "trailing_bytes": (msgpack.packb([4, 14, 1]) + b"\x00", 4, 14),
    "trailing_bytes_after_an_add": (
        msgpack.packb([1, 15, 1, 0, 0, KEY, entry_body(1, 0, b"x")], use_bin_type=True) + b"\xc0",
        1,
        15,
    ),
    "invalid_utf8_in_hello": (b"\x94\x00\x10\x01\xa2\xff\xfe", 0, 16),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES) + sorted(RAW_ERROR_CASES))
async def test_bad_requests_get_ebadreq_and_the_connection_lives(bookie: BookieProcess, case: str) -> None:
    if case in RAW_ERROR_CASES:
        body, op, request_id = RAW_ERROR_CASES[case]
        request = frame(body)
    else:
        obj, request_id = ERROR_CASES[case]
        op, request = obj[0], packed(obj)
    raw = await Raw.connect(bookie)
    await raw.send(request)
    (response,) = await raw.raw_responses(1)
    assert response[:3] == [op, request_id, StatusCode.EBADREQ], response  # op echoed (protocol.md §8)
    await raw.send(m.encode(m.ReadLacRequest(99, 1)))  # the same connection still works
    (after,) = await raw.responses(1)
    assert after.request_id == 99
    raw.close()


async def test_duplicate_request_id_in_flight_is_rejected(bookie: BookieProcess) -> None:
    raw = await Raw.connect(bookie)
    first = m.encode(m.AddEntryRequest(5, 1, 0, 0, KEY, entry_body(1, 0, b"a")))
    second = m.encode(m.AddEntryRequest(5, 1, 1, 0, KEY, entry_body(1, 1, b"b")))
    await raw.send(first + second)  # one write: the first is still waiting for its fsync
    responses = await raw.responses(2)
    assert sorted(r.status for r in responses) == [StatusCode.EOK, StatusCode.EBADREQ]
    raw.close()


async def test_truncated_frame_is_closed_at_the_read_deadline(bookie: BookieProcess) -> None:
    raw = await Raw.connect(bookie)
    await raw.send(struct.pack(">I", 100) + b"\x97\x01")  # promises 100 bytes, sends 2
    started = time.monotonic()
    assert await raw.closed_by_peer()
    assert time.monotonic() - started < 4.0  # deadline is 1.5 s in the fixture (at most 2x)
    raw.close()
    await still_serving(bookie, 0)


async def test_slow_loris_is_cut_while_others_are_served(bookie: BookieProcess) -> None:
    data = m.encode(m.ReadLacRequest(1, 1))
    raw = await Raw.connect(bookie)
    started = time.monotonic()
    closed = False
    for i, byte in enumerate(data):
        try:
            await raw.send(bytes([byte]))
        except ConnectionError:
            closed = True
            break
        await still_serving(bookie, i)  # another client is served meanwhile
        await asyncio.sleep(0.6)
        if raw.reader.at_eof():
            closed = True
            break
    closed = closed or await raw.closed_by_peer(1.0)
    assert closed, "a client dribbling one byte every 0.6 s was never cut off"
    assert time.monotonic() - started < 6.0
    raw.close()


async def test_memory_stays_bounded_under_bombs(bookie: BookieProcess) -> None:
    await still_serving(bookie, 0)
    before = rss_kib(bookie)
    for _ in range(20):
        for data in CLOSING_CASES.values():
            raw = await Raw.connect(bookie)
            await raw.send(data)
            await raw.closed_by_peer()
            raw.close()
    # Many half-sent large frames at once: buffered bytes are bounded by what was sent.
    raws = [await Raw.connect(bookie) for _ in range(50)]
    for raw in raws:
        await raw.send(struct.pack(">I", 5 * 1024 * 1024 - 1) + b"\x00" * 1000)
    await asyncio.sleep(0.3)
    grown_kib = rss_kib(bookie) - before
    for raw in raws:
        raw.close()
    assert grown_kib < 64 * 1024, f"bookie RSS grew by {grown_kib} KiB"
    await still_serving(bookie, 1)


async def test_too_many_in_flight_pauses_reading_not_memory(tmp_path: Path) -> None:
    proc = BookieProcess(tmp_path / "b", bookie_id="b", extra_args=["--in-flight-per-connection-max", "8"])
    proc.start()
    client = await WireClient.connect(*proc.address)
    acks = await asyncio.gather(*(client.add(1, i, b"x" * 100) for i in range(2000)))
    assert {a.status for a in acks} == {StatusCode.EOK}
    client.close()
    proc.cleanup()


async def test_journal_backlog_pauses_every_connection_then_resumes(tmp_path: Path) -> None:
    proc = BookieProcess(tmp_path / "b", bookie_id="b", extra_args=["--journal-queue-bytes-max", "65536"])
    proc.start()
    clients = [await WireClient.connect(*proc.address) for _ in range(3)]
    acks = await asyncio.gather(
        *(client.add(10 + n, i, b"y" * 1024) for n, client in enumerate(clients) for i in range(1000))
    )
    assert {a.status for a in acks} == {StatusCode.EOK}
    for client in clients:
        client.close()
    assert "bookie.journal_pressure" in proc.log_path.read_text()
    proc.cleanup()


async def test_total_in_flight_limit_pauses_every_connection_then_resumes(tmp_path: Path) -> None:
    proc = BookieProcess(tmp_path / "b", bookie_id="b", extra_args=["--in-flight-total-max", "16"])
    proc.start()
    clients = [await WireClient.connect(*proc.address) for _ in range(3)]
    acks = await asyncio.gather(
        *(client.add(20 + n, i, b"z" * 100) for n, client in enumerate(clients) for i in range(500))
    )
    assert {a.status for a in acks} == {StatusCode.EOK}
    late = await WireClient.connect(*proc.address)  # a connection opened after all that still works
    assert (await late.add(99, 0, b"late")).status == StatusCode.EOK
    for client in [*clients, late]:
        client.close()
    assert '"over": true' in proc.log_path.read_text()
    proc.cleanup()
