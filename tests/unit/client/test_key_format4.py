"""Key format 4: the MAC key of HMAC digests derives from the ledger's PBKDF2-based secret, not from
the password alone (in formats 1 to 3 one entry body let anyone test password guesses at one
SHA-256 and one HMAC each); older formats keep their MAC key, so their ledgers still verify."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest

from bookkeeper_aio.client import keys
from bookkeeper_aio.client.keys import NewLedgerKeys, codec_for
from bookkeeper_aio.errors import Unauthorized
from bookkeeper_aio.protocol.digest import (
    DigestType,
    EntryCodec,
    MasterKey,
    key_check,
    ledger_keys,
    master_key,
    salted_ledger_keys,
)
from bookkeeper_aio.protocol.errors import DigestMismatch
from metadata import ledger_metadata as lm
from metadata.ledger_metadata import InvalidMetadata, LedgerMetadata

PASSWORD = b"tenant-pw-4711"
ITERATIONS = 1_000  # the derivation is the same at any rounds; fewer keep the test fast
HMAC_SHA256 = DigestType.HMAC_SHA256.value


def _metadata(ledger_id: int, new: NewLedgerKeys) -> LedgerMetadata:
    return LedgerMetadata.new(
        ledger_id,
        ["b1", "b2", "b3"],
        write_quorum=2,
        ack_quorum=2,
        digest_type=HMAC_SHA256,
        password_hash=new.keys.key_check,
        key_salt=new.salt,
        key_iterations=new.iterations,
        key_ledger_salt=new.ledger_salt,
        key_format=new.key_format,
    )


def _password_only_mac(password: bytes, body: bytes) -> bool:
    """The attacker's test of formats 1 to 3: does ``password`` give the body's MAC, no PBKDF2?"""
    mac_key = hashlib.sha256(b"bookkeeper-aio/mac-key\x00" + password).digest()
    header, tag, payload = body[:32], body[32:64], body[64:]
    return hmac.compare_digest(hmac.new(mac_key, header + payload, hashlib.sha256).digest(), tag)


@pytest.fixture(autouse=True)
def fresh_keys() -> None:
    keys.clear_cache()


async def test_a_new_ledgers_mac_key_is_the_hmac_of_its_pbkdf2_derived_secret() -> None:
    new = await NewLedgerKeys.make(PASSWORD, ITERATIONS)
    assert new.key_format == 4
    key = new.keys.master_key
    assert type(key) is MasterKey
    # Computed here from the definition (docs/protocol.md §6.3), not through the code under test.
    secret = hashlib.pbkdf2_hmac("sha256", PASSWORD, new.salt, ITERATIONS)
    ledger_secret = hmac.new(
        secret, b"bookkeeper-aio/ledger-key-4\x00" + new.ledger_salt, hashlib.sha256
    ).digest()
    assert key == hmac.new(ledger_secret, b"bookkeeper-aio/master-key", hashlib.sha256).digest()
    assert key.mac_key == hmac.new(ledger_secret, b"bookkeeper-aio/mac-key", hashlib.sha256).digest()
    assert new.keys.key_check == key_check(bytes(key))
    # Neither the master key (the bookies hold it) nor format 3's keys are the MAC key.
    assert key.mac_key not in (bytes(key), salted_ledger_keys(secret, new.ledger_salt).master_key)
    # The master key goes on the wire as the plain bytes: its repr and bytes() do not show the MAC key.
    assert bytes(key) == key
    assert key.mac_key.hex() not in repr(key)
    assert key.mac_key not in bytes(key)


async def test_two_ledgers_of_one_password_have_different_mac_keys_and_no_password_only_mac() -> None:
    first = await NewLedgerKeys.make(PASSWORD, ITERATIONS)
    second = await NewLedgerKeys.make(PASSWORD, ITERATIONS)
    assert first.salt == second.salt  # one PBKDF2 per client and password, as in format 3
    mac_keys = {first.keys.master_key.mac_key, second.keys.master_key.mac_key}  # type: ignore[attr-defined]
    assert len(mac_keys) == 2
    body_1 = EntryCodec(HMAC_SHA256, PASSWORD, first.keys.master_key).encode(1, 0, -1, 5, b"hello")
    body_2 = EntryCodec(HMAC_SHA256, PASSWORD, second.keys.master_key).encode(1, 0, -1, 5, b"hello")
    assert body_1[32:64] != body_2[32:64]  # the same entry of two ledgers: different MACs
    # The repro's attack: the password alone (one SHA-256) no longer gives the MAC.
    assert not _password_only_mac(PASSWORD, body_1)
    assert not _password_only_mac(PASSWORD, body_2)
    # Format 3's MAC was exactly that.
    old = EntryCodec(HMAC_SHA256, PASSWORD, salted_ledger_keys(os.urandom(32), os.urandom(16)).master_key)
    assert _password_only_mac(PASSWORD, old.encode(1, 0, -1, 5, b"hello"))


async def test_a_format_4_ledger_opens_with_its_password_and_its_bodies_verify() -> None:
    new = await NewLedgerKeys.make(PASSWORD, ITERATIONS)
    md = lm.decode(lm.encode(_metadata(9, new)), key="k", ledger_id=9)  # key_format survives the store
    assert md.key_format == 4
    writer = EntryCodec(md.digest_type, PASSWORD, new.keys.master_key)  # what the add path builds
    body = writer.encode(9, 0, -1, 6, b"secret")
    keys.clear_cache()  # another process: the PBKDF2 again, from the metadata
    reader = codec_for(md, PASSWORD)
    assert reader.master_key == new.keys.master_key
    assert reader.decode(body, 9, 0).payload == b"secret"
    assert codec_for(md, PASSWORD).encode(9, 0, -1, 6, b"secret") == body
    with pytest.raises(Unauthorized):
        codec_for(md, b"wrong")
    # A codec of the password-only MAC key (format 3's) refuses the body.
    with pytest.raises(DigestMismatch):
        EntryCodec(md.digest_type, PASSWORD, bytes(new.keys.master_key)).decode(body, 9, 0)


@pytest.mark.parametrize("fmt", [1, 2, 3])
def test_older_formats_keep_their_password_mac_and_still_verify(fmt: int) -> None:
    """Ledgers made before format 4 are what they are: bodies their writers encoded with the
    password-only MAC key verify, and a writer reopening them encodes the same bytes."""
    salt, ledger_salt = os.urandom(16), os.urandom(16)
    fields: dict[str, object] = {}
    if fmt == 1:
        key, check = master_key(PASSWORD), keys.password_hash(PASSWORD)
    elif fmt == 2:
        key, check = ledger_keys(PASSWORD, salt, ITERATIONS)
        fields = {"key_salt": salt, "key_iterations": ITERATIONS}
    else:
        secret = hashlib.pbkdf2_hmac("sha256", PASSWORD, salt, ITERATIONS)
        key, check = salted_ledger_keys(secret, ledger_salt)
        fields = {"key_salt": salt, "key_iterations": ITERATIONS, "key_ledger_salt": ledger_salt}
    md = LedgerMetadata.new(
        5, ["b1"], write_quorum=1, ack_quorum=1, digest_type=HMAC_SHA256, password_hash=check, **fields
    )
    assert md.key_format == 0
    old_body = EntryCodec(HMAC_SHA256, PASSWORD, key).encode(5, 3, 2, 10, b"old entry")
    assert _password_only_mac(PASSWORD, old_body)  # what that format is
    codec = codec_for(md, PASSWORD)
    assert codec.master_key == key
    assert codec.decode(old_body, 5, 3).payload == b"old entry"
    assert codec.encode(5, 3, 2, 10, b"old entry") == old_body


def test_metadata_refuses_an_unknown_key_format_or_format_4_without_its_salts() -> None:
    base = {"write_quorum": 1, "ack_quorum": 1, "key_salt": b"s" * 16, "key_iterations": 1}
    with pytest.raises(InvalidMetadata, match="key_format"):
        LedgerMetadata.new(1, ["b1"], key_ledger_salt=b"l" * 16, key_format=5, **base)  # type: ignore[arg-type]
    with pytest.raises(InvalidMetadata, match="key_format"):
        LedgerMetadata.new(1, ["b1"], key_format=4, **base)  # type: ignore[arg-type]
