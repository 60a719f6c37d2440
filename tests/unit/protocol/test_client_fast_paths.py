"""The client's hot-path codec (``encode_add_request``, ``AddFrameEncoder``, ``add_request_with_id``,
``decode_answer``) against the generic one (``encode`` / ``FrameDecoder`` / ``decode_request`` /
``decode_response``): for random valid inputs the fast bytes are the generic bytes (a CRC32C frame's:
but for its ids written as uint32, :func:`uint32_ids_frame`), and the fast decode of any frame body
is the generic decode (an EOK ADD answer reduced to its request id), or both raise ProtocolError."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import (
    ADD_ACKS_IDS_MAX,
    FEATURES_MAX,
    FRAME_BYTES_MAX,
    ID_MAX,
    REQUEST_ID_MAX,
    AddFlag,
    OpCode,
    StatusCode,
)
from bookkeeper_aio.protocol.digest import DigestType, EntryCodec
from bookkeeper_aio.protocol.errors import ProtocolError
from bookkeeper_aio.protocol.framing import FrameDecoder
from tests.unit.protocol.test_codec import ids, keys, lacs, rids

# Payloads around the body's bin8/bin16 edges (the body is the payload plus 36 bytes).
payloads = st.one_of(st.binary(max_size=300), st.integers(65400, 65600).map(lambda n: b"\xa5" * n))


def uint32_ids_frame(rid: int, lid: int, eid: int, key: bytes, body: bytes) -> bytes:
    """What ``AddFrameEncoder.crc32c_frame`` writes: the generic ADD frame (flags none), except
    that when both ids fit in 32 bits and the body in 65,535 bytes, the ids are msgpack uint32
    (``0xce``) and the body's length a bin16 (``0xc5``) whatever their values (the smallest form
    is only from 65,536 on, resp. 256); else the generic bytes."""
    if rid > 0xFFFFFFFF or eid > 0xFFFFFFFF or len(body) > 0xFFFF:
        return m.encode(m.AddEntryRequest(rid, lid, eid, 0, key, body))
    packed = b"".join(
        (
            b"\x97\x01\xce",
            rid.to_bytes(4, "big"),
            msgpack.packb(lid),
            b"\xce",
            eid.to_bytes(4, "big"),
            msgpack.packb(0),
            msgpack.packb(key, use_bin_type=True),
            b"\xc5",
            len(body).to_bytes(2, "big"),
            body,
        )
    )
    return len(packed).to_bytes(4, "big") + packed


def _uint_width(first: int) -> int:
    """Bytes of a msgpack unsigned int that starts with ``first``."""
    return 1 if first < 0x80 else {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}[first]


def _one_frame(data: bytes) -> bytes:
    decoder = FrameDecoder()
    decoder.feed(data)
    frame = decoder.next_frame()
    assert frame is not None
    assert decoder.next_frame() is None
    return bytes(frame)


@settings(max_examples=500)
@given(rids, ids, ids, st.sampled_from([0, int(AddFlag.RECOVERY_ADD)]), keys, st.binary(max_size=2000))
def test_encode_add_request__generic_bytes(
    rid: int, lid: int, eid: int, flags: int, key: bytes, body: bytes
) -> None:
    fast = m.encode_add_request(rid, lid, eid, flags, key, body)
    assert fast == m.encode(m.AddEntryRequest(rid, lid, eid, flags, key, body))
    assert m.decode_request(_one_frame(fast)) == m.AddEntryRequest(rid, lid, eid, flags, key, body)


@settings(max_examples=300)
@given(rids, ids, ids, lacs, ids, keys, payloads, rids)
def test_add_frame_encoder__crc32c_frame_is_the_generic_frame_and_resends_are_too(
    rid: int, lid: int, eid: int, lac: int, length: int, key: bytes, payload: bytes, rid2: int
) -> None:
    encoder = m.AddFrameEncoder(lid, key)
    body = EntryCodec(DigestType.CRC32C, b"pw").encode(lid, eid, lac, length, payload)
    request = m.AddEntryRequest(rid, lid, eid, 0, key, body)
    generic = m.encode(request)
    fast = encoder.crc32c_frame(rid, eid, lac, length, payload)
    assert fast == uint32_ids_frame(rid, lid, eid, key, body)
    assert m.decode_request(_one_frame(fast)) == request  # what the bookie reads
    assert encoder.frame(rid, eid, body) == generic
    again = m.encode(m.AddEntryRequest(rid2, lid, eid, 0, key, body))
    assert m.add_request_with_id(generic, rid2) == again
    resent = m.add_request_with_id(fast, rid2)  # the request id re-packed, the rest as it was
    assert m.decode_request(_one_frame(resent)) == request._replace(request_id=rid2)
    assert resent[6 + _uint_width(resent[6]) :] == fast[6 + _uint_width(fast[6]) :]


answers = st.one_of(
    st.builds(m.AddEntryResponse, rids, st.just(0), st.none(), ids, ids),
    st.builds(
        m.AddEntryResponse,
        rids,
        st.sampled_from([int(code) for code in StatusCode]),
        st.one_of(st.none(), st.text(max_size=9)),
        ids,
        ids,
    ),
    st.builds(m.AddAcksResponse, st.just(0), st.just(0), st.none(), st.lists(rids, min_size=1, max_size=50)),
    st.builds(m.ReadLacResponse, rids, st.just(0), st.none(), ids, lacs),
    st.builds(m.ReadEntryResponse, rids, st.just(0), st.none(), ids, lacs, st.binary(max_size=9), lacs),
    st.builds(m.ReadEntryResponse, rids, st.just(0), st.none(), ids, lacs, st.none(), lacs, st.booleans()),
    st.builds(m.WriteLacResponse, rids, st.just(0), st.none(), ids),
)


def _same_decode(body: bytes) -> None:
    try:
        generic: Any = m.decode_response(body)
    except ProtocolError:
        generic = ProtocolError
    try:
        fast: Any = m.decode_answer(body)
    except ProtocolError:
        fast = ProtocolError
    if type(fast) is int:
        assert type(generic) is m.AddEntryResponse, (body, generic)
        assert generic.status == 0
        assert generic.request_id == fast
    else:
        assert fast == generic, body


@settings(max_examples=1000)
@given(answers)
def test_decode_answer__valid_answers_decode_as_the_generic_decoder(answer: m.Response) -> None:
    frame = _one_frame(m.encode(answer))
    _same_decode(frame)
    decoded = m.decode_answer(frame)
    if isinstance(answer, m.AddEntryResponse) and answer.status == 0 and answer.message is None:
        assert decoded == answer.request_id
    else:
        assert decoded == answer


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), REQUEST_ID_MAX),
    st.sampled_from([-1, 0, 1, ID_MAX, ID_MAX + 1, REQUEST_ID_MAX]),
    st.text(max_size=5),
    st.binary(max_size=5),
)
ops = st.sampled_from(
    [int(OpCode.ADD_ENTRY), int(OpCode.ADD_ACKS), int(OpCode.READ_ENTRY), int(OpCode.READ_LAC), True, -1, 99]
)
near_misses = st.one_of(
    st.tuples(ops, scalars, st.sampled_from([0, 1, False]), scalars, scalars, scalars).map(list),
    st.tuples(ops, st.sampled_from([0, 1, False]), st.sampled_from([0, False]), scalars).map(
        lambda t: [*t, []]
    ),
    st.tuples(ops, scalars, scalars, scalars).map(lambda t: [*t, [0] * (ADD_ACKS_IDS_MAX + 1)]),
    st.tuples(ops, st.just(0), st.just(0), st.none(), st.lists(scalars, min_size=1, max_size=4)).map(list),
    st.tuples(  # a read's answer: nine items
        ops,
        scalars,
        st.sampled_from([0, 1, False]),
        st.sampled_from([None, "x"]),
        scalars,
        scalars,
        st.one_of(st.binary(max_size=5), scalars),
        scalars,
        st.one_of(st.booleans(), scalars),
    ).map(list),
    st.lists(scalars, max_size=10),
)


@settings(max_examples=2000)
@given(near_misses)
def test_decode_answer__near_misses_decode_or_fail_as_the_generic_decoder(obj: list[Any]) -> None:
    _same_decode(msgpack.packb(obj, use_bin_type=True))


@given(st.binary(max_size=40))
def test_decode_answer__any_bytes_decode_or_fail_as_the_generic_decoder(body: bytes) -> None:
    _same_decode(body)


@given(
    rid=rids,
    ledger_id=ids,
    start=ids,
    bodies=st.lists(st.one_of(st.binary(max_size=300), st.just(b"\xa5" * 70_000)), max_size=20),
    lac=lacs,
    step=st.integers(1, 64),
    views=st.booleans(),
)
@settings(max_examples=200)
def test_encode_batch_read_ok__generic_bytes(
    rid: int, ledger_id: int, start: int, bodies: list[bytes], lac: int, step: int, views: bool
) -> None:
    """The bookie's BATCH_READ answer, built in one join (bodies as bytes or as views of what it
    read), is the generic encoder's frame."""
    generic = m.encode(m.BatchReadResponse(rid, 0, None, ledger_id, start, bodies, lac, step))
    parts = [memoryview(b) for b in bodies] if views else bodies
    assert m.encode_batch_read_ok(rid, ledger_id, start, parts, lac, step) == generic


@given(
    rid=rids,
    ledger_id=ids,
    entry_id=ids,
    body=st.one_of(st.binary(max_size=300), st.integers(65500, 65600).map(lambda n: b"\xa5" * n)),
    lac=lacs,
    view=st.booleans(),
)
@settings(max_examples=200)
def test_encode_read_ok__generic_bytes(
    rid: int, ledger_id: int, entry_id: int, body: bytes, lac: int, view: bool
) -> None:
    """The bookie's READ_ENTRY answer with its entry, built in one join (the body as bytes or as a
    view of what it read), is the generic encoder's frame."""
    generic = m.encode(m.ReadEntryResponse(rid, 0, None, ledger_id, entry_id, body, lac))
    assert m.encode_read_ok(rid, ledger_id, entry_id, memoryview(body) if view else body, lac) == generic


def test_encode_batch_read_ok__array_header_sizes() -> None:
    for count in (0, 15, 16, 65_535, 65_536):
        bodies = [b""] * count
        generic = m.encode(m.BatchReadResponse(1, 0, None, 2, 3, bodies, 4, 1))
        assert m.encode_batch_read_ok(1, 2, 3, bodies, 4, 1) == generic


def test_decode_answer__a_read_answer_with_one_field_wrong_decodes_as_the_generic_decoder() -> None:
    """The read answer's shortcut, field by field: each value out of its type or range (or at its
    edge) is decoded, or refused, exactly as the generic decoder does."""
    valid = [int(OpCode.READ_ENTRY), 7, 0, None, 3, 4, b"entry", 2, False]
    bad: list[list[Any]] = [
        [True, 2, -1, 99],
        [-1, True, REQUEST_ID_MAX, None],
        [1, False, 999_999, True],
        ["x", "", b"m"],
        [-1, ID_MAX, ID_MAX + 1, True, None],
        [-2, -1, ID_MAX, ID_MAX + 1, False, "4"],
        [None, "s", 5, [b"a"]],
        [-2, -1, ID_MAX, ID_MAX + 1, True],
        [0, 1, None, "t", True],
    ]
    assert len(bad) == len(valid)
    _same_decode(msgpack.packb(valid, use_bin_type=True))
    assert m.decode_answer(msgpack.packb(valid, use_bin_type=True)) == m.ReadEntryResponse(*valid[1:])
    for i, values in enumerate(bad):
        for value in values:
            obj = [*valid[:i], value, *valid[i + 1 :]]
            _same_decode(msgpack.packb(obj, use_bin_type=True))
    for obj in (valid[:8], [*valid, 0], valid[:7]):  # one short (unreadable omitted), one long, too short
        _same_decode(msgpack.packb(obj, use_bin_type=True))


def test_decode_answer__a_refused_read_decodes_as_the_generic_decoder() -> None:
    """The read answer's shortcut takes refusals too (ENOENTRY for a recovery read past the end, with
    a message and no entry): field by field, as the generic decoder does, message edges included."""
    valid = [int(OpCode.READ_ENTRY), 7, int(StatusCode.ENOENTRY), "no entry 4", 3, 4, None, 2, False]
    assert m.decode_answer(msgpack.packb(valid, use_bin_type=True)) == m.ReadEntryResponse(*valid[1:])
    changes: list[tuple[int, Any]] = [
        (2, int(StatusCode.EIO)),
        (2, 0),
        (2, 9999),
        (3, None),
        (3, "m" * m.TEXT_CHARS_MAX),
        (3, "m" * (m.TEXT_CHARS_MAX + 1)),
        (3, b"bytes"),
        (6, b"entry"),
        (6, 5),
        (8, True),
        (8, 0),
    ]
    for i, value in changes:
        obj = [*valid[:i], value, *valid[i + 1 :]]
        _same_decode(msgpack.packb(obj, use_bin_type=True))
    for obj in (valid[:4], valid[:8]):  # a refusal may stop after its message; one short
        _same_decode(msgpack.packb(obj, use_bin_type=True))


def test_decode_answer__a_batch_read_answer_with_one_field_wrong_decodes_as_the_generic_decoder() -> None:
    """The batch read answer's shortcut, field by field (its entries, a refusal's message), as the
    generic decoder does."""
    valid = [int(OpCode.BATCH_READ), 7, 0, None, 3, 4, [b"a", b"bc"], 5, 1]
    assert m.decode_answer(msgpack.packb(valid, use_bin_type=True)) == m.BatchReadResponse(*valid[1:])
    bad: list[list[Any]] = [
        [True, 10, -1],
        [-1, True, REQUEST_ID_MAX, None],
        [True, 2, -1, 99, int(StatusCode.ENOENTRY)],
        ["m" * m.TEXT_CHARS_MAX, "m" * (m.TEXT_CHARS_MAX + 1), b"m", 5],
        [-1, ID_MAX, ID_MAX + 1, True],
        [-1, ID_MAX, ID_MAX + 1, False, None],
        [[], [b"a", "b"], [b"a", None], b"ab", None, [b"x"] * 3],
        [-2, -1, ID_MAX, ID_MAX + 1, True],
        [0, 1, 64, 65, True, None],
    ]
    assert len(bad) == len(valid)
    for i, values in enumerate(bad):
        for value in values:
            obj = [*valid[:i], value, *valid[i + 1 :]]
            _same_decode(msgpack.packb(obj, use_bin_type=True))
    for obj in (valid[:8], [*valid, 0], valid[:4], valid[:3]):  # step omitted, one long, refusal-short
        _same_decode(msgpack.packb(obj, use_bin_type=True))


def test_decode_answer__a_hello_answer_with_one_field_wrong_decodes_as_the_generic_decoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The HELLO answer's shortcut, field by field (a refusal's message included), as the generic
    decoder does; a HELLO answer with all its fields never reaches the generic decoder."""
    valid = [int(OpCode.HELLO), 7, 0, None, 1, "bookie-1", FRAME_BYTES_MAX, 1]
    bad: list[list[Any]] = [
        [True, 2, -1, int(OpCode.READ_ENTRY)],
        [-1, True, REQUEST_ID_MAX, None],
        [True, -1, 9999, int(StatusCode.EBADVERSION), None],
        ["m" * m.TEXT_CHARS_MAX, "m" * (m.TEXT_CHARS_MAX + 1), b"m", 5],
        [-1, 0xFFFF, 0x10000, True, None],
        ["", "b" * m.TEXT_CHARS_MAX, "b" * (m.TEXT_CHARS_MAX + 1), b"bookie", None],
        [0, 1, FRAME_BYTES_MAX + 1, True, None],
        [-1, 0, FEATURES_MAX, FEATURES_MAX + 1, True, None],
    ]
    assert len(bad) == len(valid)
    for i, values in enumerate(bad):
        for value in values:
            _same_decode(msgpack.packb([*valid[:i], value, *valid[i + 1 :]], use_bin_type=True))
    for obj in (valid[:7], [*valid, 0], valid[:4], valid[:3]):  # features omitted, one long, refusal-short
        _same_decode(msgpack.packb(obj, use_bin_type=True))

    def generic(obj: Any) -> m.Response:
        raise AssertionError(f"not taken by the shortcut: {obj}")

    monkeypatch.setattr(m, "decode_response_object", generic)
    for status, message in ((0, None), (int(StatusCode.EBADVERSION), "too new")):
        answer = [*valid[:2], status, message, *valid[4:]]
        assert m.decode_answer(msgpack.packb(answer, use_bin_type=True)) == m.HelloResponse(*answer[1:])
