"""Entry bytes as stored on bookies and verified by readers.

An entry body is::

    header  = ledger_id:i64 | entry_id:i64 | lac:i64 | length:i64     (32 bytes, big-endian)
    digest  = over header + payload: CRC32C (4 bytes) | HMAC-SHA256 (32 bytes) | none (0 bytes)
    payload = the application's bytes

``lac`` is the writer's last-add-confirmed when the entry was sent (piggybacked), ``length`` the
ledger's cumulative payload length up to and including this entry. The bookie treats the body as
opaque except for the header (:func:`peek_header`); only readers verify the digest, and a body that
fails verification is never handed to an application.

Keys derive from the ledger password with domain separation: the *master key* (sent with every
request that touches a ledger's data, checked by bookies) and the *MAC key* (HMAC digests) differ,
so knowing one does not give the other.

Ledgers of key format 2 (:func:`ledger_keys`) derive their master key from the password *and a
random per-ledger salt* through PBKDF2-HMAC-SHA256, and the metadata stores only
``key_check = SHA-256(prefix + master_key)``: reading metadata gives neither the password nor a key
a bookie accepts, a guess of the password costs a PBKDF2 run per ledger (no table serves two
ledgers), and a bookie can check a presented key against the metadata (how a squatted ledger record
is re-keyed, :mod:`bookie.ledger_keys`). Key format 3 (ledgers created before format 4,
:func:`salted_ledger_keys`) runs the PBKDF2 once per client and password: the salt of that run is
the client's (random, kept for the password in the client's memory), and each ledger's key is an
HMAC of its result with a random per-ledger salt; docs/security.md, *Key format 3*, says why that
keeps the same promises. Ledgers of format 1 (no salt in their metadata) keep the unsalted
:func:`master_key` their bookies already hold.

In formats 1 to 3 the HMAC digest's MAC key is ``SHA-256(prefix + password)``: no salt, no PBKDF2,
so one entry body of an ``hmac-sha256`` ledger lets anyone test password guesses at one SHA-256 and
one HMAC each. Key format 4 (every ledger created now, :func:`keyed_ledger_keys`) derives the MAC
key from the ledger's secret, as the master key: a guess then costs the PBKDF2 run, and the MAC key
differs per ledger. The master key travels with it (:class:`MasterKey`), the MAC key never on the
wire.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple

import crc32c

from bookkeeper_aio.protocol.errors import DigestMismatch, ProtocolError

HEADER = struct.Struct(">qqqq")
HEADER_BYTES = HEADER.size
_CRC = struct.Struct(">I")
_unpack_header = HEADER.unpack
_unpack_crc32c_head = struct.Struct(">qqqqI").unpack_from  # the header, then a CRC32C digest
_CRC32C_START = HEADER_BYTES + _CRC.size
_crc32c = crc32c.crc32c
_new_tuple = tuple.__new__  # NamedTuple construction without the generated __new__ (3x faster)


class DigestType(enum.StrEnum):
    CRC32C = "crc32c"
    HMAC_SHA256 = "hmac-sha256"
    NONE = "none"


DIGEST_BYTES = {DigestType.CRC32C: 4, DigestType.HMAC_SHA256: 32, DigestType.NONE: 0}
_CRC32C_TYPE = DigestType.CRC32C
"""As a module name, asked on every entry encoded or verified: ``DigestType.CRC32C`` goes through
``EnumType.__getattr__``'s slow attribute path on Python 3.11 (about 0.3 us)."""
_DIGEST_TYPES = {digest_type.value: digest_type for digest_type in DigestType}
"""Value -> member: ``DigestType(value)`` (every codec made, every ledger opened) is a slower call."""


class EntryHeader(NamedTuple):
    ledger_id: int
    entry_id: int
    lac: int
    length: int


class Entry(NamedTuple):
    ledger_id: int
    entry_id: int
    lac: int
    length: int
    payload: bytes


def master_key(password: bytes) -> bytes:
    """The key a ledger's bookies check on every add and fence (32 bytes)."""
    return hashlib.sha256(b"bookkeeper-aio/master-key\x00" + password).digest()


KEY_SALT_BYTES = 16
KEY_ITERATIONS = 20_000
"""PBKDF2 rounds for new ledgers (~5 ms on this machine kind, once per client and password:
clients cache the result per password and salt). Stored in each ledger's metadata, so it can be
raised later."""
_KEY_CHECK_PREFIX = b"bookkeeper-aio/key-check\x00"
_LEDGER_SECRET_LABEL = b"bookkeeper-aio/ledger-key\x00"
_LEDGER_SECRET_LABEL_4 = b"bookkeeper-aio/ledger-key-4\x00"
_MASTER_KEY_LABEL = b"bookkeeper-aio/master-key"
_MAC_KEY_LABEL = b"bookkeeper-aio/mac-key"
KEY_FORMAT_MAC_FROM_SECRET = 4
"""The key format whose MAC key derives from the ledger's secret (metadata's ``key_format``)."""


class MasterKey(bytes):
    """A key-format-4 master key: the bytes the bookies check (a ``bytes``, sent as such), carrying
    the MAC key of the ledger's HMAC digests for the codec (:class:`EntryCodec`), so that whatever
    holds the master key to write or read the ledger holds its MAC key too. The MAC key is never
    sent, printed or compared: ``bytes`` equality, ``repr`` and packing see the master key only."""

    mac_key: bytes

    def __new__(cls, key: bytes, mac_key: bytes) -> MasterKey:
        self = super().__new__(cls, key)
        self.mac_key = mac_key
        return self

    def __getnewargs__(self) -> tuple[bytes, bytes]:  # type: ignore[override]
        """Copies and pickles keep the MAC key."""
        return bytes(self), self.mac_key


class LedgerKeys(NamedTuple):
    master_key: bytes
    """Sent to the bookies with every request on the ledger's data."""
    key_check: bytes
    """What the metadata stores: ``SHA-256(prefix + master_key)`` (format 2)."""


def key_check(master_key: bytes) -> bytes:
    """The metadata's check value of a format-2 master key (what a bookie compares against)."""
    return hashlib.sha256(_KEY_CHECK_PREFIX + master_key).digest()


def password_secret(password: bytes, salt: bytes, iterations: int) -> bytes:
    """PBKDF2-HMAC-SHA256 of the password: the slow step, one per (password, salt, rounds)."""
    return hashlib.pbkdf2_hmac("sha256", password, salt, iterations)


def keys_of_secret(secret: bytes) -> LedgerKeys:
    """The master key (an HMAC of a ledger's secret, domain separated from the check value and the
    MAC key) and its check value."""
    key = hmac.digest(secret, _MASTER_KEY_LABEL, "sha256")
    return LedgerKeys(key, key_check(key))


def ledger_keys(password: bytes, salt: bytes, iterations: int) -> LedgerKeys:
    """The keys of a format-2 ledger: its secret is the PBKDF2 of the password with the ledger's
    own salt."""
    return keys_of_secret(password_secret(password, salt, iterations))


def salted_ledger_keys(secret: bytes, ledger_salt: bytes) -> LedgerKeys:
    """The keys of a format-3 ledger from ``secret`` (:func:`password_secret` of the password with
    the creating client's salt) and the ledger's own random salt: its secret is
    ``HMAC-SHA256(secret, label + ledger_salt)``, distinct per ledger, and neither it nor the
    master key gives ``secret`` or another ledger's key."""
    ledger_secret = hmac.digest(secret, _LEDGER_SECRET_LABEL + ledger_salt, "sha256")
    return keys_of_secret(ledger_secret)


def keyed_ledger_keys(secret: bytes, ledger_salt: bytes) -> LedgerKeys:
    """The keys of a format-4 ledger: as format 3's (:func:`salted_ledger_keys`) but with a ledger
    secret of another label, ``HMAC-SHA256(secret, label4 + ledger_salt)``, from which both the
    master key and the MAC key of its HMAC digests derive (each an HMAC of it with its own label).
    So the MAC key costs the PBKDF2 behind ``secret`` to compute from a password, differs per
    ledger, and neither the master key (which bookies hold) nor the check value gives it."""
    ledger_secret = hmac.digest(secret, _LEDGER_SECRET_LABEL_4 + ledger_salt, "sha256")
    key = hmac.digest(ledger_secret, _MASTER_KEY_LABEL, "sha256")
    mac_key = hmac.digest(ledger_secret, _MAC_KEY_LABEL, "sha256")
    return LedgerKeys(MasterKey(key, mac_key), key_check(key))


def _mac_key(password: bytes) -> bytes:
    """The MAC key of key formats 1 to 3: of the password alone (see the module doc)."""
    return hashlib.sha256(b"bookkeeper-aio/mac-key\x00" + password).digest()


def peek_header(body: bytes | memoryview) -> EntryHeader:
    """The header of an entry body, without checking the digest (what a bookie needs)."""
    if len(body) < HEADER_BYTES:
        raise ProtocolError(f"entry body of {len(body)} bytes is shorter than its {HEADER_BYTES}-byte header")
    return EntryHeader._make(HEADER.unpack_from(body, 0))


class EntryCodec:
    """Encodes and verifies entry bodies for one ledger's digest type and password."""

    __slots__ = ("_mac_key", "digest_bytes", "digest_type", "master_key")

    def __init__(
        self, digest_type: DigestType | str, password: bytes = b"", key: bytes | None = None
    ) -> None:
        known = _DIGEST_TYPES.get(digest_type) if isinstance(digest_type, str) else None
        self.digest_type = known or DigestType(digest_type)  # the call refuses what is not one
        self.digest_bytes = DIGEST_BYTES[self.digest_type]
        # a format-4 key carries its MAC key; formats 1 to 3 derive it from the password alone
        self._mac_key = key.mac_key if type(key) is MasterKey else _mac_key(password)
        self.master_key = master_key(password) if key is None else key
        """The ledger's master key, which every read, fence and add carries (``key``; by default
        the format-1 key of ``password``)."""

    def _digest(self, header: bytes, payload: bytes | memoryview) -> bytes:
        if self.digest_type is _CRC32C_TYPE:
            return _CRC.pack(crc32c.crc32c(payload, crc32c.crc32c(header)))
        if self.digest_type is DigestType.HMAC_SHA256:
            mac = hmac.new(self._mac_key, header, hashlib.sha256)
            mac.update(payload)
            return mac.digest()
        return b""

    def encode(self, ledger_id: int, entry_id: int, lac: int, length: int, payload: bytes) -> bytes:
        header = HEADER.pack(ledger_id, entry_id, lac, length)
        return b"".join((header, self._digest(header, payload), payload))

    def decode(self, body: bytes, ledger_id: int, entry_id: int) -> Entry:
        """Verify ``body`` is entry ``entry_id`` of ``ledger_id`` and return it.

        Raises :class:`DigestMismatch` for a corrupt body, a wrong digest or the wrong ids.
        """
        out: list[Entry] = []
        self.decode_run((body,), ledger_id, entry_id, 1, out)
        return out[0]

    def decode_run(
        self,
        bodies: Sequence[bytes | memoryview],
        ledger_id: int,
        first_entry_id: int,
        step: int,
        out: list[Entry],
    ) -> None:
        """Verify ``bodies[i]`` is entry ``first_entry_id + i * step`` of ``ledger_id``, as
        :meth:`decode` does, and append each to ``out`` in order (a batch read's answer, decoded in
        one loop). Raises :class:`DigestMismatch` at the first that fails: those before it are in
        ``out``."""
        entry_id = first_entry_id
        if self.digest_type is _CRC32C_TYPE:  # the common case, in one unpack per body
            for body in bodies:
                if len(body) < _CRC32C_START:
                    raise _truncated(body, ledger_id, entry_id)
                lid, eid, lac, length, digest = _unpack_crc32c_head(body)
                payload = body[_CRC32C_START:]  # the one copy of a payload
                if _crc32c(payload, _crc32c(body[:HEADER_BYTES])) != digest:  # not a secret: ints
                    raise DigestMismatch(f"entry {ledger_id}:{entry_id}: digest mismatch (crc32c)")
                if lid != ledger_id or eid != entry_id:
                    raise _wrong_entry(ledger_id, entry_id, lid, eid)
                if type(payload) is not bytes:
                    payload = bytes(payload)
                out.append(_new_tuple(Entry, (lid, eid, lac, length, payload)))
                entry_id += step
            return
        start = HEADER_BYTES + self.digest_bytes
        for body in bodies:
            if len(body) < start:
                raise _truncated(body, ledger_id, entry_id)
            header = bytes(body[:HEADER_BYTES])
            payload = bytes(body[start:])
            if not hmac.compare_digest(self._digest(header, payload), body[HEADER_BYTES:start]):
                raise DigestMismatch(f"entry {ledger_id}:{entry_id}: digest mismatch ({self.digest_type})")
            lid, eid, lac, length = _unpack_header(header)
            if lid != ledger_id or eid != entry_id:
                raise _wrong_entry(ledger_id, entry_id, lid, eid)
            out.append(_new_tuple(Entry, (lid, eid, lac, length, payload)))
            entry_id += step


def _truncated(body: bytes | memoryview, ledger_id: int, entry_id: int) -> DigestMismatch:
    return DigestMismatch(f"entry {ledger_id}:{entry_id}: body of {len(body)} bytes is truncated")


def _wrong_entry(ledger_id: int, entry_id: int, lid: int, eid: int) -> DigestMismatch:
    return DigestMismatch(f"asked for entry {ledger_id}:{entry_id}, body is {lid}:{eid}")
