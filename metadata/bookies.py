"""Bookie registration (lease-bound keys under writable/ and readonly/), discovery, and cookies.

Keys: ``<root>/bookies/writable/<bookie id>`` or ``<root>/bookies/readonly/<bookie id>``, bound to the
bookie's lease, value = msgpack map (`BookieInfo`). ``<root>/cookies/<bookie id>``: the bookie's
data-directory identity (`Cookie`), created once and changed only by CAS.

`BookieRegistration` owns one background task (started in ``start()``, ended in ``close()``/``abort()``)
that keeps the lease alive every ``ttl_s / 3`` seconds and checks that the key is still ours. When the
lease is gone (the process was paused past the TTL, or etcd lost it), it grants a new lease and
registers again; when the store is unreachable it retries with backoff.

A key already present under the bookie id (another lease) blocks a registration: ``start()`` waits
for it to expire and then refuses with `RegistrationHeld`, unless the ``is_previous_self`` judge
(given by the bookie, which alone can tell) says it was left by an earlier, dead incarnation of this
same bookie (a kill -9): then that incarnation's lease is revoked at once, which deletes every key it
held (writable/ and readonly/), and the registration goes ahead without waiting for the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import types
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack
import structlog

from bookkeeper_aio.common.backoff import Backoff
from bookkeeper_aio.common.log_limit import LogLimiter
from metadata.envelope import unpack_map
from metadata.errors import (
    BadVersion,
    CasResultUnknown,
    InvalidMetadata,
    LeaseExpired,
    MetadataError,
    MetadataFormatError,
    NodeExists,
    NoNode,
    WatchCompacted,
)
from metadata.keys import ClusterKeys, validate_name
from metadata.store import EventKind, KeyValue, MetadataStore, list_all

log = structlog.get_logger("metadata.bookies")

BOOKIE_FORMAT_VERSION = 1
COOKIE_FORMAT_VERSION = 1
REGISTRATION_TTL_S_DEFAULT = 10
VALUE_BYTES_MAX = 64 * 1024
# How long start() waits for a previous incarnation's key (same bookie id, old lease) to expire.
STALE_KEY_WAIT_TTLS = 2


class RegistrationHeld(NodeExists):
    """The bookie id stayed registered under another lease (kept alive) for the whole wait.

    ``holder``: what that registration says (None when it vanished or is unreadable)."""

    def __init__(self, key: str, holder: BookieInfo | None) -> None:
        super().__init__(key)
        self.holder = holder


class BookieState(enum.Enum):
    WRITABLE = "writable"
    READONLY = "readonly"


BOOKIE_TRANSITIONS: Mapping[BookieState, frozenset[BookieState]] = types.MappingProxyType(
    {
        BookieState.WRITABLE: frozenset({BookieState.READONLY}),
        BookieState.READONLY: frozenset({BookieState.WRITABLE}),
    }
)


@dataclass(frozen=True, slots=True)
class BookieInfo:
    """What a bookie publishes about itself. ``attributes``: free-form str -> str (e.g. disk info)."""

    bookie_id: str
    host: str
    port: int
    state: BookieState = BookieState.WRITABLE
    attributes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_name(self.bookie_id, "bookie id")
        if not 0 < self.port < 65536:
            raise InvalidMetadata(f"bad port {self.port} for bookie {self.bookie_id}")
        object.__setattr__(self, "attributes", types.MappingProxyType(dict(self.attributes)))

    def encode(self) -> bytes:
        body = {
            "format_version": BOOKIE_FORMAT_VERSION,
            "bookie_id": self.bookie_id,
            "host": self.host,
            "port": self.port,
            "state": self.state.value,
            "attributes": dict(self.attributes),
        }
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, key: str, data: bytes) -> BookieInfo:
        body = unpack_map(key, data, bytes_max=VALUE_BYTES_MAX, format_version_max=BOOKIE_FORMAT_VERSION)
        attributes = _field(key, body, "attributes", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in attributes.items()):
            raise MetadataFormatError(key, "bookie attributes must map str -> str")
        try:
            return cls(
                bookie_id=_field(key, body, "bookie_id", str),
                host=_field(key, body, "host", str),
                port=_field(key, body, "port", int),
                state=BookieState(_field(key, body, "state", str)),
                attributes=attributes,
            )
        except (InvalidMetadata, ValueError) as error:
            raise MetadataFormatError(key, f"bad bookie registration: {error!r}") from error


FieldT = TypeVar("FieldT")


def _field(key: str, body: dict[str, Any], name: str, kind: type[FieldT]) -> FieldT:
    value = body.get(name)
    if not isinstance(value, kind):
        raise MetadataFormatError(key, f"field {name!r} missing or not a {kind.__name__}")
    return value


# ---- discovery ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BookieSet:
    """The registered bookies at one store revision.

    ``writable`` / ``readonly``: the registrations we can read. ``undecodable``: the ids of bookies
    registered with a value we cannot decode (garbage, or a newer bookie's format during a rolling
    upgrade): no client can use them, but they are alive (their key is bound to a live lease), so
    whoever judges a bookie lost must count them as present (`registered`)."""

    writable: Mapping[str, BookieInfo]
    readonly: Mapping[str, BookieInfo]
    revision: int
    undecodable: frozenset[str] = frozenset()
    listed: bool = field(default=False, compare=False)
    """Made by a full listing, not a watch event: in `watch_bookies`, every set after the first
    one so made follows a gap (a compacted watch) whose changes went unseen."""

    @property
    def registered(self) -> frozenset[str]:
        """Every bookie id with a registration, decodable or not: the ones not lost."""
        return frozenset(self.writable) | frozenset(self.readonly) | self.undecodable


# An undecodable registration is logged at most this often (per key): a bookie watch re-reads the
# whole set on every change.
UNDECODABLE_LOG_INTERVAL_S = 60.0
_undecodable_logged = LogLimiter(UNDECODABLE_LOG_INTERVAL_S)


def _log_undecodable(key: str, error: MetadataFormatError) -> None:
    if not _undecodable_logged.due(key):
        return
    log.warning(
        "bookies.registration_undecodable",
        key=key,
        error=str(error),
        hint="skipped by clients, still counted as registered; a newer bookie? upgrade this client",
    )


def _bookie_set(
    keys: ClusterKeys, items: list[KeyValue], revision: int, *, listed: bool = False
) -> BookieSet:
    found: dict[BookieState, dict[str, BookieInfo]] = {state: {} for state in BookieState}
    undecodable: set[str] = set()
    for kv in items:
        for state in BookieState:
            prefix = keys.bookies_state_prefix(state.value)
            if kv.key.startswith(prefix):
                bookie_id = kv.key[len(prefix) :]
                try:
                    found[state][bookie_id] = BookieInfo.decode(kv.key, kv.value)
                except MetadataFormatError as error:
                    _log_undecodable(kv.key, error)
                    undecodable.add(bookie_id)
    return BookieSet(
        found[BookieState.WRITABLE],
        found[BookieState.READONLY],
        revision,
        frozenset(undecodable - found[BookieState.WRITABLE].keys() - found[BookieState.READONLY].keys()),
        listed,
    )


async def list_bookies(store: MetadataStore, root: str) -> BookieSet:
    """The registered bookies now. A registration that cannot be decoded is left out of
    ``writable`` / ``readonly`` (logged, rate-limited) and named in ``undecodable``."""
    keys = ClusterKeys(root)
    items, revision = await list_all(store, keys.bookies_prefix)
    return _bookie_set(keys, items, revision, listed=True)


async def watch_bookies(store: MetadataStore, root: str) -> AsyncGenerator[BookieSet, None]:
    """The current `BookieSet`, then a new one after every registration change. On compaction it
    lists again: that set has ``listed`` set, as the first (changes in between went unseen)."""
    keys = ClusterKeys(root)
    while True:
        items, revision = await list_all(store, keys.bookies_prefix)
        current = {kv.key: kv for kv in items}
        yield _bookie_set(keys, list(current.values()), revision, listed=True)
        events = store.watch(keys.bookies_prefix, prefix=True, start_revision=revision + 1)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if event.kind is EventKind.DELETE or event.value is None:
                        current.pop(event.key, None)
                    else:
                        current[event.key] = KeyValue(
                            event.key, event.value, event.revision, 0, event.lease_id
                        )
                    yield _bookie_set(keys, list(current.values()), event.revision)
        except WatchCompacted:
            log.info("bookies.watch_compacted", root=root)


# ---- registration ---------------------------------------------------------------------------------


class BookieRegistration:
    """Keeps ``info`` registered while started. ``start()`` / ``set_state()`` / ``close()`` / ``abort()``.

    ``is_previous_self(found)``: True when a registration found under this bookie id (under another
    lease) was provably left by an earlier incarnation of this same bookie that is no longer alive;
    it is then replaced at once (see the module docstring). None: always wait for it to expire.
    """

    def __init__(
        self,
        store: MetadataStore,
        root: str,
        info: BookieInfo,
        *,
        ttl_s: int = REGISTRATION_TTL_S_DEFAULT,
        stale_wait_s: float | None = None,
        is_previous_self: Callable[[BookieInfo], bool] | None = None,
    ) -> None:
        self._store = store
        self._keys = ClusterKeys(root)
        self._info = info
        self._ttl_s = ttl_s
        self._stale_wait_s = ttl_s * STALE_KEY_WAIT_TTLS if stale_wait_s is None else stale_wait_s
        self._is_previous_self = is_previous_self
        self._lease_id = 0
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.registrations = 0  # how many times the key was (re)created: 1 + re-registrations
        self._stray_key: str | None = None  # left in the other state by a half-done set_state
        self.failure: BaseException | None = None

    @property
    def info(self) -> BookieInfo:
        return self._info

    @property
    def key(self) -> str:
        return self._keys.bookie(self._info.state.value, self._info.bookie_id)

    @property
    def lease_id(self) -> int:
        return self._lease_id

    async def start(self) -> None:
        """Register (waiting ``stale_wait_s``, default 2 TTLs, for an old incarnation's key), keep alive.

        Raises `RegistrationHeld` (a `NodeExists`) if another live registration holds this bookie id.
        """
        assert self._task is None, "already started"
        await self._register(wait_stale_s=self._stale_wait_s)
        self._task = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name=f"bookie-lease-{self.key}"
        )
        self._task.add_done_callback(self._on_task_done)

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        """The keepalive task only ends by ``close``/``abort`` (cancelled); anything else means
        the registration ended for good while its owner may run on: ``failure`` says so (a bookie
        reports not ready and unhealthy on it, docs/bookie.md)."""
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()
            log.error(
                "bookie.registration_failed",
                key=self.key,
                error=repr(self.failure),
                hint="this bookie is no longer registered: restart it",
            )

    async def _register(self, *, wait_stale_s: float) -> None:
        async with self._lock:
            self._stray_key = None  # bound to the lease being replaced: it goes with it
            self._lease_id = await self._store.grant_lease(self._ttl_s)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_stale_s
            waiting_logged = False
            judged: set[int] = set()
            while True:
                try:
                    await self._store.create(self.key, self._info.encode(), lease_id=self._lease_id)
                    break
                except CasResultUnknown:
                    if await self._is_ours():
                        break
                except NodeExists:
                    current = await self._store.get(self.key)
                    if current is None:
                        continue  # expired meanwhile
                    if current.lease_id == self._lease_id:
                        break
                    found = _decode_or_none(current)
                    if current.version not in judged and found is not None:
                        judged.add(current.version)  # once per stale key: never a hot loop
                        if await self._replace_previous_self(current, found):
                            continue
                    if loop.time() >= deadline:
                        with contextlib.suppress(MetadataError):
                            await self._store.revoke_lease(self._lease_id)
                        self._lease_id = 0
                        raise RegistrationHeld(self.key, found) from None
                    if not waiting_logged:
                        waiting_logged = True
                        log.info(
                            "bookie.registration_waiting",
                            key=self.key,
                            held_by_lease=current.lease_id,
                            wait_s=wait_stale_s,
                        )
                    await asyncio.sleep(min(0.5, self._ttl_s / 4))
                    await self._keep_waiting_lease()
            self.registrations += 1  # the key exists now: counted before anything else is awaited
            await self._replace_previous_self_elsewhere()
            log.info(
                "bookie.registered", key=self.key, lease_id=self._lease_id, registrations=self.registrations
            )

    async def _keep_waiting_lease(self) -> None:
        """Our lease, granted before the wait, must outlive a wait longer than its TTL."""
        try:
            await self._store.keepalive(self._lease_id)
        except LeaseExpired:
            self._lease_id = await self._store.grant_lease(self._ttl_s)

    async def _replace_previous_self(self, current: KeyValue, found: BookieInfo) -> bool:
        """Revoke the lease of ``current`` if the judge says a dead earlier incarnation left it."""
        if self._is_previous_self is None or not self._is_previous_self(found):
            return False
        if current.lease_id:  # its keys (writable/ and readonly/) all go with it
            await self._store.revoke_lease(current.lease_id)
        else:
            with contextlib.suppress(NoNode, BadVersion):
                await self._store.delete(current.key, expected_version=current.version)
        log.info(
            "bookie.previous_registration_replaced",
            key=current.key,
            stale_lease_id=current.lease_id,
            stale_address=f"{found.host}:{found.port}",
        )
        return True

    async def _replace_previous_self_elsewhere(self) -> None:
        """A dead incarnation registered in the other set (it was read-only) would linger beside us."""
        if self._is_previous_self is None:
            return
        for state in BookieState:
            if state is self._info.state:
                continue
            current = await self._store.get(self._keys.bookie(state.value, self._info.bookie_id))
            if current is not None and current.lease_id != self._lease_id:
                found = _decode_or_none(current)
                if found is not None:
                    await self._replace_previous_self(current, found)

    async def _is_ours(self) -> bool:
        current = await self._store.get(self.key)
        return current is not None and current.lease_id == self._lease_id and self._lease_id != 0

    async def _keepalive_loop(self) -> None:
        backoff = Backoff(initial_s=0.1, max_s=max(1.0, self._ttl_s / 3))
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self._store.keepalive(self._lease_id)
                if not await self._is_ours():
                    raise LeaseExpired(self._lease_id)  # noqa: TRY301 -- key lost: same remedy
                if self._stray_key is not None:
                    async with self._lock:
                        await self._drop_stray_key()
                backoff.reset()
            except LeaseExpired:
                log.warning("bookie.lease_lost", key=self.key, lease_id=self._lease_id)
                await self._reregister(backoff)
            except MetadataError as error:
                log.warning("bookie.keepalive_failed", key=self.key, error=str(error))
                await asyncio.sleep(backoff.next_delay_s())
            except Exception:
                # Not the store's promise (only MetadataError), so a bug somewhere: the bookie runs
                # on, so its registration must too. Dying here would let the lease expire and the
                # cluster take a live bookie for a dead one (and re-replicate all its data).
                log.exception("bookie.keepalive_unexpected_error", key=self.key)
                await asyncio.sleep(backoff.next_delay_s())

    async def _reregister(self, backoff: Backoff) -> None:
        while True:
            try:
                with contextlib.suppress(MetadataError):
                    await self._store.revoke_lease(self._lease_id)
                await self._register(wait_stale_s=self._stale_wait_s)
                return
            except MetadataError as error:
                log.warning("bookie.reregister_failed", key=self.key, error=str(error))
                await asyncio.sleep(backoff.next_delay_s())
            except Exception:
                log.exception("bookie.reregister_unexpected_error", key=self.key)
                await asyncio.sleep(backoff.next_delay_s())

    async def set_state(self, state: BookieState) -> None:
        """Move the registration between writable/ and readonly/ (same lease).

        Two steps (no multi-key transaction): put the new key, then delete the old one. If the
        store fails in between, the key left in the other state is remembered: a retry of
        ``set_state`` and the keepalive task delete it (only while it is still bound to our lease),
        so the bookie is never listed in both states for good. Raises `MetadataError` (retry).
        """
        if state not in BOOKIE_TRANSITIONS[self._info.state] and state is not self._info.state:
            raise InvalidMetadata(
                f"bookie {self._info.bookie_id}: illegal {self._info.state.name} -> {state.name}"
            )
        async with self._lock:
            if state is self._info.state:
                await self._drop_stray_key()  # a retry after a half-done move finishes it
                return
            old_key = self.key
            new_key = self._keys.bookie(state.value, self._info.bookie_id)
            new_info = BookieInfo(
                self._info.bookie_id, self._info.host, self._info.port, state, self._info.attributes
            )
            try:
                await self._store.put(new_key, new_info.encode(), lease_id=self._lease_id)
            except MetadataError:
                self._stray_key = new_key  # maybe written (answer lost): not to stay beside old_key
                raise
            self._info = new_info
            self._stray_key = old_key
            await self._drop_stray_key()
            log.info("bookie.state_changed", bookie_id=new_info.bookie_id, state=state.value)

    async def _drop_stray_key(self) -> None:
        """Delete the key a half-done `set_state` left in the other state, if still bound to our
        lease (another lease's key is not ours to delete). Caller holds ``_lock``."""
        key = self._stray_key
        if key is None or key == self.key:
            self._stray_key = None
            return
        current = await self._store.get(key)
        if current is not None and current.lease_id == self._lease_id and self._lease_id:
            with contextlib.suppress(NoNode, BadVersion):
                await self._store.delete(key, expected_version=current.version)
        self._stray_key = None

    async def _stop_task(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop keepalive and deregister (revoke the lease: the key disappears at once)."""
        await self._stop_task()
        if self._lease_id:
            with contextlib.suppress(MetadataError, TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._store.revoke_lease(self._lease_id)
            log.info("bookie.deregistered", key=self.key)
            self._lease_id = 0

    async def abort(self) -> None:
        """Stop keepalive without deregistering (the key expires with the lease)."""
        await self._stop_task()


def _decode_or_none(current: KeyValue) -> BookieInfo | None:
    try:
        return BookieInfo.decode(current.key, current.value)
    except MetadataFormatError:
        return None


# ---- cookies --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cookie:
    """A bookie's identity: which cluster instance and data directories it was formatted with."""

    bookie_id: str
    instance_id: str
    journal_dirs: tuple[str, ...]
    ledger_dirs: tuple[str, ...]

    def encode(self) -> bytes:
        body = {
            "format_version": COOKIE_FORMAT_VERSION,
            "bookie_id": self.bookie_id,
            "instance_id": self.instance_id,
            "journal_dirs": list(self.journal_dirs),
            "ledger_dirs": list(self.ledger_dirs),
        }
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, key: str, data: bytes) -> Cookie:
        body = unpack_map(key, data, bytes_max=VALUE_BYTES_MAX, format_version_max=COOKIE_FORMAT_VERSION)
        journal = _field(key, body, "journal_dirs", list)
        ledger = _field(key, body, "ledger_dirs", list)
        if not all(isinstance(d, str) for d in journal + ledger):
            raise MetadataFormatError(key, "cookie dirs must be strings")
        bookie_id = _field(key, body, "bookie_id", str)
        return cls(bookie_id, _field(key, body, "instance_id", str), tuple(journal), tuple(ledger))


async def read_cookie(store: MetadataStore, root: str, bookie_id: str) -> tuple[Cookie, int] | None:
    """The stored cookie and its version, or None."""
    key = ClusterKeys(root).cookie(bookie_id)
    current = await store.get(key)
    return None if current is None else (Cookie.decode(key, current.value), current.version)


async def write_cookie(store: MetadataStore, root: str, cookie: Cookie, expected_version: int | None) -> int:
    """Create (``expected_version=None``) or CAS the cookie. Raises `NodeExists`, `BadVersion`."""
    key = ClusterKeys(root).cookie(cookie.bookie_id)
    if expected_version is None:
        return await store.create(key, cookie.encode())
    return await store.compare_and_set(key, cookie.encode(), expected_version)


async def delete_cookie(store: MetadataStore, root: str, bookie_id: str, expected_version: int) -> None:
    """Remove the cookie (decommissioning). Raises `NoNode`, `BadVersion`."""
    await store.delete(ClusterKeys(root).cookie(bookie_id), expected_version)


async def list_cookie_ids(store: MetadataStore, root: str) -> list[str]:
    """The ids of every bookie with a cookie: each that ever registered here and was not formatted
    since (it may hold data while down, unlike the registered set)."""
    prefix = ClusterKeys(root).cookie("x")[: -len("x")]
    ids: list[str] = []
    start_after: str | None = None
    while True:
        page = await store.list(prefix, start_after=start_after, limit=1000, keys_only=True)
        ids.extend(kv.key[len(prefix) :] for kv in page.items)
        if not page.more or not page.items:
            return ids
        start_after = page.items[-1].key
