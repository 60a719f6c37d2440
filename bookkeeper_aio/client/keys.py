"""Ledger keys on the client: what a new ledger's metadata stores, and the codec (digest + master
key) an opener gets once its password checks out.

Every request that touches a ledger's data (add, read, fence, recovery read and add, LAC reads,
WRITE_LAC, FORCE) carries the ledger's master key, and bookies refuse a wrong one with EUA. The key
travels in the :class:`~bookkeeper_aio.protocol.digest.EntryCodec` every reader and writer already
holds, so no path can read without having checked the password first.

Key format 4 (every ledger created now): format 3's salts and derivation, with a ledger secret of
its own label from which the MAC key of HMAC digests derives too (``digest.keyed_ledger_keys``; the
metadata's ``key_format`` is 4). Formats 1 to 3 keep their password-only MAC key: their ledgers keep
reading and writing as they were made. Key format 3: the metadata stores the PBKDF2 rounds, the salt
of the PBKDF2 run (this process's for the password: random, made on the first create with it, kept
in memory only) and the ledger's own random salt; the master key is an HMAC of the PBKDF2 result
with the ledger's salt (``digest.salted_ledger_keys``), and the metadata's ``password_hash`` the
check value of that key (``digest.key_check``). So a client creating many ledgers with one password
runs PBKDF2 once (~5 ms), not once per ledger (100,000 creates were ~8 minutes of CPU), and a reader
opening them runs it once too. Key format 2 (ledgers created before it): the salt is the ledger's
own and the PBKDF2 result its secret. Format 1 (no salt in the metadata): the unsalted master key
their bookies hold, checked at open against the unsalted hash. PBKDF2 results are cached per
(password, salt, rounds): a log reader opens each ledger once, a tailer reopens none. The client's
create and open derive in a worker thread (:func:`derive_secret`; hashlib's PBKDF2 releases the
GIL): on the event loop those ~5 ms would stall every append in flight, e.g. a log writer's during
its roll.
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
    KEY_FORMAT_MAC_FROM_SECRET,
    KEY_ITERATIONS,
    KEY_SALT_BYTES,
    EntryCodec,
    LedgerKeys,
    keyed_ledger_keys,
    keys_of_secret,
    master_key,
    password_secret,
    salted_ledger_keys,
)
from metadata.ledger_metadata import LedgerMetadata

KEY_CACHE_SIZE = 4096
"""PBKDF2 results kept per process (a few hundred bytes each)."""


def password_hash(password: bytes) -> bytes:
    """What key-format-1 ledger metadata stores to check a password at open (never the password
    itself, and not the master key either: reading metadata must not let anyone write to bookies)."""
    return hashlib.sha256(b"bookkeeper-aio/password-check\x00" + password).digest()


_cache: OrderedDict[tuple[bytes, bytes, int], bytes] = OrderedDict()
"""(password, salt, rounds) -> the PBKDF2 result."""
_client_salts: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()
"""(password, rounds) -> this process's salt for the ledgers it creates with them (format 3)."""
_keys_cache: OrderedDict[tuple[bytes, bytes, int, bytes, int], LedgerKeys] = OrderedDict()
"""(password, salt, rounds, ledger salt, key format) -> a ledger's keys (HMACs of a PBKDF2 result)."""
_running: dict[tuple[asyncio.AbstractEventLoop, tuple[bytes, bytes, int]], asyncio.Future[bytes]] = {}
"""PBKDF2 runs under way, awaited by every derivation of the same triple on that loop meanwhile."""
_executor: Executor | None = None


def clear_cache() -> None:
    """Forget every PBKDF2 result and client salt (as a fresh process would)."""
    _cache.clear()
    _keys_cache.clear()
    _client_salts.clear()


def _cached(key: tuple[bytes, bytes, int]) -> bytes | None:
    """A PBKDF2 result made before (least recently used ones go first when the cache is full)."""
    secret = _cache.get(key)
    if secret is not None:
        _cache.move_to_end(key)
    return secret


def _remember(key: tuple[bytes, bytes, int], secret: bytes) -> bytes:
    _cache[key] = secret
    if len(_cache) > KEY_CACHE_SIZE:
        _cache.popitem(last=False)
    return secret


def _secret(password: bytes, salt: bytes, iterations: int) -> bytes:
    """The PBKDF2 result of ``(password, salt, iterations)``, computed here (blocking) unless cached."""
    key = (password, salt, iterations)
    secret = _cached(key)
    return secret if secret is not None else _remember(key, password_secret(password, salt, iterations))


async def derive_secret(
    password: bytes, salt: bytes, iterations: int, executor: Executor | None = None
) -> bytes:
    """:func:`_secret` with the PBKDF2 run in ``executor`` (default: one shared worker thread), so
    the event loop goes on meanwhile."""
    key = (password, salt, iterations)
    secret = _cached(key)
    if secret is not None:
        return secret
    loop = asyncio.get_running_loop()
    running = _running.get((loop, key))
    if running is not None:  # e.g. many creates at once with one password: one PBKDF2 run
        await asyncio.wait((running,))  # a cancelled wait leaves the run to the others
        if not running.cancelled():
            return running.result()
        return await derive_secret(password, salt, iterations, executor)  # its first caller gave up
    global _executor  # one pool per process, made on first use
    if executor is None:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bkaio-keys")
        executor = _executor
    run = loop.run_in_executor(executor, password_secret, password, salt, iterations)
    _running[loop, key] = run
    try:
        secret = await run
    finally:
        if _running.get((loop, key)) is run:
            del _running[loop, key]
    return _remember(key, secret)


async def derive_keys(
    password: bytes, salt: bytes, iterations: int, executor: Executor | None = None
) -> LedgerKeys:
    """The keys of a format-2 ledger (its own salt), the PBKDF2 off the event loop."""
    return keys_of_secret(await derive_secret(password, salt, iterations, executor))


def _client_salt(password: bytes, iterations: int) -> bytes:
    """This process's salt for ``password`` (random, made on first use): every ledger it creates
    with that password shares the PBKDF2 run, and each gets its own salt besides."""
    key = (password, iterations)
    salt = _client_salts.get(key)
    if salt is None:
        salt = _client_salts[key] = os.urandom(KEY_SALT_BYTES)
        if len(_client_salts) > KEY_CACHE_SIZE:
            _client_salts.popitem(last=False)
    else:
        _client_salts.move_to_end(key)
    return salt


class NewLedgerKeys:
    """The key material of a ledger about to be created: what its metadata stores and the key.
    ``ledger_salt`` empty: key format 2 (``salt`` is the ledger's own); ``key_format`` 0: the
    salts say the format (2 or 3), 4: key format 4."""

    __slots__ = ("iterations", "key_format", "keys", "ledger_salt", "salt")

    def __init__(
        self, salt: bytes, iterations: int, keys: LedgerKeys, ledger_salt: bytes = b"", key_format: int = 0
    ) -> None:
        self.salt = salt
        self.iterations = iterations
        self.keys = keys
        self.ledger_salt = ledger_salt
        self.key_format = key_format

    @classmethod
    async def make(
        cls, password: bytes, iterations: int = KEY_ITERATIONS, executor: Executor | None = None
    ) -> NewLedgerKeys:
        """Key format 4: the PBKDF2 of this process's salt for the password (run on the first
        create with it only), and a fresh salt of the ledger's own; the MAC key derives from the
        ledger's secret."""
        salt = _client_salt(password, iterations)
        secret = await derive_secret(password, salt, iterations, executor)
        ledger_salt = os.urandom(KEY_SALT_BYTES)
        keys = keyed_ledger_keys(secret, ledger_salt)
        return cls(salt, iterations, keys, ledger_salt, KEY_FORMAT_MAC_FROM_SECRET)


async def open_codec(md: LedgerMetadata, password: bytes, executor: Executor | None = None) -> EntryCodec:
    """:func:`codec_for` with the PBKDF2 off the event loop (:func:`derive_secret`)."""
    if md.key_salt:
        await derive_secret(password, md.key_salt, md.key_iterations, executor)  # cached for the check
    return codec_for(md, password)


def _salted_keys(md: LedgerMetadata, password: bytes) -> LedgerKeys:
    """The keys of a ledger of key format 2, 3 or 4 (``md.key_salt`` set) for ``password``; kept
    as the PBKDF2 results are (a ledger opened again, by recoveries or a tailer, derives none)."""
    cache_key = (password, md.key_salt, md.key_iterations, md.key_ledger_salt, md.key_format)
    keys = _keys_cache.get(cache_key)
    if keys is not None:
        _keys_cache.move_to_end(cache_key)
        return keys
    secret = _secret(password, md.key_salt, md.key_iterations)
    if md.key_format == KEY_FORMAT_MAC_FROM_SECRET:
        keys = keyed_ledger_keys(secret, md.key_ledger_salt)
    elif md.key_ledger_salt:
        keys = salted_ledger_keys(secret, md.key_ledger_salt)
    else:
        keys = keys_of_secret(secret)
    _keys_cache[cache_key] = keys
    if len(_keys_cache) > KEY_CACHE_SIZE:
        _keys_cache.popitem(last=False)
    return keys


def check_password(md: LedgerMetadata, password: bytes) -> bytes:
    """The ledger's master key if ``password`` is the ledger's; raises :class:`Unauthorized`
    (constant-time compare of the check values)."""
    if md.key_salt:
        keys = _salted_keys(md, password)
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
