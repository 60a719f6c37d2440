"""The wire codec: round trips, byte-at-a-time framing, and hostile bytes that must only ever raise
ProtocolError (never anything else, never a hang or a big allocation)."""

from __future__ import annotations

import contextlib
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import (
    ADD_ACKS_IDS_MAX,
    BATCH_READ_STEP_MAX,
    FEATURES_MAX,
    FRAME_BYTES_MAX,
    ID_MAX,
    PROTOCOL_VERSION,
    OpCode,
    StatusCode,
)
from bookkeeper_aio.protocol.errors import FrameTooLarge, ProtocolError
from bookkeeper_aio.protocol.framing import FrameDecoder, encode_frame

ids = st.integers(0, ID_MAX)
features = st.integers(0, FEATURES_MAX)
rids = st.integers(0, (1 << 64) - 1)
lacs = st.integers(-1, ID_MAX)
keys = st.binary(max_size=64)


def _fence_has_key(msg: m.ReadEntryRequest | m.BatchReadRequest) -> bool:
    """FENCE_LEDGER (flag 1) without a master key is a bad request, not a round trip."""
    return not (msg.flags & 1 and msg.master_key is None)


requests = st.one_of(
    st.builds(m.HelloRequest, rids, st.integers(0, 0xFFFF), st.text(max_size=50), features),
    st.builds(m.AddEntryRequest, rids, ids, ids, st.integers(0, 1), keys, st.binary(max_size=2000)),
    st.builds(
        m.ReadEntryRequest, rids, ids, lacs, st.integers(0, 7), st.none() | keys, lacs, st.integers(0, 60000)
    ).filter(_fence_has_key),
    st.builds(m.ReadLacRequest, rids, ids),
    st.builds(m.WriteLacRequest, rids, ids, keys, lacs),
    st.builds(m.ForceLedgerRequest, rids, ids, keys),
    st.builds(
        m.BatchReadRequest,
        rids,
        ids,
        ids,
        st.integers(1, 10000),
        st.integers(1, FRAME_BYTES_MAX),
        st.integers(0, 1),
        st.none() | keys,
        st.integers(1, BATCH_READ_STEP_MAX),
    ).filter(_fence_has_key),
    st.builds(m.GetBookieInfoRequest, rids),
    st.builds(m.GetListOfEntriesRequest, rids, ids),
)
ok = st.just(0)
responses = st.one_of(
    st.builds(
        m.HelloResponse,
        rids,
        ok,
        st.none(),
        st.integers(0, 9),
        st.text(max_size=30),
        st.integers(1, 100),
        features,
    ),
    st.builds(m.AddAcksResponse, st.just(0), ok, st.none(), st.lists(rids, min_size=1, max_size=20)),
    st.builds(m.AddEntryResponse, rids, ok, st.none(), ids, ids),
    st.builds(m.ReadEntryResponse, rids, ok, st.none(), ids, lacs, st.none() | st.binary(max_size=500), lacs),
    st.builds(m.ReadLacResponse, rids, ok, st.none(), ids, lacs),
    st.builds(m.WriteLacResponse, rids, ok, st.none(), ids),
    st.builds(m.ForceLedgerResponse, rids, ok, st.none(), ids),
    st.builds(
        m.BatchReadResponse,
        rids,
        ok,
        st.none(),
        ids,
        ids,
        st.lists(st.binary(max_size=50), max_size=5),
        lacs,
        st.integers(1, BATCH_READ_STEP_MAX),
    ),
    st.builds(
        m.GetBookieInfoResponse,
        rids,
        ok,
        st.none(),
        st.dictionaries(st.text(max_size=10), st.integers(0, 2**40) | st.text(max_size=10), max_size=5),
    ),
    st.builds(
        m.GetListOfEntriesResponse,
        rids,
        ok,
        st.none(),
        ids,
        st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)).map(lambda t: sorted(t)), max_size=5),
    ),
)


@given(requests)
def test_request_round_trip(msg: m.Request) -> None:
    frame = m.encode(msg)
    assert m.decode_request(frame[4:]) == msg


@given(requests)
def test_request_frame_holds_its_op_at_byte_5(msg: m.Request) -> None:
    """The client keeps ``frame[5]`` as the op of a pending request (to check its answer's op):
    every request is a fixarray whose first item, the op, is a positive fixint."""
    assert m.encode(msg)[5] == m.REQUEST_OP[type(msg)]


@given(responses)
def test_response_round_trip(msg: m.Response) -> None:
    assert m.decode_response(m.encode(msg)[4:]) == msg


@given(st.binary(max_size=300))
@settings(max_examples=2000)
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    for decode in (m.decode_request, m.decode_response):
        with contextlib.suppress(ProtocolError):
            decode(data)


@given(st.lists(st.binary(max_size=300), min_size=1, max_size=5), st.integers(1, 50))
def test_framing_whole_and_byte_at_a_time(bodies: list[bytes], chunk: int) -> None:
    stream = b"".join(encode_frame(b) for b in bodies)
    for step in (len(stream), 1, chunk):
        decoder = FrameDecoder()
        got = []
        for i in range(0, len(stream), step):
            decoder.feed(stream[i : i + step])
            while (frame := decoder.next_frame()) is not None:
                got.append(frame)
        assert got == bodies
        assert decoder.buffered_bytes == 0


def test_oversized_frame_refused_before_buffering() -> None:
    decoder = FrameDecoder(frame_bytes_max=1000)
    decoder.feed(struct.pack(">I", 1001))
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()
    decoder = FrameDecoder()
    decoder.feed(struct.pack(">I", 0xFFFFFFFF) + b"x")
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"\xdd\xff\xff\xff\xff", "array bomb"),
        (b"\xdf\xff\xff\xff\xff", "map bomb"),
        (b"\xdb\xff\xff\xff\xff", "str bomb"),
        (b"\xc6\xff\xff\xff\xff", "bin bomb"),
        (b"\x91" * 5000 + b"\xc0", "deep nesting"),
        (b"\xc1", "reserved byte"),
        (b"\x93\x01\x02", "truncated array"),
        (msgpack.packb([1, 2, 3]) + b"\x00", "trailing bytes"),
        (msgpack.packb({"op": 1}), "map instead of array"),
        (msgpack.packb([99, 1]), "unknown op"),
        (msgpack.packb([True, 1]), "bool op"),
        (msgpack.packb([1, -1]), "negative request id"),
        (msgpack.packb([1, 1, -5, 0, 0, b"k", b"b"]), "negative ledger id"),
        (msgpack.packb([1, 1, 1 << 63, 0, 0, b"k", b"b"]), "ledger id 2^63"),
        (msgpack.packb([1, 1, 2, 3, 0, "key", b"b"]), "str instead of bin"),
        (msgpack.packb([1, 1, 2, 3, 0, b"k" * 65, b"b"]), "oversized key"),
        (msgpack.packb([1, 1, 2, 3, True, b"k", b"b"]), "bool flags"),
        (msgpack.packb([1, 1, 2, 3]), "missing fields"),
        (msgpack.packb([2, 1, 2, -2, 0, None, -1, 0]), "entry id -2"),
        (msgpack.packb([2, 1, 2, 0, 4, None, -1, 10**9]), "long poll timeout too large"),
        (b"\xd6\xff\x00\x00\x00\x01", "timestamp ext"),
    ],
)
def test_hostile_request_is_protocol_error(raw: bytes, why: str) -> None:
    with pytest.raises(ProtocolError):
        m.decode_request(raw)


def test_bad_field_error_carries_request_id_and_op() -> None:
    with pytest.raises(ProtocolError) as info:
        m.decode_request(msgpack.packb([1, 77, 2, 3, 0, "key", b"b"]))
    assert info.value.request_id == 77
    assert info.value.op == OpCode.ADD_ENTRY


def test_unknown_op_error_carries_request_id() -> None:
    with pytest.raises(ProtocolError) as info:
        m.decode_request(msgpack.packb([42, 9]))
    assert (info.value.request_id, info.value.op) == (9, 42)


def test_error_response_may_stop_after_message() -> None:
    frame = m.encode_error(OpCode.READ_ENTRY, 5, StatusCode.ENOLEDGER, "no such ledger 3")
    resp = m.decode_response(frame[4:])
    assert isinstance(resp, m.ReadEntryResponse)
    assert (resp.request_id, resp.status, resp.message, resp.body) == (5, 402, "no such ledger 3", None)


def test_ok_response_needs_all_fields() -> None:
    with pytest.raises(ProtocolError):
        m.decode_response(msgpack.packb([int(OpCode.ADD_ENTRY), 5, 0, None]))


def test_trailing_fields_are_ignored_for_evolution() -> None:
    raw = msgpack.packb([int(OpCode.READ_LAC), 3, 10, b"key", "future field"])
    assert m.decode_request(raw) == m.ReadLacRequest(3, 10, b"key")
    older = msgpack.packb([int(OpCode.READ_LAC), 3, 10])  # the key came after version 1: optional
    assert m.decode_request(older) == m.ReadLacRequest(3, 10, None)


def test_read_entry_response__unreadable_is_an_optional_bool() -> None:
    """``unreadable`` came after version 1 (§7.2's fenced answer for a last entry the bookie cannot
    read): a peer may omit it (False), it is never an int, and it round-trips."""
    older = msgpack.packb([int(OpCode.READ_ENTRY), 4, 0, None, 9, 3, b"body", 2])
    assert m.decode_response(older) == m.ReadEntryResponse(4, 0, None, 9, 3, b"body", 2, False)
    marker = m.ReadEntryResponse(4, 0, None, 9, 3, None, 2, True)
    assert m.decode_response(m.encode(marker)[4:]) == marker
    with pytest.raises(ProtocolError, match="unreadable"):
        m.decode_response(msgpack.packb([int(OpCode.READ_ENTRY), 4, 0, None, 9, 3, None, 2, 1]))


def test_fast_path_and_generic_path_agree_on_rejections() -> None:
    # rejected by the fast path (wrong arity) but fine for the generic one: trailing field
    raw = msgpack.packb([1, 1, 2, 3, 0, b"k", b"body", "extra"])
    assert m.decode_request(raw) == m.AddEntryRequest(1, 2, 3, 0, b"k", b"body")
    with pytest.raises(ProtocolError):
        m.decode_response(msgpack.packb([1, 1, 0, None, 2, -3]))


def test_hello_of_a_peer_without_features_decodes_with_none() -> None:
    """``features`` was added to HELLO after version 1 shipped: a peer may omit it (§8)."""
    request = msgpack.packb([0, 7, PROTOCOL_VERSION, "old client"])
    assert m.decode_request(request) == m.HelloRequest(7, PROTOCOL_VERSION, "old client", 0)
    response = msgpack.packb([0, 7, 0, None, PROTOCOL_VERSION, "bookie-1", FRAME_BYTES_MAX])
    assert m.decode_response(response) == m.HelloResponse(
        7, 0, None, PROTOCOL_VERSION, "bookie-1", FRAME_BYTES_MAX, 0
    )


@pytest.mark.parametrize(
    "body",
    [
        [11, 0, 0, None, []],  # no ids
        [11, 0, 0, None, [1, True]],  # bool is not an id
        [11, 0, 0, None, [1, -1]],
        [11, 0, 0, None, [1.0]],
        [11, 0, 0, None, list(range(1, ADD_ACKS_IDS_MAX + 2))],
        [11, 0, 0, None, 5],
        [11, 0, 0, None],  # EOK needs the ids
        [11, 0, 504, "fenced", [1]],  # a failed add is answered on its own, never in ADD_ACKS
        [11, 0, 501, None, [1, 2]],
        [11, 7, 0, None, [1]],  # request id 0 only
    ],
)
def test_add_acks_response_is_validated(body: list[object]) -> None:
    with pytest.raises(ProtocolError):
        m.decode_response(msgpack.packb(body))
    with pytest.raises(ProtocolError):
        m.decode_answer(msgpack.packb(body))  # the client's fast path agrees


def test_add_acks_is_not_a_request() -> None:
    with pytest.raises(ProtocolError, match="unknown op 11"):
        m.decode_request(msgpack.packb([11, 1, 0, None, [1]]))


@pytest.mark.parametrize("count", [1, 7, ADD_ACKS_IDS_MAX, ADD_ACKS_IDS_MAX + 1, 2 * ADD_ACKS_IDS_MAX + 3])
def test_encode_add_acks__chunks_at_the_limit_and_keeps_every_id_in_order(count: int) -> None:
    ids = list(range(10**12, 10**12 + count))
    frames = m.encode_add_acks(ids)
    assert len(frames) == -(-count // ADD_ACKS_IDS_MAX)
    decoded = [m.decode_response(frame[4:]) for frame in frames]
    assert all(isinstance(d, m.AddAcksResponse) and d.status == 0 for d in decoded)
    assert [rid for d in decoded for rid in d.request_ids] == ids  # type: ignore[union-attr]
    assert m.encode_add_acks([]) == []


@pytest.mark.parametrize(
    ("raw", "request_id", "op"),
    [
        (msgpack.packb([4, 21, 1]) + b"\x00", 21, OpCode.READ_LAC),
        (msgpack.packb([1, 22, 1, 0, 0, b"k", b"b"], use_bin_type=True) + b"\xc0\xc0", 22, OpCode.ADD_ENTRY),
        (b"\x94\x00\x17\x01\xa2\xff\xfe", 23, OpCode.HELLO),  # HELLO whose client name is not UTF-8
        (b"\x94\x00\x18\x01\xa2\xff\xfe\x00", 24, OpCode.HELLO),  # both at once
    ],
)
def test_trailing_bytes_and_bad_utf8_keep_the_request_id(raw: bytes, request_id: int, op: int) -> None:
    """docs/protocol.md §1: a readable request head gets EBADREQ, not a closed connection."""
    with pytest.raises(ProtocolError) as info:
        m.decode_request(raw)
    assert (info.value.request_id, info.value.op) == (request_id, op)


def test_bad_utf8_before_a_readable_head_has_no_request_id() -> None:
    with pytest.raises(ProtocolError) as info:
        m.decode_request(b"\x92\x01\xa2\xff\xfe")  # the request id itself is the bad string
    assert info.value.request_id is None


def test_auth_round_trip_and_bounds() -> None:
    request = m.AuthRequest(3, "token", b"s3cret")
    assert m.decode_request(m.encode(request)[4:]) == request
    response = m.AuthResponse(3, StatusCode.EOK, None, "token", b"", 1)
    assert m.decode_response(m.encode(response)[4:]) == response
    refused = m.decode_response(m.encode_error(OpCode.AUTH, 3, StatusCode.EUA, "bad token")[4:])
    assert isinstance(refused, m.AuthResponse)
    assert (refused.status, refused.complete) == (StatusCode.EUA, 0)
    with pytest.raises(ProtocolError):
        m.decode_request(msgpack.packb([3, 4, "token", b"x" * (16 * 1024 + 1)], use_bin_type=True))
    with pytest.raises(ProtocolError):
        m.decode_request(msgpack.packb([3, 4, "token", "str-not-bin"], use_bin_type=True))
    with pytest.raises(ProtocolError):
        m.decode_response(msgpack.packb([3, 4, 0, None, "token", b"", 2], use_bin_type=True))


def test_batch_read__step_is_optional_and_echoed() -> None:
    """A BATCH_READ without ``step`` (an older client) reads consecutive entries (step 1); an answer
    without it (an older bookie, which ignored the request's) says step 1 as well, which is how a
    striped reader tells that its step was not applied."""
    old_request = msgpack.packb([10, 5, 7, 100, 50, 1 << 20, 0, None])
    assert m.decode_request(old_request) == m.BatchReadRequest(5, 7, 100, 50, 1 << 20, 0, None, 1)
    old_answer = msgpack.packb([10, 5, 0, None, 7, 100, [b"x"], 99])
    assert m.decode_response(old_answer).step == 1
    stepped = m.encode(m.BatchReadRequest(5, 7, 100, 50, 1 << 20, 0, None, 3))
    assert m.decode_request(stepped[4:]).step == 3
    with pytest.raises(ProtocolError, match="bad value for step"):
        m.decode_request(msgpack.packb([10, 5, 7, 100, 50, 1 << 20, 0, None, BATCH_READ_STEP_MAX + 1]))
