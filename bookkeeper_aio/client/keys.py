"""Ledger keys on the client: what a new ledger's metadata stores, and the codec (digest + master
key) an opener gets once its password checks out.

Every request that touches a ledger's data (add, read, fence, recovery read and add, LAC reads,
WRITE_LAC, FORCE) carries the ledger's master key, and bookies refuse a wrong one with EUA. The key
travels in the :class:`~bookkeeper_aio.protocol.digest.EntryCodec` every reader and writer already
holds, so no path can read without having checked the password first.

Key format 2 (every ledger created now): a random 16-byte salt and PBKDF2 rounds stored in the
metadata, the master key derived from password + salt, and the metadata's ``password_hash`` the
check value of that key (``digest.key_check``). Format 1 (ledgers created before: no salt in their
metadata): the unsalted master key their bookies hold, checked at open against the unsalted hash.
Derivations are cached per (password, salt, rounds): a log reader opens each ledger once, a tailer
reopens none, so the PBKDF2 cost (~5 ms) is paid once per ledger and process.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os

from bookkeeper_aio.errors import Unauthorized
from bookkeeper_aio.protocol.digest import (
    KEY_ITERATIONS,
    KEY_SALT_BYTES,
    EntryCodec,
    LedgerKeys,
    ledger_keys,
    master_key,
)
from metadata.ledger_metadata import LedgerMetadata

KEY_CACHE_SIZE = 4096
"""Derivations kept per process (a few hundred bytes each)."""


def password_hash(password: bytes) -> bytes:
    """What key-format-1 ledger metadata stores to check a password at open (never the password
    itself, and not the master key either: reading metadata must not let anyone write to bookies)."""
    return hashlib.sha256(b"bookkeeper-aio/password-check\x00" + password).digest()


@functools.lru_cache(maxsize=KEY_CACHE_SIZE)
def _derive(password: bytes, salt: bytes, iterations: int) -> LedgerKeys:
    return ledger_keys(password, salt, iterations)


class NewLedgerKeys:
    """The key material of a ledger about to be created: what its metadata stores and the key."""

    __slots__ = ("iterations", "keys", "salt")

    def __init__(self, password: bytes, iterations: int = KEY_ITERATIONS) -> None:
        self.salt = os.urandom(KEY_SALT_BYTES)
        self.iterations = iterations
        self.keys = _derive(password, self.salt, iterations)


def check_password(md: LedgerMetadata, password: bytes) -> bytes:
    """The ledger's master key if ``password`` is the ledger's; raises :class:`Unauthorized`
    (constant-time compare of the check values)."""
    if md.key_salt:
        keys = _derive(password, md.key_salt, md.key_iterations)
        if not hmac.compare_digest(md.password_hash, keys.key_check):
            raise Unauthorized(f"wrong password for ledger {md.ledger_id}")
        return keys.master_key
    if md.password_hash and not hmac.compare_digest(md.password_hash, password_hash(password)):
        raise Unauthorized(f"wrong password for ledger {md.ledger_id}")
    return master_key(password)


def codec_for(md: LedgerMetadata, password: bytes) -> EntryCodec:
    """The entry codec of ledger ``md`` opened with ``password``: its digest and its master key.
    Raises :class:`Unauthorized` for a wrong password."""
    return EntryCodec(md.digest_type, password, check_password(md, password))


def password_matches(md: LedgerMetadata, password: bytes) -> bool:
    """Whether ``password`` is the ledger's (for callers that try several)."""
    try:
        check_password(md, password)
    except Unauthorized:
        return False
    return True
