"""Under-replication marks, replication locks and the autorecovery switch (used by autorecovery).

Keys (docs/metadata.md, *Autorecovery*):

- ``R/underreplicated/<id>``: one per ledger that needs re-replication; a msgpack map
  ``{format_version, missing, marked_ms, reasons, since, bookie_reasons}``: the bookies whose
  copies must be replaced (sorted, each once), when the ledger was first marked (wall clock, ms),
  why (``lost``, ``replaced``, ``check``, ``decommission``, ``operator``, ``limbo``; each once),
  when each bookie was first marked (``since``: bookie -> ms; the open-ledger grace period counts
  from it; a worker that finds a marked bookie of an open ledger's writer back sets it anew,
  ``restamp``), and why each bookie was marked (``bookie_reasons``: bookie -> reasons; a mark written
  before it existed lacks it, and then every bookie's reasons are the mark's). Marking an already
  marked ledger adds its bookies and reasons to the same key by CAS (never loses a bookie another
  marker added).
- ``R/replication/locks/<id>``: the worker healing the ledger (its id, UTF-8), bound to the
  worker's lease: a worker that dies leaves the lock to expire with its lease, and the ledger to
  the next worker. Taken with create-if-absent, released only by the lease that holds it. A held
  lock is never rewritten, so its version identifies this holding: ``guard(lock)`` makes a write
  conditional on it (the worker's metadata CAS and its mark updates), and a worker paused past its
  lease (the key deleted, maybe taken again by another worker at a new version) writes nothing.
- ``R/replication/disabled``: present = workers take no new ledger (``bkaio autorecovery disable``);
  the auditor keeps marking.
- ``R/replication/daemons/<id>``: each daemon's status and metrics (msgpack map), bound to its lease.
- ``R/replication/decommissioning/<bookie id>``: a bookie being decommissioned: never chosen as a
  replacement; removed once no ledger references it, or when the decommission is cancelled
  (``bkaio decommission --cancel``: the bookie's marks for it alone go too, ``unmark``).
- ``R/replication/instances/<bookie id>``: the data dir instance (UTF-8) the auditor last saw the
  bookie registered with, written by CAS: a bookie registered with another one lost what it held
  (``replaced``), and any auditor, a new leader too, tells so from this key. Deleted with the
  bookie's cookie when it is decommissioned (``forget_instance``, at the version read, only while
  it still names the cookie's instance); kept when a bookie is merely lost or formatted, since a
  replacement must still be told.

A mark is resolved (``resolve``) by removing the bookies a worker replaced, by CAS: bookies marked
meanwhile stay, and the key goes only when nothing is left. A key under ``R/underreplicated/`` that
is not a ledger id (hand-written, another tool's) is no mark: listings skip it and log it (it must
not stop every heal). Every method may raise
`MetadataUnavailable`; a lost answer (`CasResultUnknown`) is resolved by reading the key back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import structlog

from bookkeeper_aio.common.backoff import Backoff
from bookkeeper_aio.common.log_limit import LogLimiter
from metadata.envelope import unpack_map
from metadata.errors import (
    BadVersion,
    CasResultUnknown,
    InvalidMetadata,
    MetadataFormatError,
    NodeExists,
    NoNode,
    UpdateRetriesExhausted,
)
from metadata.keys import ClusterKeys, validate_name
from metadata.store import Guard, MetadataStore, list_all

log = structlog.get_logger("metadata.underreplication")

UNDERREPLICATED_FORMAT_VERSION = 1
VALUE_BYTES_MAX = 64 * 1024
MISSING_BOOKIES_MAX = 64  # an ensemble has at most 64 bookies: a ledger cannot miss more
REASONS = frozenset({"lost", "replaced", "check", "decommission", "operator", "limbo"})
Undecodable = Callable[[int, MetadataFormatError], None]
"""``on_undecodable(ledger_id, error)``: a mark :meth:`UnderReplicationManager.iter_marks` skipped."""
UPDATE_ATTEMPTS_MAX = 100
# The pause after a lost CAS race: from 1 ms, doubling to 50 ms (jittered), so that contenders do not
# retry in lockstep.
CONFLICT_PAUSE_S_INITIAL = 0.001
CONFLICT_PAUSE_S_MAX = 0.05


def _conflict_backoff() -> Backoff:
    return Backoff(initial_s=CONFLICT_PAUSE_S_INITIAL, max_s=CONFLICT_PAUSE_S_MAX)


PAGE_SIZE_DEFAULT = 1000


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# A foreign key under the marks' prefix is logged at most this often (per key): every worker pass
# and every bookie GC pass lists the marks.
FOREIGN_LOG_INTERVAL_S = 300.0
_foreign_logged = LogLimiter(FOREIGN_LOG_INTERVAL_S)


def _log_foreign(key: str) -> None:
    if not _foreign_logged.due(key):
        return
    log.warning(
        "underreplication.foreign_key",
        key=key,
        hint="not a ledger's mark (its name is no ledger id): skipped; delete it if none of yours wrote it",
    )


@dataclass(frozen=True, slots=True)
class UnderReplicated:
    """One ledger's mark: ``missing`` bookies (sorted), first ``marked_ms``, ``reasons`` (sorted),
    the key's ``version`` (for a CAS), ``since``: ``(bookie, ms)`` when each was first marked, and
    ``bookie_reasons``: ``(bookie, reasons)`` why each was marked (sorted)."""

    ledger_id: int
    missing: tuple[str, ...]
    marked_ms: int
    reasons: tuple[str, ...]
    version: int = 0
    since: tuple[tuple[str, int], ...] = ()
    bookie_reasons: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def since_ms(self, bookie_id: str) -> int:
        """When ``bookie_id`` was first marked for this ledger (the mark's time if not recorded)."""
        return dict(self.since).get(bookie_id, self.marked_ms)

    def reasons_of(self, bookie_id: str) -> tuple[str, ...]:
        """Why ``bookie_id`` was marked (the mark's reasons if not recorded: an older daemon's)."""
        return dict(self.bookie_reasons).get(bookie_id, self.reasons)

    def encode(self) -> bytes:
        body = {
            "format_version": UNDERREPLICATED_FORMAT_VERSION,
            "missing": list(self.missing),
            "marked_ms": self.marked_ms,
            "reasons": list(self.reasons),
            "since": dict(self.since),
            "bookie_reasons": {b: list(r) for b, r in self.bookie_reasons},
        }
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def decode(cls, key: str, ledger_id: int, data: bytes, version: int) -> UnderReplicated:
        body = unpack_map(
            key, data, bytes_max=VALUE_BYTES_MAX, format_version_max=UNDERREPLICATED_FORMAT_VERSION
        )
        missing, reasons, marked_ms = body.get("missing"), body.get("reasons"), body.get("marked_ms")
        if not isinstance(missing, list) or not all(isinstance(b, str) for b in missing):
            raise MetadataFormatError(key, "field 'missing' must be a list of bookie ids")
        if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
            raise MetadataFormatError(key, "field 'reasons' must be a list of strings")
        if not isinstance(marked_ms, int) or isinstance(marked_ms, bool):
            raise MetadataFormatError(key, "field 'marked_ms' must be an int")
        since = body.get("since", {})
        if not isinstance(since, dict) or not all(
            isinstance(b, str) and isinstance(ms, int) and not isinstance(ms, bool) for b, ms in since.items()
        ):
            raise MetadataFormatError(key, "field 'since' must map bookie ids to ints")
        by_bookie = body.get("bookie_reasons", {})
        if not isinstance(by_bookie, dict) or not all(
            isinstance(b, str) and isinstance(r, list) and all(isinstance(x, str) for x in r)
            for b, r in by_bookie.items()
        ):
            raise MetadataFormatError(key, "field 'bookie_reasons' must map bookie ids to lists of strings")
        return cls(
            ledger_id,
            tuple(missing),
            marked_ms,
            tuple(reasons),
            version,
            tuple(sorted(since.items())),
            tuple(sorted((b, tuple(r)) for b, r in by_bookie.items())),
        )


@dataclass(frozen=True, slots=True)
class SeenInstance:
    """The data dir ``instance`` a bookie was last seen registered with, and its key's ``version``."""

    instance: str
    version: int


@dataclass(frozen=True, slots=True)
class ReplicationLock:
    """A held lock: the ledger, the ``owner`` (worker id), the lease it is bound to."""

    ledger_id: int
    owner: str
    lease_id: int
    version: int


def _check_missing(ledger_id: int, missing: Collection[str]) -> tuple[str, ...]:
    bookies = tuple(sorted({validate_name(b, "bookie id") for b in missing}))
    if not bookies:
        raise InvalidMetadata(f"ledger {ledger_id}: a mark needs at least one missing bookie")
    if len(bookies) > MISSING_BOOKIES_MAX:
        raise InvalidMetadata(f"ledger {ledger_id}: more than {MISSING_BOOKIES_MAX} missing bookies")
    return bookies


def _without(current: UnderReplicated, gone: Collection[str]) -> UnderReplicated | None:
    """``current`` without the bookies ``gone`` (itself when it lists none; None when none is left)."""
    left = tuple(b for b in current.missing if b not in gone)
    if not left:
        return None
    if left == current.missing:
        return current
    since = tuple((b, ms) for b, ms in current.since if b in left)
    by_bookie = tuple((b, r) for b, r in current.bookie_reasons if b in left)
    return dataclasses.replace(current, missing=left, since=since, bookie_reasons=by_bookie)


class UnderReplicationManager:
    """Marks, locks, the switch and daemon statuses under one cluster root (see the module doc)."""

    def __init__(self, store: MetadataStore, root: str, *, now_ms: Any = _now_ms) -> None:
        self._store = store
        self.keys = ClusterKeys(root)
        self._now_ms = now_ms

    @property
    def store(self) -> MetadataStore:
        return self._store

    # ---- marks ------------------------------------------------------------------------------------

    async def get(self, ledger_id: int) -> UnderReplicated | None:
        """The ledger's mark, or None."""
        key = self.keys.underreplicated(ledger_id)
        current = await self._store.get(key)
        if current is None:
            return None
        return UnderReplicated.decode(key, ledger_id, current.value, current.version)

    async def mark(self, ledger_id: int, missing: Collection[str], *, reason: str) -> UnderReplicated:
        """Mark the ledger under-replicated for ``missing`` (added to an existing mark). Returns the
        stored mark. Raises `InvalidMetadata` (no bookie, a bad id, an unknown reason)."""
        bookies = _check_missing(ledger_id, missing)
        if reason not in REASONS:
            raise InvalidMetadata(f"unknown reason {reason!r}: one of {sorted(REASONS)}")
        key = self.keys.underreplicated(ledger_id)
        backoff = _conflict_backoff()
        for _ in range(UPDATE_ATTEMPTS_MAX):
            current = await self.get(ledger_id)
            try:
                now = self._now_ms()
                if current is None:
                    fresh = UnderReplicated(
                        ledger_id,
                        bookies,
                        now,
                        (reason,),
                        since=tuple((b, now) for b in bookies),
                        bookie_reasons=tuple((b, (reason,)) for b in bookies),
                    )
                    version = await self._store.create(key, fresh.encode())
                else:
                    merged_missing = tuple(sorted(set(current.missing) | set(bookies)))
                    merged_reasons = tuple(sorted(set(current.reasons) | {reason}))
                    why = {b: set(current.reasons_of(b)) for b in current.missing}
                    for b in bookies:
                        why.setdefault(b, set()).add(reason)
                    by_bookie = tuple((b, tuple(sorted(why[b]))) for b in merged_missing)
                    if (merged_missing, merged_reasons, by_bookie) == (
                        current.missing,
                        current.reasons,
                        current.bookie_reasons,
                    ):
                        return current
                    since = {b: current.since_ms(b) if b in current.missing else now for b in merged_missing}
                    fresh = UnderReplicated(
                        ledger_id,
                        merged_missing,
                        current.marked_ms,
                        merged_reasons,
                        since=tuple(sorted(since.items())),
                        bookie_reasons=by_bookie,
                    )
                    version = await self._store.compare_and_set(key, fresh.encode(), current.version)
            except (NodeExists, BadVersion, NoNode):
                # someone else marked or resolved meanwhile: merge with what is there now
                await asyncio.sleep(backoff.next_delay_s())
                continue
            except CasResultUnknown:
                # re-read: if ours landed, the next round finds nothing to add
                await asyncio.sleep(backoff.next_delay_s())
                continue
            return dataclasses.replace(fresh, version=version)
        raise UpdateRetriesExhausted(key, UPDATE_ATTEMPTS_MAX)

    async def resolve(
        self, ledger_id: int, healed: Collection[str], *, lock: ReplicationLock | None = None
    ) -> UnderReplicated | None:
        """Remove ``healed`` bookies from the ledger's mark; delete it when none is left. Returns
        what is left (None: the ledger is no longer marked). With ``lock`` (the caller's), only
        while it is still held: else `GuardFailed` and the mark stays."""
        gone = set(healed)
        return await self._change_mark(ledger_id, lambda current: _without(current, gone), lock)

    async def unmark(self, ledger_id: int, bookie_id: str, reason: str) -> UnderReplicated | None:
        """Take ``bookie_id`` off the ledger's mark when ``reason`` is all it was marked for (a
        decommission cancelled: a bookie also marked for another reason stays, and so do the
        other bookies); the key goes when no bookie is left. Returns what is left (None: the
        ledger is no longer marked)."""

        def unmarked(current: UnderReplicated) -> UnderReplicated | None:
            if bookie_id not in current.missing or current.reasons_of(bookie_id) != (reason,):
                return current
            return _without(current, {bookie_id})

        return await self._change_mark(ledger_id, unmarked, None)

    async def restamp(
        self, ledger_id: int, bookies: Collection[str], *, lock: ReplicationLock | None = None
    ) -> UnderReplicated | None:
        """Set the ``since`` of ``bookies`` (those still marked) to now: a worker found them back,
        and a new absence must wait a new grace. Returns the stored mark (None: not marked). With
        ``lock``, only while it is still held: else `GuardFailed` and the mark stays."""

        def restamped(current: UnderReplicated) -> UnderReplicated:
            now = self._now_ms()
            since = {b: current.since_ms(b) for b in current.missing}
            since.update({b: now for b in bookies if b in since})
            fresh = dataclasses.replace(current, since=tuple(sorted(since.items())))
            return current if fresh.since == current.since else fresh

        return await self._change_mark(ledger_id, restamped, lock)

    async def _change_mark(
        self,
        ledger_id: int,
        change: Callable[[UnderReplicated], UnderReplicated | None],
        lock: ReplicationLock | None,
    ) -> UnderReplicated | None:
        """Read the ledger's mark, ``change`` it and write it back by CAS (guarded by ``lock``),
        again on a conflict or a lost answer. ``change`` returns the new mark, the one it was given
        (nothing to write), or None (delete the mark). Returns the stored mark (None: not marked)."""
        key = self.keys.underreplicated(ledger_id)
        guards = () if lock is None else (self.guard(lock),)
        backoff = _conflict_backoff()
        for _ in range(UPDATE_ATTEMPTS_MAX):
            current = await self.get(ledger_id)
            if current is None:
                return None
            fresh = change(current)
            try:
                if fresh is None:
                    await self._store.delete(key, current.version, guards=guards)
                    return None
                if fresh is current:
                    return current
                version = await self._store.compare_and_set(
                    key, fresh.encode(), current.version, guards=guards
                )
                return dataclasses.replace(fresh, version=version)
            except (BadVersion, NoNode, CasResultUnknown):
                await asyncio.sleep(backoff.next_delay_s())
                continue
        raise UpdateRetriesExhausted(key, UPDATE_ATTEMPTS_MAX)

    async def list_page(
        self, *, start_after: int | None = None, limit: int = PAGE_SIZE_DEFAULT
    ) -> tuple[list[UnderReplicated], bool]:
        """Up to ``limit`` marks of ledgers after ``start_after``, in ledger id order, and whether
        more follow. Raises MetadataFormatError for a mark that cannot be decoded."""
        after = None if start_after is None else self.keys.underreplicated(start_after)
        marks, more, _ = await self._page(after, limit, None)
        return marks, more

    async def _page(
        self, after: str | None, limit: int, on_undecodable: Undecodable | None
    ) -> tuple[list[UnderReplicated], bool, str | None]:
        """A page of marks after the key ``after``, whether more follow, and the last key listed
        (a mark's, decoded or not, or a foreign key's: skipped and logged)."""
        page = await self._store.list(self.keys.underreplicated_prefix, start_after=after, limit=limit)
        marks: list[UnderReplicated] = []
        last: str | None = None
        for kv in page.items:
            last = kv.key
            try:
                ledger_id = self.keys.underreplicated_id_of(kv.key)
            except InvalidMetadata:
                _log_foreign(kv.key)
                continue
            try:
                marks.append(UnderReplicated.decode(kv.key, ledger_id, kv.value, kv.version))
            except MetadataFormatError as error:
                if on_undecodable is None:
                    raise
                on_undecodable(ledger_id, error)
        return marks, page.more, last

    async def iter_marks(
        self, *, page_size: int = PAGE_SIZE_DEFAULT, on_undecodable: Undecodable | None = None
    ) -> AsyncIterator[UnderReplicated]:
        """Every mark, page by page (not a snapshot). A mark that cannot be decoded (a newer
        daemon's format, a damaged value) raises MetadataFormatError, or with ``on_undecodable``
        is passed to it (ledger id, error) and skipped: one bad mark must not stop every heal, nor
        may a caller that needs every marked ledger (the bookie's GC) take it for no mark. A key
        that is no ledger's mark is skipped (and logged)."""
        after: str | None = None
        while True:
            marks, more, last = await self._page(after, page_size, on_undecodable)
            for mark in marks:
                yield mark
            if not more or last is None:
                return
            after = last

    async def count(self) -> int:
        """How many ledgers are marked now (those whose mark cannot be decoded included)."""
        undecodable: list[int] = []
        total = 0
        async for _ in self.iter_marks(on_undecodable=lambda ledger_id, _: undecodable.append(ledger_id)):
            total += 1
        return total + len(undecodable)

    # ---- locks ------------------------------------------------------------------------------------

    async def acquire(self, ledger_id: int, owner: str, lease_id: int) -> ReplicationLock | None:
        """Take the ledger's replication lock for ``owner``, bound to ``lease_id``: the lock held,
        or None when another worker holds it. Raises `LeaseExpired` if the lease is gone.

        A lock ``owner`` already holds under ``lease_id`` is taken up again (same version): its
        release failed (metadata down at that moment), and the lease that holds it is kept alive,
        so nobody else could ever take it; a worker heals one ledger at a time, so no heal of its
        own still uses it (autorecovery seed 92 of the simulation: a mark healed by nobody)."""
        if lease_id <= 0:
            raise InvalidMetadata("a replication lock must be bound to a lease")
        key = self.keys.replication_lock(ledger_id)
        value = validate_name(owner, "worker id").encode()
        try:
            version = await self._store.create(key, value, lease_id=lease_id)
        except (NodeExists, CasResultUnknown):
            current = await self._store.get(key)
            if current is None or current.lease_id != lease_id or current.value != value:
                return None
            version = current.version
        return ReplicationLock(ledger_id, owner, lease_id, version)

    async def try_lock(self, ledger_id: int, owner: str, lease_id: int) -> bool:
        """:meth:`acquire`, saying only whether the lock was taken."""
        return await self.acquire(ledger_id, owner, lease_id) is not None

    def guard(self, lock: ReplicationLock) -> Guard:
        """The condition "``lock`` is still held" for a guarded write (`metadata.store.Guard`): its
        key at the version it was taken at. Its lease expired: the key is gone; taken again since:
        another version."""
        return Guard(self.keys.replication_lock(lock.ledger_id), lock.version)

    async def holds(self, lock: ReplicationLock) -> bool:
        """Whether ``lock`` is still held (a check only: a write that needs it is guarded)."""
        current = await self._store.get(self.keys.replication_lock(lock.ledger_id))
        return current is not None and current.version == lock.version

    async def unlock(self, ledger_id: int, lease_id: int) -> None:
        """Release the lock if ``lease_id`` holds it (never another worker's)."""
        key = self.keys.replication_lock(ledger_id)
        backoff = _conflict_backoff()
        for _ in range(UPDATE_ATTEMPTS_MAX):
            current = await self._store.get(key)
            if current is None or current.lease_id != lease_id:
                return
            try:
                await self._store.delete(key, current.version)
                return
            except (BadVersion, NoNode, CasResultUnknown):
                await asyncio.sleep(backoff.next_delay_s())
                continue
        raise UpdateRetriesExhausted(key, UPDATE_ATTEMPTS_MAX)

    async def lock_holder(self, ledger_id: int) -> ReplicationLock | None:
        current = await self._store.get(self.keys.replication_lock(ledger_id))
        if current is None:
            return None
        return ReplicationLock(
            ledger_id, current.value.decode(errors="replace"), current.lease_id, current.version
        )

    async def locks(self) -> list[ReplicationLock]:
        """Every held lock, in ledger id order."""
        items, _ = await list_all(self._store, self.keys.replication_locks_prefix)
        prefix = self.keys.replication_locks_prefix
        return [
            ReplicationLock(
                int(kv.key[len(prefix) :]), kv.value.decode(errors="replace"), kv.lease_id, kv.version
            )
            for kv in items
            if kv.key[len(prefix) :].isdigit()
        ]

    # ---- switch -----------------------------------------------------------------------------------

    async def is_enabled(self) -> bool:
        return await self._store.get(self.keys.replication_disabled) is None

    async def set_enabled(self, enabled: bool) -> None:
        """Enable (delete the switch) or disable (put it) re-replication; idempotent."""
        key = self.keys.replication_disabled
        if enabled:
            with contextlib.suppress(NoNode):
                await self._store.delete(key)
            return
        await self._store.put(key, str(self._now_ms()).encode())

    # ---- decommissioning ----------------------------------------------------------------------------

    async def decommissioning(self) -> set[str]:
        """Bookies being decommissioned (never chosen as replacements)."""
        items, _ = await list_all(self._store, self.keys.decommissioning_prefix)
        return {kv.key[len(self.keys.decommissioning_prefix) :] for kv in items}

    async def start_decommission(self, bookie_id: str) -> None:
        await self._store.put(self.keys.decommissioning(bookie_id), str(self._now_ms()).encode())

    async def end_decommission(self, bookie_id: str) -> None:
        with contextlib.suppress(NoNode):
            await self._store.delete(self.keys.decommissioning(bookie_id))

    # ---- data dir instances seen ------------------------------------------------------------------

    async def seen_instance(self, bookie_id: str) -> SeenInstance | None:
        """The data dir instance the auditor last saw ``bookie_id`` registered with (None: never)."""
        current = await self._store.get(self.keys.replication_instance(bookie_id))
        if current is None:
            return None
        return SeenInstance(current.value.decode(errors="replace"), current.version)

    async def record_instance(self, bookie_id: str, instance: str, seen: SeenInstance | None) -> bool:
        """Record ``instance`` as the one ``bookie_id`` is registered with, if what is stored is
        still ``seen`` (CAS; None: nothing stored). False: it changed meanwhile (another auditor,
        or an answer lost): read it again."""
        key = self.keys.replication_instance(bookie_id)
        value = instance.encode()  # a registration's attribute, bounded as the registration is
        try:
            if seen is None:
                await self._store.create(key, value)
            else:
                await self._store.compare_and_set(key, value, seen.version)
        except (NodeExists, BadVersion, NoNode, CasResultUnknown):
            return False
        return True

    async def forget_instance(self, bookie_id: str, instance: str | None) -> bool:
        """Delete the recorded instance of a decommissioned bookie: the one whose cookie was just
        deleted (``instance``; None: it had none left), read and deleted at one version. A record
        of another instance, or one rewritten meanwhile (the bookie back with a new data dir and
        an auditor recording it), stays: it is what tells that bookie's next replacement. False:
        something stayed (read it again to see what); True: no record is left."""
        key = self.keys.replication_instance(bookie_id)
        current = await self._store.get(key)
        if current is None:
            return True
        if instance is not None and current.value.decode(errors="replace") != instance:
            return False
        try:
            await self._store.delete(key, current.version)
        except NoNode:
            return True
        except (BadVersion, CasResultUnknown):
            return False
        return True

    # ---- daemon statuses --------------------------------------------------------------------------

    async def publish_status(self, daemon_id: str, lease_id: int, status: Mapping[str, Any]) -> None:
        """Put the daemon's status (bound to its lease: it vanishes with the daemon)."""
        body = msgpack.packb({"format_version": 1, **status}, use_bin_type=True)
        if len(body) > VALUE_BYTES_MAX:
            raise InvalidMetadata(f"daemon status of {len(body)} bytes exceeds {VALUE_BYTES_MAX}")
        await self._store.put(self.keys.replication_daemon(daemon_id), body, lease_id=lease_id)

    async def statuses(self) -> dict[str, dict[str, Any]]:
        """Every live daemon's last published status, by daemon id (garbage is skipped)."""
        items, _ = await list_all(self._store, self.keys.replication_daemons_prefix)
        found: dict[str, dict[str, Any]] = {}
        for kv in items:
            try:
                body = msgpack.unpackb(kv.value, raw=False)
            except (ValueError, msgpack.UnpackException):
                continue
            if isinstance(body, dict):
                found[kv.key[len(self.keys.replication_daemons_prefix) :]] = body
        return found
