"""The async metadata store interface: a versioned key-value store with CAS, leases and watches.

Strategy: the interface is the smallest set of operations BookKeeper needs from ZooKeeper, phrased the
way etcd offers them, so the etcd driver is a thin mapping and the in-memory driver can copy etcd's
semantics exactly:

- A key's *version* is its etcd ``mod_revision``: a cluster-wide, strictly increasing number. Any write
  gives the key a new, larger version; a deleted-and-recreated key never reuses an old version.
- ``create`` succeeds only if the key is absent (etcd ``create_revision == 0``).
- ``compare_and_set`` / ``delete`` with an expected version succeed only if the key's version still
  equals it; otherwise ``BadVersion`` (or ``NoNode`` when the key is gone).
- A ``compare_and_set`` or ``delete`` may carry ``guards``: ``(key, version)`` pairs that must hold
  as well, checked in the same atomic step (an etcd transaction with one compare more per guard).
  A guard key that is gone or at another version refuses the write with `GuardFailed`: the caller
  writes only while it still holds, e.g., a lock key bound to its lease (a lease that expired
  deleted the key; a lock taken again by someone else has a new version).
- Watches are async generators of `WatchEvent`, resuming from the last seen revision across reconnects.
  A watch started without ``start_revision`` begins when it is first iterated; to watch "from this read
  on" without a gap, pass ``start_revision = version + 1`` (single key) or ``page.revision + 1`` (prefix).
- Leases: keys bound to a lease are deleted by the store when the lease expires or is revoked.

Every method may raise `MetadataUnavailable` (store unreachable within its time budget); mutations may
raise `CasResultUnknown` (sent, outcome lost). Keys are ``str`` (UTF-8 on the wire), values ``bytes``.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

from metadata.errors import WatchCompacted

# One page of a listing holds at most this many keys: bounds the memory of one response.
LIST_PAGE_LIMIT_MAX = 10_000
# ... and about this many bytes of keys and values: a page that would hold more stops short of its
# ``limit`` (``more`` stays True; at least one key). Values may be large (ledger metadata with
# custom metadata, 1 MiB log values): 1000 of them must not make a listing impossible.
LIST_REPLY_BYTES_MAX = 64 * 1024 * 1024
# Lease TTLs are whole seconds (etcd's unit); below 2 s a single GC pause expires a lease.
LEASE_TTL_S_MIN = 2
LEASE_TTL_S_MAX = 3600


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One stored key: its value, its version (mod revision) and the lease it is bound to (0: none)."""

    key: str
    value: bytes
    version: int
    create_revision: int
    lease_id: int = 0


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a prefix listing, in key order.

    ``more`` says whether keys after the last one remain; pass ``items[-1].key`` as ``start_after`` and
    ``revision`` as ``revision`` to read the next page from the same snapshot. A page may hold fewer
    keys than asked for while ``more`` (large values: `LIST_REPLY_BYTES_MAX`), never none then.
    """

    items: tuple[KeyValue, ...]
    more: bool
    revision: int


class Guard(NamedTuple):
    """A condition of a guarded write: ``key`` exists at exactly ``version`` (its mod revision)."""

    key: str
    version: int


Guards = Sequence[Guard]
"""What ``compare_and_set`` / ``delete`` take as ``guards`` (empty: none)."""


class EventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change of one key. ``revision`` is the store revision of the change (the new version for a PUT)."""

    kind: EventKind
    key: str
    value: bytes | None
    revision: int
    lease_id: int = 0


class MetadataStore(abc.ABC):
    """A versioned, watchable key-value store. See the module docstring for the rules."""

    @abc.abstractmethod
    async def get(self, key: str) -> KeyValue | None:
        """The key's value and version, or None when absent."""

    @abc.abstractmethod
    async def create(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        """Create the key; return its version. Raises `NodeExists`, `CasResultUnknown`."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        """Write the key unconditionally; return its version. Raises `CasResultUnknown`."""

    @abc.abstractmethod
    async def compare_and_set(
        self, key: str, value: bytes, expected_version: int, *, guards: Guards = ()
    ) -> int:
        """Write only if the key's version equals ``expected_version`` and every guard holds (one
        atomic step); return the new version.

        Raises `GuardFailed` (a guard key gone or at another version: checked first), `BadVersion`,
        `NoNode`, `CasResultUnknown`. The key keeps its lease binding (if any).
        """

    @abc.abstractmethod
    async def delete(self, key: str, expected_version: int | None = None, *, guards: Guards = ()) -> None:
        """Delete the key (only at ``expected_version`` if given, only while every guard holds).
        Raises `GuardFailed`, `NoNode`, `BadVersion`."""

    @abc.abstractmethod
    async def list(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 1000,
        revision: int | None = None,
        keys_only: bool = False,
    ) -> Page:
        """Up to ``limit`` keys starting with ``prefix`` and greater than ``start_after``, in key order
        (fewer when their values would pass `LIST_REPLY_BYTES_MAX`: see `Page`). ``keys_only``: every
        value comes back empty (b""), versions and leases as they are: for callers that need the keys
        alone, whatever the size of the values."""

    @abc.abstractmethod
    async def current_revision(self) -> int:
        """The store's current revision (every write increments it)."""

    @abc.abstractmethod
    def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Changes of ``key`` (or of every key under it when ``prefix``), from ``start_revision`` on.

        Survives reconnects, resuming after the last delivered revision. Raises `WatchCompacted` when the
        history it needs is gone (re-read, then watch again). Close it with ``aclose()``
        (e.g. ``contextlib.aclosing``).
        """

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease that expires ``ttl_s`` seconds from now unless kept alive; returns its id."""

    @abc.abstractmethod
    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease to its full TTL; return the TTL in seconds. Raises `LeaseExpired`."""

    @abc.abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke the lease and delete its keys. Revoking an expired lease is not an error."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Open watches end with `MetadataUnavailable`."""

    async def __aenter__(self) -> MetadataStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def validate_list_limit(limit: int) -> None:
    if not 1 <= limit <= LIST_PAGE_LIMIT_MAX:
        raise ValueError(f"list limit must be in [1, {LIST_PAGE_LIMIT_MAX}], got {limit}")


def validate_ttl(ttl_s: int) -> None:
    if not LEASE_TTL_S_MIN <= ttl_s <= LEASE_TTL_S_MAX:
        raise ValueError(f"lease ttl_s must be in [{LEASE_TTL_S_MIN}, {LEASE_TTL_S_MAX}], got {ttl_s}")


# Listing everything under a prefix must stay bounded: callers with more keys page themselves.
LIST_ALL_KEYS_MAX = 1_000_000


async def list_all(
    store: MetadataStore, prefix: str, *, page_size: int = 1000, keys_max: int = LIST_ALL_KEYS_MAX
) -> tuple[list[KeyValue], int]:
    """Every key under ``prefix`` from one snapshot, and that snapshot's revision (watch from +1)."""
    items: list[KeyValue] = []
    page = await store.list(prefix, limit=page_size)
    revision = page.revision
    while True:
        items.extend(page.items)
        if len(items) > keys_max:
            raise ValueError(f"more than {keys_max} keys under {prefix!r}: page through them instead")
        if not page.more or not page.items:
            return items, revision
        page = await store.list(prefix, start_after=page.items[-1].key, limit=page_size, revision=revision)


class _Versioned(Protocol):
    @property
    def version(self) -> int: ...


V = TypeVar("V", bound=_Versioned)


async def watch_value(
    store: MetadataStore,
    key: str,
    read: Callable[[], Awaitable[V]],
    decode: Callable[[bytes, int], V],
    gone: type[Exception],
) -> AsyncGenerator[V | None, None]:
    """What ``read()`` returns now, then every change of ``key`` decoded by ``decode(value,
    revision)``; ``None`` once the key is deleted (then it ends). Survives reconnects; after a
    compaction it calls ``read()`` again and goes on from the fresh state (``gone``: what ``read``
    raises for a missing key). The ledger and log managers' ``watch``.

    After a compaction the watch resumes from the store revision taken just before that re-read,
    not from the key's own version: a key last written before the compaction would otherwise be
    refused again at once, forever (a hot loop of read + watch). Events the re-read already
    reflects (revision <= its version) are skipped."""
    current = await read()
    yield current
    start = current.version + 1
    while True:
        events = store.watch(key, start_revision=start)
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    if event.revision <= current.version:
                        continue  # already read
                    if event.kind is EventKind.DELETE or event.value is None:
                        yield None
                        return
                    current = decode(event.value, event.revision)
                    yield current
        except WatchCompacted:
            start = await store.current_revision() + 1  # before the read: nothing slips between
            try:
                fresh = await read()
            except gone:
                yield None
                return
            if fresh.version != current.version:
                current = fresh
                yield current
