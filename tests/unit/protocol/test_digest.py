from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bookkeeper_aio.protocol.codes import ID_MAX
from bookkeeper_aio.protocol.digest import DigestType, Entry, EntryCodec, master_key, peek_header
from bookkeeper_aio.protocol.errors import DigestMismatch, ProtocolError


@pytest.mark.parametrize("kind", list(DigestType))
@given(
    ledger_id=st.integers(0, ID_MAX),
    entry_id=st.integers(0, ID_MAX),
    lac=st.integers(-1, ID_MAX),
    payload=st.binary(max_size=3000),
)
def test_round_trip(kind: DigestType, ledger_id: int, entry_id: int, lac: int, payload: bytes) -> None:
    codec = EntryCodec(kind, b"pw")
    body = codec.encode(ledger_id, entry_id, lac, len(payload), payload)
    entry = codec.decode(body, ledger_id, entry_id)
    assert entry.payload == payload
    assert (entry.lac, entry.length) == (lac, len(payload))
    header = peek_header(body)
    assert (header.ledger_id, header.entry_id, header.lac) == (ledger_id, entry_id, lac)


@pytest.mark.parametrize("kind", [DigestType.CRC32C, DigestType.HMAC_SHA256])
def test_every_flipped_byte_is_detected(kind: DigestType) -> None:
    codec = EntryCodec(kind, b"pw")
    body = codec.encode(7, 3, 2, 40, b"x" * 40)
    for i in range(len(body)):
        corrupt = bytearray(body)
        corrupt[i] ^= 0x01
        with pytest.raises(DigestMismatch):
            codec.decode(bytes(corrupt), 7, 3)


def test_wrong_ids_and_truncation_are_detected() -> None:
    codec = EntryCodec(DigestType.NONE)
    body = codec.encode(7, 3, 2, 1, b"x")
    with pytest.raises(DigestMismatch):
        codec.decode(body, 7, 4)
    with pytest.raises(DigestMismatch):
        codec.decode(body[:20], 7, 3)
    with pytest.raises(ProtocolError):
        peek_header(body[:31])


def test_hmac_depends_on_password_and_keys_are_separated() -> None:
    body = EntryCodec(DigestType.HMAC_SHA256, b"a").encode(1, 0, -1, 1, b"x")
    with pytest.raises(DigestMismatch):
        EntryCodec(DigestType.HMAC_SHA256, b"b").decode(body, 1, 0)
    assert master_key(b"a") != master_key(b"b")
    assert len(master_key(b"a")) == 32


@pytest.mark.parametrize("kind", list(DigestType))
@given(payloads=st.lists(st.binary(max_size=300), min_size=1, max_size=8), step=st.integers(1, 64))
def test_decode_run_is_decode_of_each(kind: DigestType, payloads: list[bytes], step: int) -> None:
    """A batch read's bodies, decoded in one loop: the same entries as one ``decode`` each, also
    from views; a bad body raises after appending the ones before it."""
    codec = EntryCodec(kind, b"pw")
    ids = [5 + i * step for i in range(len(payloads))]
    bodies = [codec.encode(3, e, e - 1, len(p), p) for e, p in zip(ids, payloads, strict=True)]
    out: list[Entry] = []
    codec.decode_run([memoryview(b) for b in bodies], 3, 5, step, out)
    assert out == [codec.decode(b, 3, e) for b, e in zip(bodies, ids, strict=True)]
    assert all(type(entry.payload) is bytes for entry in out)
    if kind is DigestType.NONE:
        return
    last = bytearray(bodies[-1])
    last[-1 if payloads[-1] else 0] ^= 1
    out = []
    with pytest.raises(DigestMismatch):
        codec.decode_run([*bodies[:-1], bytes(last)], 3, 5, step, out)
    assert len(out) == len(bodies) - 1
