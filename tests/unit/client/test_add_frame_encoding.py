"""The CRC32C ADD frame fast path (``AddFrameEncoder.crc32c_frame`` of a handle) produces exactly
the bytes of ``messages.encode(AddEntryRequest(...))`` over ``EntryCodec.encode`` but for its ids
written as msgpack uint32 (:func:`uint32_ids_frame`), and decodes to that request; the resend paths
(``encode_add_request`` over the body cut back out of that frame, and ``add_request_with_id`` of the
frame itself) decode to it too — around every msgpack length boundary of the body and for ids at
every msgpack integer width (and LACs down to -1)."""

from __future__ import annotations

import itertools

import pytest

from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.context import ClientContext, StaticDirectory
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.client.placement import RandomPlacement
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import ID_MAX, REQUEST_ID_MAX, AddFlag
from bookkeeper_aio.protocol.digest import DIGEST_BYTES, HEADER_BYTES, DigestType, EntryCodec, master_key
from bookkeeper_aio.protocol.messages import encode_add_request
from metadata.ledger_manager import LedgerManager, VersionedLedger
from metadata.ledger_metadata import LedgerMetadata
from metadata.memory import MemoryStore
from tests.unit.protocol.test_client_fast_paths import uint32_ids_frame

PREFIX = HEADER_BYTES + DIGEST_BYTES[DigestType.CRC32C]  # entry body = prefix + payload

# Every msgpack unsigned width: positive fixint, uint8, uint16, uint32, uint64 (and the edges).
UINT_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, ID_MAX]
# The LAC and length live in the struct-packed entry header (">q"): -1 and the extremes too.
LAC_EDGES = [-1, 0, 127, 128, 65536, 1 << 32, ID_MAX]

# Payload sizes: the generic msgpack boundaries (fixstr/str8/str16/str32 and bin8/16/32 lengths)
# and the sizes that put the *body* (payload + 36 bytes of header and digest), which is what the
# frame carries as one bin, on either side of bin8/bin16/bin32.
GENERIC_SIZES = [0, 1, 31, 32, 255, 256, 65535, 65536, 65537]
BODY_EDGES = [255, 256, 65535, 65536]
PAYLOAD_SIZES = sorted(
    {*GENERIC_SIZES, *(edge - PREFIX + d for edge in BODY_EDGES for d in (-1, 0, 1))} - {-1}
)


async def handle_for(ledger_id: int, password: bytes = b"pw") -> LedgerHandle:
    """A real LedgerHandle (its constructor computes the packed ledger id and the add tail)."""
    config = ClientConfig()
    md = LedgerMetadata.new(ledger_id, ["b0:1", "b1:1", "b2:1"], write_quorum=2, ack_quorum=2)
    ctx = ClientContext(
        config=config,
        pool=BookiePool(config),
        ledgers=LedgerManager(MemoryStore(), "/t"),
        directory=StaticDirectory([]),
        placement=RandomPlacement(),
    )
    return LedgerHandle(ctx, VersionedLedger(md, 0), password, master_key(password))


def reference(ledger_id: int, rid: int, eid: int, lac: int, length: int, payload: bytes, pw: bytes) -> bytes:
    body = EntryCodec(DigestType.CRC32C, pw).encode(ledger_id, eid, lac, length, payload)
    return m.encode(m.AddEntryRequest(rid, ledger_id, eid, int(AddFlag.NONE), master_key(pw), body))


def encode_crc32c(
    lh: LedgerHandle, rid: int, eid: int, lac: int, length: int, payload: bytes
) -> tuple[bytes, int]:
    """The handle's frame and where its entry body starts (found by the generic decoder)."""
    frame = lh._frames.crc32c_frame(rid, eid, lac, length, payload)
    body = m.decode_request(frame[4:]).body  # type: ignore[union-attr]
    return frame, len(frame) - len(body)


def expected_frame(
    ledger_id: int, rid: int, eid: int, lac: int, length: int, payload: bytes, pw: bytes
) -> bytes:
    body = EntryCodec(DigestType.CRC32C, pw).encode(ledger_id, eid, lac, length, payload)
    return uint32_ids_frame(rid, ledger_id, eid, master_key(pw), body)


def check_frame(lh: LedgerHandle, rid: int, eid: int, lac: int, length: int, payload: bytes) -> None:
    generic = reference(lh.id, rid, eid, lac, length, payload, b"pw")
    frame, body_start = encode_crc32c(lh, rid, eid, lac, length, payload)
    assert frame == expected_frame(lh.id, rid, eid, lac, length, payload, b"pw"), (lh.id, rid, eid, lac)
    body = frame[body_start:]
    assert len(body) == PREFIX + len(payload)
    assert body == generic[-len(body) :]  # the entry body itself is the generic one
    # A bookie decodes it to the request we meant (the bookie's fast path).
    request = m.AddEntryRequest(rid, lh.id, eid, int(AddFlag.NONE), master_key(b"pw"), body)
    assert m.decode_request(frame[4:]) == request
    # The resend paths: the body cut back out and re-framed under a new request id, and the
    # writer's own (the frame's request id replaced).
    resent = encode_add_request(rid + 1, lh.id, eid, AddFlag.NONE, master_key(b"pw"), body)
    assert resent == reference(lh.id, rid + 1, eid, lac, length, payload, b"pw")
    again = m.add_request_with_id(frame, rid + 1)
    assert m.decode_request(again[4:]) == request._replace(request_id=rid + 1)


@pytest.mark.parametrize("size", PAYLOAD_SIZES)
async def test_crc32c_frame__expected_bytes_around_every_length_boundary(size: int) -> None:
    lh = await handle_for(12345)
    payload = bytes(i % 251 for i in range(size))
    check_frame(lh, rid=77, eid=3, lac=2, length=1000 + size, payload=payload)
    lh.abort()


async def test_crc32c_frame__expected_bytes_at_body_size_bin_boundaries_exactly() -> None:
    lh = await handle_for(9)
    for edge in BODY_EDGES:
        for body_len in (edge - 1, edge, edge + 1):
            payload = b"\xa5" * (body_len - PREFIX)
            frame, body_start = encode_crc32c(lh, 1, 0, -1, len(payload), payload)
            assert len(frame) - body_start == body_len
            assert frame == expected_frame(9, 1, 0, -1, len(payload), payload, b"pw")
    lh.abort()


@pytest.mark.parametrize("ledger_id", UINT_EDGES)
async def test_crc32c_frame__expected_bytes_for_every_id_width(ledger_id: int) -> None:
    lh = await handle_for(ledger_id)
    rids = [*UINT_EDGES, REQUEST_ID_MAX - 1]  # rid + 1 is used for the resend check
    for rid, eid in itertools.product(rids, UINT_EDGES):
        check_frame(lh, rid, eid, lac=-1, length=0, payload=b"")
    for eid, lac, length in itertools.product(UINT_EDGES, LAC_EDGES, LAC_EDGES[1:]):
        check_frame(lh, 1, eid, lac, length, b"x" * 40)
    lh.abort()


async def test_crc32c_frame__other_passwords_change_only_the_master_key() -> None:
    for password in (b"", b"pw", b"\x00" * 100):
        lh = await handle_for(5, password)
        frame, _ = encode_crc32c(lh, 300, 70000, 69999, 5, b"hello")
        assert frame == expected_frame(5, 300, 70000, 69999, 5, b"hello", password)
        lh.abort()
