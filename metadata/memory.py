"""In-memory `MetadataStore` with etcd's semantics, for unit tests and the simulator.

Everything lives in one process: a dict of keys, one revision counter, a bounded event history for
watches, and leases that expire on the event loop's clock. Each operation yields to the loop once so
concurrent tasks interleave the way they do against a real store (CAS races are visible).

Fault injection for tests: `set_unavailable()` makes every call fail with `MetadataUnavailable`;
`lose_next_write_result(applied=...)` makes the next mutation raise `CasResultUnknown` after applying
it (or not). `compact()` drops watch history like etcd's compaction. A listing page stops short at
``list_reply_bytes_max`` bytes of keys and values, as the etcd driver's does at its receive limit
(small in a test: the short pages large values cause).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from metadata.errors import (
    BadVersion,
    CasResultUnknown,
    GuardFailed,
    LeaseExpired,
    MetadataError,
    MetadataUnavailable,
    NodeExists,
    NoNode,
    WatchCompacted,
)
from metadata.store import (
    LIST_REPLY_BYTES_MAX,
    EventKind,
    Guards,
    KeyValue,
    MetadataStore,
    Page,
    WatchEvent,
    validate_list_limit,
    validate_ttl,
)

# Watch history kept for resuming watches; older revisions count as compacted. Bounds memory.
HISTORY_EVENTS_MAX = 100_000
_PUT = EventKind.PUT  # a module name: an enum member is a slow lookup on Python 3.11


@dataclass(slots=True)
class _Lease:
    ttl_s: int
    deadline: float
    keys: set[str] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


class _Pager:
    """The items of one listing page: up to ``limit`` keys and about ``bytes_max`` bytes of keys
    and values (at least one key), values left out when ``keys_only``."""

    def __init__(self, limit: int, bytes_max: int, keys_only: bool) -> None:
        self.items: list[KeyValue] = []
        self._limit = limit
        self._bytes_left = bytes_max
        self._keys_only = keys_only

    def add(self, kv: KeyValue) -> bool:
        """Take ``kv``; False (not taken) when the page is full."""
        if self._keys_only:
            kv = KeyValue(kv.key, b"", kv.version, kv.create_revision, kv.lease_id)
        size = len(kv.key) + len(kv.value)
        if len(self.items) == self._limit or (self.items and size > self._bytes_left):
            return False
        self.items.append(kv)
        self._bytes_left -= size
        return True


class MemoryStore(MetadataStore):
    """A single-process store. Not shared across processes; use etcd for multi-process tests."""

    def __init__(self, *, list_reply_bytes_max: int = LIST_REPLY_BYTES_MAX) -> None:
        self._list_reply_bytes_max = list_reply_bytes_max
        self._data: dict[str, KeyValue] = {}
        self._sorted_keys: list[str] = []
        self._revision = 1
        self._history: list[WatchEvent] = []
        # What each change replaced (revision, key, the previous value or None), as long as the
        # history: a listing at an older revision undoes the changes made since (etcd's MVCC read).
        self._undo: list[tuple[int, str, KeyValue | None]] = []
        self._compacted_revision = 0
        self._leases: dict[int, _Lease] = {}
        self._expiry = math.inf
        """No lease expires before this time (at most the earliest deadline: a lease dropped or
        kept alive since may leave it lower, which only costs a look at the leases)."""
        self._lease_ids = itertools.count(0x1000)
        self._changed: asyncio.Event | None = None
        self._closed = False
        self._unavailable = False
        self._lose_next: bool | None = None

    # ---- fault injection -------------------------------------------------------------------------

    def set_unavailable(self, unavailable: bool = True) -> None:
        """Make every call raise `MetadataUnavailable` (True) or work again (False)."""
        self._unavailable = unavailable
        self._notify()

    def lose_next_write_result(self, *, applied: bool) -> None:
        """The next mutation raises `CasResultUnknown`; ``applied`` says whether it took effect."""
        self._lose_next = applied

    def compact(self, revision: int | None = None) -> None:
        """Forget watch history below ``revision`` (default: all of it), like etcd compaction."""
        upto = self._revision if revision is None else min(revision, self._revision)
        self._compacted_revision = max(self._compacted_revision, upto - 1)
        cut = bisect.bisect_left(self._history, upto, key=lambda e: e.revision)
        del self._history[:cut]
        self._trim_undo()

    def _trim_undo(self) -> None:
        cut = bisect.bisect_right(self._undo, self._compacted_revision, key=lambda u: u[0])
        del self._undo[:cut]

    def expire_lease_now(self, lease_id: int) -> None:
        """Expire a lease immediately (as if its holder had been paused past the TTL)."""
        if lease_id in self._leases:
            self._drop_lease(lease_id)

    # ---- internals -------------------------------------------------------------------------------

    async def _enter(self) -> None:
        await asyncio.sleep(0)
        if self._closed:
            raise MetadataUnavailable("memory store is closed")
        if self._unavailable:
            raise MetadataUnavailable("memory store set unavailable (fault injection)")
        self._expire_leases()

    def _apply_ok(self) -> bool:
        """Whether to apply the current mutation (False only for an injected "lost and not applied")."""
        return self._lose_next is not False

    def _raise_if_lost(self, key: str) -> None:
        if self._lose_next is not None:
            self._lose_next = None
            raise CasResultUnknown(key, "injected: response lost")

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _record(self, event: WatchEvent) -> None:
        self._history.append(event)
        if len(self._history) > HISTORY_EVENTS_MAX:
            drop = len(self._history) - HISTORY_EVENTS_MAX
            self._compacted_revision = self._history[drop - 1].revision
            del self._history[:drop]
            self._trim_undo()
        self._notify()

    def _write(self, key: str, value: bytes, lease_id: int, create_revision: int | None) -> int:
        if lease_id and lease_id not in self._leases:
            raise LeaseExpired(lease_id)
        self._revision += 1
        old = self._data.get(key)
        self._undo.append((self._revision, key, old))
        if old is None:
            bisect.insort(self._sorted_keys, key)
        elif old.lease_id and old.lease_id in self._leases:
            self._leases[old.lease_id].keys.discard(key)
        created = self._revision if old is None else old.create_revision
        self._data[key] = KeyValue(key, value, self._revision, created, lease_id)
        if lease_id:
            self._leases[lease_id].keys.add(key)
        self._record(WatchEvent(_PUT, key, value, self._revision, lease_id))
        return self._revision

    def _remove(self, key: str, revision: int | None = None) -> None:
        """Delete ``key`` at a revision of its own, or at ``revision`` (already counted: one
        revision for several keys, as a lease's)."""
        old = self._data.pop(key)
        del self._sorted_keys[bisect.bisect_left(self._sorted_keys, key)]
        if old.lease_id and old.lease_id in self._leases:
            self._leases[old.lease_id].keys.discard(key)
        if revision is None:
            self._revision += 1
            revision = self._revision
        self._undo.append((revision, key, old))
        self._record(WatchEvent(EventKind.DELETE, key, None, revision))

    def _expire_leases(self) -> None:
        now = asyncio.get_running_loop().time()
        if now < self._expiry:  # every operation asks: most find no lease due
            return
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
            self._drop_lease(lease_id)
        self._expiry = min((lease.deadline for lease in self._leases.values()), default=math.inf)

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        if lease.timer is not None:
            lease.timer.cancel()
        keys = [key for key in sorted(lease.keys) if key in self._data]
        if keys:  # like etcd: every key of the lease goes in one revision
            self._revision += 1
            for key in keys:
                self._remove(key, self._revision)

    def _arm(self, lease_id: int, lease: _Lease) -> None:
        loop = asyncio.get_running_loop()
        if lease.timer is not None:
            lease.timer.cancel()
        lease.deadline = loop.time() + lease.ttl_s
        self._expiry = min(self._expiry, lease.deadline)
        lease.timer = loop.call_at(lease.deadline, self._expire_leases)

    # ---- MetadataStore ---------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        await self._enter()
        return self._data.get(key)

    async def create(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        await self._enter()
        if key in self._data:
            raise NodeExists(key)
        version = self._write(key, value, lease_id, None) if self._apply_ok() else 0
        self._raise_if_lost(key)
        return version

    async def put(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        await self._enter()
        version = self._write(key, value, lease_id, None) if self._apply_ok() else 0
        self._raise_if_lost(key)
        return version

    def _check_guards(self, key: str, guards: Guards) -> None:
        """Raise `GuardFailed` for the first guard key gone or at another version (etcd's txn
        compares them all at once; which one is named when several fail does not matter)."""
        for guard in guards:
            found = self._data.get(guard.key)
            # An absent key's version is 0 (etcd's mod_revision of a missing key): Guard(k, 0)
            # holds while k does not exist.
            if (0 if found is None else found.version) != guard.version:
                raise GuardFailed(key, guard.key, guard.version, None if found is None else found.version)

    async def compare_and_set(
        self, key: str, value: bytes, expected_version: int, *, guards: Guards = ()
    ) -> int:
        await self._enter()
        self._check_guards(key, guards)
        current = self._data.get(key)
        if current is None:
            raise NoNode(key)
        if current.version != expected_version:
            raise BadVersion(key, expected_version, current.version)
        version = self._write(key, value, current.lease_id, None) if self._apply_ok() else 0
        self._raise_if_lost(key)
        return version

    async def delete(self, key: str, expected_version: int | None = None, *, guards: Guards = ()) -> None:
        await self._enter()
        self._check_guards(key, guards)
        current = self._data.get(key)
        if current is None:
            raise NoNode(key)
        if expected_version is not None and current.version != expected_version:
            raise BadVersion(key, expected_version, current.version)
        if self._apply_ok():
            self._remove(key)
        self._raise_if_lost(key)

    async def list(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 1000,
        revision: int | None = None,
        keys_only: bool = False,
    ) -> Page:
        validate_list_limit(limit)
        await self._enter()
        pager = _Pager(limit, self._list_reply_bytes_max, keys_only)
        if revision and revision != self._revision:
            return self._list_at(prefix, start_after, pager, revision)
        return self._list_now(prefix, start_after, pager)

    def _list_now(self, prefix: str, start_after: str | None, pager: _Pager) -> Page:
        # Like etcd: a ``start_after`` below the prefix lists from the prefix itself, a key equal to
        # the prefix included.
        inclusive = start_after is None or start_after < prefix
        start = prefix if inclusive or start_after is None else start_after
        index = bisect.bisect_left(self._sorted_keys, start)
        if not inclusive and index < len(self._sorted_keys) and self._sorted_keys[index] == start:
            index += 1
        while index < len(self._sorted_keys) and self._sorted_keys[index].startswith(prefix):
            if not pager.add(self._data[self._sorted_keys[index]]):
                return Page(tuple(pager.items), True, self._revision)
            index += 1
        return Page(tuple(pager.items), False, self._revision)

    def _list_at(self, prefix: str, start_after: str | None, pager: _Pager, revision: int) -> Page:
        """A listing as of an older ``revision`` (etcd's read at a revision): the keys now, with
        every change made since undone (costs the page plus the changes since, not the prefix).
        Refused like etcd for a compacted or a future revision."""
        if revision > self._revision:
            raise MetadataError(f"memory store: required revision {revision} is a future revision")
        if revision <= self._compacted_revision:
            raise WatchCompacted(prefix, self._compacted_revision)
        inclusive = start_after is None or start_after < prefix  # as in `list`
        after = prefix if inclusive or start_after is None else start_after
        changed: dict[str, KeyValue | None] = {}
        cut = bisect.bisect_right(self._undo, revision, key=lambda u: u[0])
        for _, key, old in reversed(self._undo[cut:]):  # newest first: the oldest change wins
            if key.startswith(prefix) and (key > after or (inclusive and key == after)):
                changed[key] = old
        undone = sorted(changed)
        index = bisect.bisect_left(self._sorted_keys, after)
        if not inclusive and index < len(self._sorted_keys) and self._sorted_keys[index] == after:
            index += 1
        u = 0
        while True:
            now_key = self._sorted_keys[index] if index < len(self._sorted_keys) else None
            if now_key is not None and not now_key.startswith(prefix):
                now_key = None
            old_key = undone[u] if u < len(undone) else None
            if now_key is None and old_key is None:
                return Page(tuple(pager.items), False, self._revision)
            if old_key is not None and (now_key is None or old_key <= now_key):
                key, value = old_key, changed[old_key]
                u += 1
                if key == now_key:
                    index += 1
            else:
                assert now_key is not None
                key, value = now_key, self._data[now_key]
                index += 1
            if value is None:
                continue  # absent at that revision
            if not pager.add(value):
                return Page(tuple(pager.items), True, self._revision)

    async def current_revision(self) -> int:
        await self._enter()
        return self._revision

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        await self._enter()
        next_revision = self._revision + 1 if start_revision is None else start_revision
        while True:
            if next_revision <= self._compacted_revision:
                raise WatchCompacted(key, self._compacted_revision)
            index = bisect.bisect_left(self._history, next_revision, key=lambda e: e.revision)
            pending = self._history[index:]
            for event in pending:
                next_revision = event.revision + 1
                if event.key == key or (prefix and event.key.startswith(key)):
                    yield event
            if not pending:
                if self._changed is None:
                    self._changed = asyncio.Event()
                await self._changed.wait()
                if self._closed:
                    raise MetadataUnavailable("memory store is closed")
                if not self._unavailable:
                    self._expire_leases()

    async def grant_lease(self, ttl_s: int) -> int:
        validate_ttl(ttl_s)
        await self._enter()
        lease_id = next(self._lease_ids)
        lease = _Lease(ttl_s=ttl_s, deadline=0.0)
        self._leases[lease_id] = lease
        self._arm(lease_id, lease)
        return lease_id

    async def keepalive(self, lease_id: int) -> int:
        await self._enter()
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseExpired(lease_id)
        self._arm(lease_id, lease)
        return lease.ttl_s

    async def revoke_lease(self, lease_id: int) -> None:
        await self._enter()
        if lease_id in self._leases:
            self._drop_lease(lease_id)

    async def close(self) -> None:
        self._closed = True
        for lease in self._leases.values():
            if lease.timer is not None:
                lease.timer.cancel()
        self._notify()
