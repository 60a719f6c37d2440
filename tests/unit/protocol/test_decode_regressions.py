"""Decoder regressions: inputs that once crashed or misled a decoder, each kept as a case."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import FRAME_BYTES_MAX, OpCode, ReadFlag
from bookkeeper_aio.protocol.errors import ProtocolError, RequestTooComplex


@pytest.mark.parametrize("op", [True, 1.0])
def test_add_fast_path_refuses_a_non_int_op(op: object) -> None:
    # ``True == 1`` and ``1.0 == 1``: the fast path used to take these for ADD_ENTRY.
    with pytest.raises(ProtocolError):
        m.decode_request(msgpack.packb([op, 1, 2, 3, 0, b"k", b"body"]))
    with pytest.raises(ProtocolError):
        m.decode_response(msgpack.packb([op, 1, 0, None, 2, 3]))


@pytest.mark.parametrize(
    "raw",
    [
        [int(OpCode.READ_ENTRY), 7, 5, -1, int(ReadFlag.FENCE_LEDGER), None, -1, 0],
        [int(OpCode.BATCH_READ), 7, 5, 0, 10, 1000, int(ReadFlag.FENCE_LEDGER), None],
    ],
)
def test_fence_without_master_key_is_a_bad_request(raw: list[object]) -> None:
    with pytest.raises(ProtocolError) as info:
        m.decode_request(msgpack.packb(raw))
    assert (info.value.request_id, info.value.op) == (7, raw[0])


def test_fence_with_master_key_and_plain_read_without_one_are_fine() -> None:
    fence = m.ReadEntryRequest(7, 5, -1, int(ReadFlag.FENCE_LEDGER), b"k" * 32)
    assert m.decode_request(m.encode(fence)[4:]) == fence
    plain = m.ReadEntryRequest(7, 5, 3)
    assert m.decode_request(m.encode(plain)[4:]) == plain


def _tree(depth: int, fanout: int) -> bytes:
    """msgpack bytes of a ``fanout``-ary tree of arrays ``depth`` levels deep (leaves empty)."""
    node = b"\x90"
    for _ in range(depth):
        node = bytes([0xDC]) + fanout.to_bytes(2, "big") + node * fanout
    return node


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        # [op, rid, <5 MiB of empty arrays>]: ~5 million lists before the fix (~320 MiB, seconds)
        (
            b"\x93\x02\x01\xdd"
            + (FRAME_BYTES_MAX - 16).to_bytes(4, "big")
            + b"\x90" * (FRAME_BYTES_MAX - 16),
            "flat",
        ),
        # the same through arrays of 60 items each, under any per-array length limit
        (b"\x93\x02\x01" + _tree(3, 60), "tree of small arrays"),
        # trailing fields are ignored, but not allocated without bound: ~1.7 million str objects
        (
            b"\xdd"
            + (FRAME_BYTES_MAX // 3).to_bytes(4, "big")
            + b"\x02\x01"
            + b"\xa2ab" * (FRAME_BYTES_MAX // 3 - 2),
            "strings",
        ),
    ],
)
def test_object_bomb_request_is_refused_without_allocating(raw: bytes, why: str) -> None:
    assert len(raw) <= FRAME_BYTES_MAX + 8
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            m.decode_request(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024, f"{why}: decoding allocated {peak} bytes"


def _nested(op: int) -> bytes:
    """54 KB, under the 64 KiB that once went uncounted: a request shaped as ``op``'s whose last
    field is a tree of 50,625 empty arrays of 15 (6-8 ms of the event loop to build, answered
    EBADREQ on a connection kept open)."""
    head = [int(op), 7, 1, 0, 0, b"k"] if op == OpCode.ADD_ENTRY else [int(op), 7, 1]
    return bytes([0x90 + len(head) + 1]) + b"".join(msgpack.packb(f) for f in head) + _tree15(4)


def _tree15(depth: int) -> bytes:
    return b"\x90" if depth == 0 else b"\x9f" + _tree15(depth - 1) * 15


def test_a_small_frame_of_nested_arrays_is_refused_before_it_is_built() -> None:
    raw = _nested(OpCode.READ_ENTRY)
    assert 50_000 < len(raw) < m.PLAIN_REQUEST_BYTES_MAX
    tracemalloc.start()
    try:
        with pytest.raises(RequestTooComplex):  # no request id: the bookie closes the connection
            m.decode_request(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, f"decoding allocated {peak} bytes"  # 50,625 lists: ~3 MiB
    # shaped as an ADD_ENTRY the add shortcut unpacks it whole first (it counts nothing); the
    # generic decode then refuses it the same way (the bookie charges it by its size)
    with pytest.raises(RequestTooComplex):
        m.decode_request(_nested(OpCode.ADD_ENTRY))


def test_extension_values_count_as_arrays_and_maps() -> None:
    """An extension value costs ~0.5 µs to build (3 bytes on the wire): counted with the arrays
    and maps, the most a frame builds stays bounded (trailing fields are not inspected otherwise)."""
    ext = msgpack.ExtType(1, b"x")
    under = msgpack.packb([int(OpCode.READ_LAC), 3, 10, None, *[ext] * 59])
    assert len(under) > m.UNCOUNTED_REQUEST_BYTES_MAX
    assert m.decode_request(under) == m.ReadLacRequest(3, 10)
    over = msgpack.packb([int(OpCode.READ_LAC), 3, 10, None, [ext] * 40, [ext] * 40])
    with pytest.raises(RequestTooComplex):
        m.decode_request(over)


def test_request_trailing_fields_still_ignored_within_the_limit() -> None:
    raw = msgpack.packb([int(OpCode.READ_LAC), 3, 10, None, "future", [1, 2], {"k": 1}])
    assert m.decode_request(raw) == m.ReadLacRequest(3, 10)
    big = msgpack.packb([int(OpCode.ADD_ENTRY), 3, 10, 0, 0, b"k", b"x" * 200_000, [1, 2], {"k": [3]}])
    assert m.decode_request(big) == m.AddEntryRequest(3, 10, 0, 0, b"k", b"x" * 200_000)
    with pytest.raises(ProtocolError):
        m.decode_request(msgpack.packb([int(OpCode.READ_LAC), 3, 10, *range(m.REQUEST_ITEMS_MAX)]))


SECRET = "S3CRET-token-of-tenant-A"


@pytest.mark.parametrize(
    ("raw", "field", "shown"),
    [
        # a master key one byte over MASTER_KEY_BYTES_MAX, and a key sent as text
        (
            [int(OpCode.ADD_ENTRY), 7, 5, 0, 0, SECRET.encode() * 3, b"body"],
            "master_key",
            "bytes of length 72",
        ),
        ([int(OpCode.FORCE_LEDGER), 7, 5, SECRET], "master_key", f"str of length {len(SECRET)}"),
        # an AUTH token as text instead of bin, and one over AUTH_PAYLOAD_BYTES_MAX
        ([int(OpCode.AUTH), 7, "token", SECRET], "payload", f"str of length {len(SECRET)}"),
        ([int(OpCode.AUTH), 7, "token", SECRET.encode() * 700], "payload", "bytes of length 16800"),
    ],
)
def test_a_rejected_key_or_token_is_not_echoed(raw: list[object], field: str, shown: str) -> None:
    """The message of a ProtocolError goes to the bookie's log and back to the peer in its EBADREQ:
    a rejected key's or token's value is described (type and length), never copied."""
    with pytest.raises(ProtocolError) as info:
        m.decode_request(msgpack.packb(raw, use_bin_type=True))
    message = str(info.value)
    assert f"bad value for {field}" in message
    assert shown in message
    assert SECRET[:8] not in message
    assert SECRET.encode()[:8].hex() not in message


def test_other_rejected_values_are_still_shown() -> None:
    with pytest.raises(ProtocolError, match="bad value for ledger_id: 'not-an-id'"):
        m.decode_request(msgpack.packb([int(OpCode.FORCE_LEDGER), 7, "not-an-id", b"k" * 32]))
