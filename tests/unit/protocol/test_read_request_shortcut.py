"""The codec's READ_ENTRY, BATCH_READ and HELLO shortcuts (``_read_request``,
``_batch_read_request``, ``_hello_request``, taken first by ``decode_request_generic``: the bookie's
decoder for every read and handshake) pinned to the field checkers (``_checked_request``): whatever
a shortcut accepts, the checkers accept and decode to the same request; every read and HELLO a
client sends (all its fields, a read's key) is taken; anything else decodes, or is refused with the
same error, as before."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import (
    BATCH_READ_COUNT_MAX,
    BATCH_READ_STEP_MAX,
    FEATURES_MAX,
    FRAME_BYTES_MAX,
    ID_MAX,
    LONG_POLL_TIMEOUT_MS_MAX,
    MASTER_KEY_BYTES_MAX,
    REQUEST_ID_MAX,
    OpCode,
    ReadFlag,
)
from bookkeeper_aio.protocol.errors import ProtocolError

_READ = int(OpCode.READ_ENTRY)
_BATCH = int(OpCode.BATCH_READ)
_HELLO = int(OpCode.HELLO)
_ints = st.one_of(
    st.integers(-3, 3),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0xFF, 0x100, ID_MAX, ID_MAX + 1, REQUEST_ID_MAX, LONG_POLL_TIMEOUT_MS_MAX + 1]),
)
_value = st.one_of(
    _ints,
    st.binary(max_size=MASTER_KEY_BYTES_MAX + 2),
    st.text(max_size=4),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.integers(0, 3), max_size=3),
)


def _checked(obj: Any) -> Any:
    try:
        return m._checked_request(obj)
    except ProtocolError as error:
        return (ProtocolError, str(error), error.request_id, error.op)


def _decoded(obj: Any) -> Any:
    raw = msgpack.packb(obj, use_bin_type=True)
    try:
        return m.decode_request_generic(memoryview(raw))
    except ProtocolError as error:
        return (ProtocolError, str(error), error.request_id, error.op)


@settings(max_examples=1000)
@given(st.one_of(st.sampled_from([_READ, _BATCH, _HELLO]), _value), st.lists(_value, min_size=3, max_size=10))
def test_what_a_shortcut_takes_the_checkers_decode_the_same(op: Any, fields: list[Any]) -> None:
    obj = [op, *fields]
    _same(obj)


def _same(obj: list[Any]) -> None:
    taken = [
        (fast, cls)
        for fast, cls in (
            (m._read_request(obj), m.ReadEntryRequest),
            (m._batch_read_request(obj), m.BatchReadRequest),
            (m._hello_request(obj), m.HelloRequest),
        )
        if fast is not None
    ]
    assert len(taken) <= 1
    fast = taken[0][0] if taken else None
    if taken:
        assert type(fast) is taken[0][1]
        assert fast == _checked(obj), obj
    assert _decoded(obj) == (fast if fast is not None else _checked(obj)), obj


@settings(max_examples=300)
@given(
    st.integers(0, REQUEST_ID_MAX),
    st.integers(0, ID_MAX),
    st.integers(-1, ID_MAX),
    st.integers(0, 0xFF),
    st.binary(max_size=MASTER_KEY_BYTES_MAX),
    st.integers(-1, ID_MAX),
    st.integers(0, LONG_POLL_TIMEOUT_MS_MAX),
)
def test_every_read_a_client_sends_is_taken(
    rid: int, lid: int, eid: int, flags: int, key: bytes, previous: int, timeout: int
) -> None:
    request = m.ReadEntryRequest(rid, lid, eid, flags, key, previous, timeout)
    obj = msgpack.unpackb(m.encode(request)[4:])
    assert m._read_request(obj) == request
    assert m.decode_request_generic(m.encode(request)[4:]) == request


def test_a_read_with_one_field_wrong_decodes_or_fails_as_the_checkers() -> None:
    """Field by field: each value out of its type or range (or at its edge) is decoded, or refused
    with the same error, exactly as the checkers do; without a key a fencing read is refused."""
    valid = [_READ, 7, 3, 4, int(ReadFlag.FENCE_LEDGER), b"key", -1, 0]
    assert m._read_request(valid) == m.ReadEntryRequest(*valid[1:])
    bad: list[list[Any]] = [
        [True, 3, "2", 2.0],
        [-1, True, REQUEST_ID_MAX, None, 1.0],
        [-1, ID_MAX, ID_MAX + 1, False],
        [-2, -1, ID_MAX, ID_MAX + 1, True],
        [-1, 0x100, 0xFF, True],
        [None, b"k" * MASTER_KEY_BYTES_MAX, b"k" * (MASTER_KEY_BYTES_MAX + 1), "key"],
        [-2, -1, ID_MAX, ID_MAX + 1, False],
        [-1, LONG_POLL_TIMEOUT_MS_MAX, LONG_POLL_TIMEOUT_MS_MAX + 1, True],
    ]
    assert len(bad) == len(valid)
    for i, values in enumerate(bad):
        for value in values:
            obj = [*valid[:i], value, *valid[i + 1 :]]
            fast = m._read_request(obj)
            assert fast is None or fast == _checked(obj), obj
            assert _decoded(obj) == (fast if fast is not None else _checked(obj)), obj
    no_key = [*valid[:5], None, *valid[6:]]  # (the batch's no-key case: below)
    assert m._read_request(no_key) is None
    assert _decoded(no_key)[0] is ProtocolError  # FENCE_LEDGER needs a master_key
    for obj in (valid[:7], [*valid, 0], valid[:4]):  # defaults for the omitted, one too many, too short
        assert m._read_request(obj) is None
        assert _decoded(obj) == _checked(obj)


@settings(max_examples=300)
@given(
    st.integers(0, REQUEST_ID_MAX),
    st.integers(0, ID_MAX),
    st.integers(0, ID_MAX),
    st.integers(1, BATCH_READ_COUNT_MAX),
    st.integers(1, FRAME_BYTES_MAX),
    st.integers(0, 0xFF),
    st.binary(max_size=MASTER_KEY_BYTES_MAX),
    st.integers(1, BATCH_READ_STEP_MAX),
)
def test_every_batch_read_a_client_sends_is_taken(
    rid: int, lid: int, start: int, count: int, size: int, flags: int, key: bytes, step: int
) -> None:
    request = m.BatchReadRequest(rid, lid, start, count, size, flags, key, step)
    obj = msgpack.unpackb(m.encode(request)[4:])
    assert m._batch_read_request(obj) == request
    assert m.decode_request_generic(m.encode(request)[4:]) == request


def test_a_batch_read_with_one_field_wrong_decodes_or_fails_as_the_checkers() -> None:
    valid = [_BATCH, 7, 3, 4, 10, 1000, int(ReadFlag.FENCE_LEDGER), b"key", 1]
    assert m._batch_read_request(valid) == m.BatchReadRequest(*valid[1:])
    bad: list[list[Any]] = [
        [True, 2, "9", 9.0],
        [-1, True, REQUEST_ID_MAX, None],
        [-1, ID_MAX, ID_MAX + 1, False],
        [-1, ID_MAX, ID_MAX + 1, True, None],
        [0, 1, BATCH_READ_COUNT_MAX, BATCH_READ_COUNT_MAX + 1, True],
        [0, 1, FRAME_BYTES_MAX, FRAME_BYTES_MAX + 1, False],
        [-1, 0x100, 0xFF, True],
        [None, b"k" * MASTER_KEY_BYTES_MAX, b"k" * (MASTER_KEY_BYTES_MAX + 1), "key"],
        [0, 1, BATCH_READ_STEP_MAX, BATCH_READ_STEP_MAX + 1, True],
    ]
    assert len(bad) == len(valid)
    for i, values in enumerate(bad):
        for value in values:
            _same([*valid[:i], value, *valid[i + 1 :]])
    no_key = [*valid[:7], None, valid[8]]
    assert m._batch_read_request(no_key) is None
    assert _decoded(no_key)[0] is ProtocolError  # FENCE_LEDGER needs a master_key
    for obj in (valid[:8], [*valid, 0], valid[:4]):  # step omitted, one too many, too short
        _same(obj)


@settings(max_examples=300)
@given(
    st.integers(0, REQUEST_ID_MAX),
    st.integers(0, 0xFFFF),
    st.text(max_size=m.TEXT_CHARS_MAX),
    st.integers(0, FEATURES_MAX),
)
def test_every_hello_a_client_sends_is_taken(rid: int, version: int, name: str, features: int) -> None:
    request = m.HelloRequest(rid, version, name, features)
    obj = msgpack.unpackb(m.encode(request)[4:])
    assert m._hello_request(obj) == request
    assert m.decode_request_generic(m.encode(request)[4:]) == request


def test_a_hello_with_one_field_wrong_decodes_or_fails_as_the_checkers() -> None:
    valid = [_HELLO, 7, 1, "client", 1]
    assert m._hello_request(valid) == m.HelloRequest(*valid[1:])
    bad: list[list[Any]] = [
        [True, False, _READ, 0.0],
        [-1, True, REQUEST_ID_MAX, None, "7"],
        [-1, 0xFFFF, 0x10000, True, None],
        ["", "c" * m.TEXT_CHARS_MAX, "c" * (m.TEXT_CHARS_MAX + 1), b"client", None, 1],
        [-1, 0, FEATURES_MAX, FEATURES_MAX + 1, True, None],
    ]
    assert len(bad) == len(valid)
    for i, values in enumerate(bad):
        for value in values:
            _same([*valid[:i], value, *valid[i + 1 :]])
    for obj in (valid[:4], [*valid, 0], valid[:3]):  # features omitted, one too many, too short
        assert m._hello_request(obj) is None
        _same(obj)
