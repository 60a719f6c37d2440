"""The codec's ADD_ENTRY shortcut (``AddRequests.take``, the bookie's add hot path, and
``decode_add_request`` built on it) pinned to the generic validator: whatever the shortcut accepts,
the generic decoder decodes to the same request; what it refuses leaves nothing behind; every
well-formed ADD within its size is taken; nothing it is given makes it raise."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import ID_MAX, MASTER_KEY_BYTES_MAX, REQUEST_ID_MAX
from bookkeeper_aio.protocol.errors import ProtocolError

_ints = st.one_of(
    st.integers(0, 3),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-1, 0xFF, 0x100, ID_MAX, ID_MAX + 1, REQUEST_ID_MAX]),
)
_value = st.one_of(
    _ints,
    st.binary(max_size=MASTER_KEY_BYTES_MAX + 2),
    st.text(max_size=4),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.integers(0, 3), max_size=8),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
)


def _generic(raw: bytes | memoryview) -> Any:
    try:
        return m.decode_request_generic(raw)
    except ProtocolError:
        return None


@given(
    st.one_of(st.just(1), _value),
    st.lists(_value, min_size=6, max_size=6),
    st.lists(_value, max_size=2),
)
def test_what_the_shortcut_accepts_the_generic_decoder_decodes_the_same(
    op: Any, fields: list[Any], trailing: list[Any]
) -> None:
    raw = msgpack.packb([op, *fields, *trailing], use_bin_type=True)
    for body in (raw, memoryview(raw)):
        fast = m.decode_add_request(body)
        requests = m.AddRequests()
        requests.append(m.AddEntryRequest(9, 9, 9, 9, b"k", b"before"))
        rid = requests.take(body)
        if fast is None:
            assert rid == -1
            assert len(requests) == 1  # nothing of a refused frame is kept
        else:
            assert type(fast) is m.AddEntryRequest
            assert fast == _generic(body)
            assert m.decode_request(body) == fast
            assert not trailing  # a trailing field is the generic path's to ignore
            assert rid == fast.request_id
            assert requests.request(1) == fast
            requests.drop_last()
        assert len(requests) == 1
        assert requests.request(0) == m.AddEntryRequest(9, 9, 9, 9, b"k", b"before")


@given(
    st.integers(0, REQUEST_ID_MAX),
    st.integers(0, ID_MAX),
    st.integers(0, ID_MAX),
    st.integers(0, 0xFF),
    st.binary(max_size=MASTER_KEY_BYTES_MAX),
    st.binary(max_size=70_000),
)
def test_every_well_formed_add_within_the_plain_size_is_taken(
    rid: int, lid: int, eid: int, flags: int, key: bytes, body: bytes
) -> None:
    request = m.AddEntryRequest(rid, lid, eid, flags, key, body)
    frame = m.encode(request)[4:]
    fast = m.decode_add_request(memoryview(frame))
    if len(frame) <= m.PLAIN_REQUEST_BYTES_MAX:
        assert fast == request
    else:  # large frames: the generic path, which bounds the objects it unpacks
        assert fast is None
    assert m.decode_request(frame) == request


@given(st.binary(max_size=64))
def test_arbitrary_bytes_are_refused_not_raised(data: bytes) -> None:
    for body in (data, b"\x97\x01" + data):
        fast = m.decode_add_request(body)
        assert fast is None or fast == _generic(body)


_EDGES = [-(2**63), -1, 0, 1, ID_MAX, ID_MAX + 1, REQUEST_ID_MAX]


@pytest.mark.parametrize("lid", _EDGES)
@pytest.mark.parametrize("eid", _EDGES)
@pytest.mark.parametrize("rid", [-1, 0, REQUEST_ID_MAX])
@pytest.mark.parametrize("flags", [-1, 0, 0xFF, 0x100])
def test_ids_and_flags_at_their_bounds(rid: int, lid: int, eid: int, flags: int) -> None:
    """Each int field at and past its bounds (the ids are tested together, by their high bits):
    taken exactly when all are in range, as the generic decoder decodes it."""
    raw = msgpack.packb([1, rid, lid, eid, flags, b"k", b"body"], use_bin_type=True)
    in_range = 0 <= rid <= REQUEST_ID_MAX and 0 <= lid <= ID_MAX and 0 <= eid <= ID_MAX and 0 <= flags <= 0xFF
    fast = m.decode_add_request(raw)
    assert (fast is not None) == in_range
    assert fast == _generic(raw)
