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
reopens none, so the PBKDF2 cost (~5 ms) is paid once per ledger and process. The client's create
and open derive in a worker thread (:func:`derive_keys`; hashlib's PBKDF2 releases the GIL): on
the event loop those ~5 ms would stall every append in flight, e.g. a log writer's during its roll.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections import OrderedDict
from concurrent.futures import Executor, ThreadPoolExecutor

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


_cache: OrderedDict[tuple[bytes, bytes, int], LedgerKeys] = OrderedDict()
_executor: Executor | None = None


def _cached(key: tuple[bytes, bytes, int]) -> LedgerKeys | None:
    """A derivation made before (least recently used ones go first when the cache is full)."""
    keys = _cache.get(key)
    if keys is not None:
        _cache.move_to_end(key)
    return keys


def _remember(key: tuple[bytes, bytes, int], keys: LedgerKeys) -> LedgerKeys:
    _cache[key] = keys
    if len(_cache) > KEY_CACHE_SIZE:
        _cache.popitem(last=False)
    return keys


def _derive(password: bytes, salt: bytes, iterations: int) -> LedgerKeys:
    """The keys of ``(password, salt, iterations)``, computed here (blocking) unless cached."""
    key = (password, salt, iterations)
    keys = _cached(key)
    return keys if keys is not None else _remember(key, ledger_keys(password, salt, iterations))


async def derive_keys(
    password: bytes, salt: bytes, iterations: int, executor: Executor | None = None
) -> LedgerKeys:
    """:func:`_derive` with the PBKDF2 run in ``executor`` (default: one shared worker thread), so
    the event loop goes on meanwhile."""
    key = (password, salt, iterations)
    keys = _cached(key)
    if keys is None:
        global _executor  # one pool per process, made on first use
        if executor is None:
            if _executor is None:
                _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bkaio-keys")
            executor = _executor
        loop = asyncio.get_running_loop()
        keys = _remember(key, await loop.run_in_executor(executor, ledger_keys, password, salt, iterations))
    return keys


class NewLedgerKeys:
    """The key material of a ledger about to be created: what its metadata stores and the key."""

    __slots__ = ("iterations", "keys", "salt")

    def __init__(self, salt: bytes, iterations: int, keys: LedgerKeys) -> None:
        self.salt = salt
        self.iterations = iterations
        self.keys = keys

    @classmethod
    async def make(
        cls, password: bytes, iterations: int = KEY_ITERATIONS, executor: Executor | None = None
    ) -> NewLedgerKeys:
        salt = os.urandom(KEY_SALT_BYTES)
        return cls(salt, iterations, await derive_keys(password, salt, iterations, executor))


async def open_codec(md: LedgerMetadata, password: bytes, executor: Executor | None = None) -> EntryCodec:
    """:func:`codec_for` with the key derivation off the event loop (:func:`derive_keys`)."""
    if md.key_salt:
        await derive_keys(password, md.key_salt, md.key_iterations, executor)  # cached for the check
    return codec_for(md, password)


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
