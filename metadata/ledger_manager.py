"""The ledger manager: create / read / update (CAS loop) / delete / list / watch ledger metadata.

Keys: ``<root>/ledgers/<19-digit id>`` (see `metadata.keys`). Values: `metadata.ledger_metadata.encode`.

The read-modify-write loop (`LedgerManager.update`): read (metadata, version) -> ``transform(current)``
-> CAS at that version. ``transform`` returns the new metadata, or `UNCHANGED` to stop without writing,
or raises to abort (the exception propagates). On `BadVersion` the loop re-reads and calls ``transform``
again on the fresh metadata, so decisions are always taken on the latest state (docs/replication.md
§2: on a CAS conflict, re-read and decide again). Retries are bounded and jittered.

`CasResultUnknown` from the CAS is propagated, not guessed: the caller re-runs its update, and a
well-written transform recognises that its change is already there (e.g. close finds CLOSED at the same
last entry) and returns `UNCHANGED`. Create is the exception: a new id is ours alone, so an unknown
create is resolved by reading the key back (for a while, if the store is unavailable); one that still
cannot be resolved is `LedgerCreateUnknown`, carrying the id, for the caller to discard.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final, TypeVar

import structlog

from bookkeeper_aio.common import failpoints
from bookkeeper_aio.common.backoff import Backoff
from metadata import ledger_metadata as serde
from metadata.errors import (
    BadVersion,
    CasResultUnknown,
    LedgerCreateUnknown,
    MetadataError,
    MetadataFormatError,
    MetadataUnavailable,
    NodeExists,
    NoNode,
    NoSuchLedger,
    UpdateRetriesExhausted,
)
from metadata.idgen import IdGenerator
from metadata.keys import ClusterKeys
from metadata.ledger_metadata import LedgerMetadata
from metadata.store import Guards, KeyValue, MetadataStore, watch_value

log = structlog.get_logger("metadata.ledger_manager")

CAS_ATTEMPTS_MAX = 200
# Jitter after a lost CAS so that many writers of one ledger spread out instead of colliding again.
CAS_CONFLICT_SLEEP_S_MAX = 0.02
LIST_PAGE_SIZE_DEFAULT = 1000
ID_TAKEN_ATTEMPTS_MAX = 100
"""Creates in a row that may meet an id a ledger already holds before `LedgerManager.create` gives up."""
CREATE_RESOLVE_TIMEOUT_S = 10.0
"""How long a create whose answer was lost keeps reading its key back before `LedgerCreateUnknown`."""


class _Unchanged:
    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Final = _Unchanged()
Transform = Callable[[LedgerMetadata], "LedgerMetadata | _Unchanged"]


@dataclass(frozen=True, slots=True)
class VersionedLedger:
    """Ledger metadata with the store version it was read at (the CAS token)."""

    metadata: LedgerMetadata
    version: int

    @property
    def ledger_id(self) -> int:
        return self.metadata.ledger_id


@dataclass(frozen=True, slots=True)
class LedgerIdPage:
    """Ledger ids in increasing order; pass ``ledger_ids[-1]`` as ``start_after`` while ``more``."""

    ledger_ids: tuple[int, ...]
    more: bool


@dataclass(frozen=True, slots=True)
class LedgerPage:
    """A :class:`LedgerIdPage` with the metadata of the ledgers :meth:`LedgerManager.read_page`
    decoded (all of them, or those that may record a bookie replaced)."""

    ledger_ids: tuple[int, ...]
    ledgers: Mapping[int, VersionedLedger]
    more: bool


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


_T = TypeVar("_T")


async def _within(timeout_s: float | None, step: Awaitable[_T]) -> _T:
    """``await step`` within ``timeout_s`` (``TimeoutError``); None: no bound, and no timeout made
    for nothing (an ``asyncio.timeout(None)`` costs a context and two coroutines, per read and per
    CAS of every update)."""
    if timeout_s is None:
        return await step
    async with asyncio.timeout(timeout_s):
        return await step


class LedgerManager:
    """Ledger metadata under one cluster root. Stateless apart from its id generator."""

    def __init__(
        self,
        store: MetadataStore,
        root: str,
        *,
        id_block_size: int = 1000,
        now_ms: Callable[[], int] = _now_ms,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self.keys = ClusterKeys(root)
        self._ids = IdGenerator(store, self.keys.idgen, block_size=id_block_size)
        self._now_ms = now_ms
        self._rng = rng or random.Random()

    def now_ms(self) -> int:
        """Wall-clock milliseconds for what metadata records (ctime, replacement times): the clock
        this manager was given, so a simulation keeps wall time out of its metadata."""
        return self._now_ms()

    @property
    def store(self) -> MetadataStore:
        """The metadata store this manager writes to (other managers of the cluster share it)."""
        return self._store

    # ---- create / read ---------------------------------------------------------------------------

    async def create(
        self,
        ensemble: tuple[str, ...] | list[str],
        *,
        write_quorum: int,
        ack_quorum: int,
        digest_type: str = "crc32c",
        password_hash: bytes = b"",
        custom_metadata: Mapping[str, bytes] | None = None,
        after_ledger_id: int = 0,
        key_salt: bytes = b"",
        key_iterations: int = 0,
        key_ledger_salt: bytes = b"",
        key_format: int = 0,
        resolve_timeout_s: float = CREATE_RESOLVE_TIMEOUT_S,
    ) -> VersionedLedger:
        """A new OPEN ledger with a fresh unique id larger than ``after_ledger_id``.

        An id the counter handed out that a ledger already holds (the counter went back: a restored
        metadata snapshot, docs/operations.md) is never overwritten: the create moves to a fresh id
        above it, and logs ``ledger_manager.id_taken`` (run ``bkaio cluster raise-ids``). Raises
        `InvalidMetadata`, `MetadataUnavailable`, `NodeExists` (ids taken `ID_TAKEN_ATTEMPTS_MAX`
        times in a row), `LedgerCreateUnknown` (:meth:`create_metadata`)."""
        after = after_ledger_id
        for _ in range(ID_TAKEN_ATTEMPTS_MAX):
            ledger_id = await self._ids.next_id(after)
            metadata = LedgerMetadata.new(
                ledger_id,
                ensemble,
                write_quorum=write_quorum,
                ack_quorum=ack_quorum,
                digest_type=digest_type,
                password_hash=password_hash,
                custom_metadata=custom_metadata,
                ctime_ms=self._now_ms(),
                key_salt=key_salt,
                key_iterations=key_iterations,
                key_ledger_salt=key_ledger_salt,
                key_format=key_format,
            )
            try:
                return await self.create_metadata(metadata, resolve_timeout_s=resolve_timeout_s)
            except NodeExists:
                log.warning(
                    "ledger_manager.id_taken",
                    ledger_id=ledger_id,
                    counter=self.keys.idgen,
                    hint="the id counter is behind the ledgers (a restored metadata snapshot?): run "
                    "`bkaio cluster raise-ids` with every client stopped",
                )
                after = ledger_id
        raise NodeExists(self.keys.ledger(after)) from None

    async def create_metadata(
        self, metadata: LedgerMetadata, *, resolve_timeout_s: float = CREATE_RESOLVE_TIMEOUT_S
    ) -> VersionedLedger:
        """Store metadata under its own id. Raises `NodeExists` if the ledger exists.

        A create whose answer is lost is resolved by reading the key back, again and again while the
        store is unavailable, until ``resolve_timeout_s`` from the start; when it still cannot tell, it
        raises `LedgerCreateUnknown` (the ledger may exist: :meth:`discard_created` removes it
        once the store answers)."""
        key = self.keys.ledger(metadata.ledger_id)
        data = serde.encode(metadata)
        deadline = asyncio.get_running_loop().time() + resolve_timeout_s
        for attempt in range(2):
            try:
                failpoints.hit(failpoints.CAS_BEFORE, key=key)
                version = await self._store.create(key, data)
                failpoints.hit(failpoints.CAS_AFTER, key=key)
                return VersionedLedger(metadata, version)
            except NodeExists:
                if attempt == 0:
                    raise
                # Our first create's answer was lost and it applied after the read-back (it was
                # still in flight): the key holding our very value is ours, not someone else's.
                current = await self._read_back(key, metadata.ledger_id, data, deadline)
                if current is not None and current.value == data:
                    return VersionedLedger(metadata, current.version)
                raise
            except CasResultUnknown:
                current = await self._read_back(key, metadata.ledger_id, data, deadline)
                if current is None:
                    continue  # not applied (yet): creating again is safe, the id is ours alone
                if current.value == data:
                    return VersionedLedger(metadata, current.version)
                raise NodeExists(key) from None
        raise LedgerCreateUnknown(key, metadata.ledger_id, data, "create outcome lost twice")

    async def _read_back(self, key: str, ledger_id: int, data: bytes, deadline: float) -> KeyValue | None:
        """``key`` as the store has it now, read again (backing off) while the store is unavailable,
        until the loop's time ``deadline``; then `LedgerCreateUnknown`."""
        loop = asyncio.get_running_loop()
        backoff = Backoff(0.05, 1.0)
        while True:
            try:
                return await self._store.get(key)
            except MetadataUnavailable as error:
                remaining_s = deadline - loop.time()
                if remaining_s <= 0:
                    raise LedgerCreateUnknown(
                        key,
                        ledger_id,
                        data,
                        f"answer lost, and reading back failed until the create's deadline: {error}",
                    ) from error
                await asyncio.sleep(min(backoff.next_delay_s(), remaining_s))

    async def discard_created(self, unknown: LedgerCreateUnknown) -> bool:
        """Delete the ledger the create that raised ``unknown`` may have made, only while it holds
        exactly what that create wrote (nobody recovered, closed or changed it since): whether it
        was deleted. Raises `MetadataUnavailable`, `CasResultUnknown`."""
        key = self.keys.ledger(unknown.ledger_id)
        current = await self._store.get(key)
        if current is None or current.value != unknown.value:
            return False
        try:
            await self._store.delete(key, current.version)
        except (BadVersion, NoNode):
            return False  # changed or gone meanwhile: not ours to delete
        return True

    async def read(self, ledger_id: int) -> VersionedLedger:
        """Raises `NoSuchLedger`, `MetadataFormatError` (naming the ledger), `MetadataUnavailable`."""
        key = self.keys.ledger(ledger_id)
        current = await self._store.get(key)
        if current is None:
            raise NoSuchLedger(ledger_id, key)
        return VersionedLedger(serde.decode(current.value, key=key, ledger_id=ledger_id), current.version)

    async def read_at(self, ledger_id: int, revision: int) -> VersionedLedger | None:
        """This ledger's metadata as it was at store ``revision`` (with its version then), or None
        when the ledger did not exist yet. A ledger key deleted and created again is another ledger:
        only the history of the one that exists now is read. The store's history is needed only
        when the ledger changed after ``revision`` (etcd's read at a revision). Raises
        `NoSuchLedger` (deleted since), `WatchCompacted` (that history is compacted),
        `MetadataFormatError`, `MetadataUnavailable`."""
        key = self.keys.ledger(ledger_id)
        current = await self._store.get(key)
        if current is None:
            raise NoSuchLedger(ledger_id, key)
        if current.create_revision > revision:
            return None
        then = current
        if current.version > revision:  # changed since: read it at that revision
            page = await self._store.list(key, limit=1, revision=revision)
            found = next((kv for kv in page.items if kv.key == key), None)
            if found is None or found.create_revision != current.create_revision:
                raise MetadataError(
                    f"{key}: created at revision {current.create_revision}, but the store's history "
                    f"at revision {revision} does not show it"
                )
            then = found
        return VersionedLedger(serde.decode(then.value, key=key, ledger_id=ledger_id), then.version)

    async def exists(self, ledger_id: int) -> bool:
        return await self._store.get(self.keys.ledger(ledger_id)) is not None

    # ---- update ----------------------------------------------------------------------------------

    async def write(
        self, metadata: LedgerMetadata, expected_version: int, *, guards: Guards = ()
    ) -> VersionedLedger:
        """One CAS of ``metadata`` at ``expected_version``, only while every guard holds (e.g. the
        caller's replication lock: `metadata.store.Guard`). Raises `BadVersion`, `NoSuchLedger`,
        `GuardFailed`."""
        key = self.keys.ledger(metadata.ledger_id)
        try:
            failpoints.hit(failpoints.CAS_BEFORE, key=key)
            version = await self._store.compare_and_set(
                key, serde.encode(metadata), expected_version, guards=guards
            )
            failpoints.hit(failpoints.CAS_AFTER, key=key)
        except NoNode:
            raise NoSuchLedger(metadata.ledger_id, key) from None
        return VersionedLedger(metadata, version)

    async def update(
        self,
        ledger_id: int,
        transform: Transform,
        *,
        attempts_max: int = CAS_ATTEMPTS_MAX,
        current: VersionedLedger | None = None,
        retry_unknown: bool = False,
        attempt_timeout_s: float | None = None,
        guards: Guards = (),
    ) -> VersionedLedger:
        """Read-modify-write with CAS until it applies, ``transform`` says `UNCHANGED`, or it raises.

        The one CAS loop of ledger metadata (writer ensemble changes and close, recovery). Starts
        from ``current`` when the caller holds a recent copy (saves a read), else reads. After a
        `BadVersion` it re-reads and calls ``transform`` on the fresh metadata. With
        ``retry_unknown`` a `CasResultUnknown` is handled the same way: ``transform`` must then
        recognise its own change already applied and return `UNCHANGED` (otherwise it is applied
        twice).

        ``attempt_timeout_s`` bounds each read and each CAS on its own (``TimeoutError``), not the
        loop: a slow store that loses a few races still gets its full budget per attempt. When the
        last attempt loses, ``transform`` still sees the state that beat it, so its own rules (e.g.
        "the ledger is not OPEN any more") decide the error rather than the retry count.

        ``guards`` go with every CAS (:meth:`write`): a guard that fails ends the loop with
        `GuardFailed` (the caller's authority is gone; retrying cannot bring it back).

        Returns the metadata as stored afterwards. Raises whatever ``transform`` raises, `NoSuchLedger`,
        `UpdateRetriesExhausted`, `CasResultUnknown` (unless ``retry_unknown``), `GuardFailed`,
        `MetadataUnavailable`, ``TimeoutError``.
        """
        if current is None:
            current = await _within(attempt_timeout_s, self.read(ledger_id))
        retried = (BadVersion, CasResultUnknown) if retry_unknown else (BadVersion,)
        for attempt in range(1, attempts_max + 2):
            proposed = transform(current.metadata)
            if isinstance(proposed, _Unchanged):
                return current
            if attempt > attempts_max:  # the state that beat the last attempt passed the transform
                break
            if proposed.ledger_id != ledger_id:
                raise ValueError(f"transform changed the ledger id {ledger_id} -> {proposed.ledger_id}")
            try:
                return await _within(attempt_timeout_s, self.write(proposed, current.version, guards=guards))
            except retried as error:
                log.debug("ledger.cas_conflict", ledger_id=ledger_id, attempt=attempt, error=repr(error))
            await asyncio.sleep(self._rng.uniform(0, min(CAS_CONFLICT_SLEEP_S_MAX, 0.001 * attempt)))
            current = await _within(attempt_timeout_s, self.read(ledger_id))
        raise UpdateRetriesExhausted(self.keys.ledger(ledger_id), attempts_max)

    # ---- delete / list / watch -------------------------------------------------------------------

    async def delete(self, ledger_id: int, expected_version: int | None = None) -> None:
        """Delete the ledger's metadata. Raises `NoSuchLedger`, `BadVersion`, `CasResultUnknown`."""
        key = self.keys.ledger(ledger_id)
        try:
            await self._store.delete(key, expected_version)
        except NoNode:
            raise NoSuchLedger(ledger_id, key) from None

    async def list_page(
        self, *, start_after: int | None = None, limit: int = LIST_PAGE_SIZE_DEFAULT
    ) -> LedgerIdPage:
        """Up to ``limit`` ledger ids greater than ``start_after``, in increasing order (a keys-only
        listing: the size of the metadata does not matter)."""
        after = None if start_after is None else self.keys.ledger(start_after)
        page = await self._store.list(
            self.keys.ledgers_prefix, start_after=after, limit=limit, keys_only=True
        )
        return LedgerIdPage(tuple(self.keys.ledger_id_of(kv.key) for kv in page.items), page.more)

    async def read_page(
        self,
        *,
        start_after: int | None = None,
        limit: int = LIST_PAGE_SIZE_DEFAULT,
        not_holding: str | None = None,
        on_undecodable: Callable[[int, MetadataFormatError], None] | None = None,
    ) -> LedgerPage:
        """Up to ``limit`` ledgers with ids greater than ``start_after``, in increasing order, with
        their metadata: one listing instead of a read per ledger. With ``not_holding`` (a bookie
        id), only the metadata that may leave that bookie out of every ensemble, or record it
        replaced, is decoded (:func:`~metadata.ledger_metadata.may_not_hold`: no such ledger is left
        out), so a scan for the copies one bookie holds but may not need decodes few. Raises
        `MetadataFormatError` (naming the ledger) unless ``on_undecodable`` is given: then such a
        ledger is passed to it and left out of ``ledgers`` (its id stays listed), so one value a
        newer writer or a stray tool left cannot stop a scan of every ledger. The page may stop
        short of ``limit`` while ``more`` (large metadata: `metadata.store.Page`). Raises
        `MetadataUnavailable`."""
        after = None if start_after is None else self.keys.ledger(start_after)
        page = await self._store.list(self.keys.ledgers_prefix, start_after=after, limit=limit)
        ids: list[int] = []
        ledgers: dict[int, VersionedLedger] = {}
        for kv in page.items:
            ledger_id = self.keys.ledger_id_of(kv.key)
            ids.append(ledger_id)
            if not_holding is None or serde.may_not_hold(kv.value, not_holding):
                try:
                    md = serde.decode(kv.value, key=kv.key, ledger_id=ledger_id)
                except MetadataFormatError as exc:
                    if on_undecodable is None:
                        raise
                    on_undecodable(ledger_id, exc)
                    continue
                ledgers[ledger_id] = VersionedLedger(md, kv.version)
        return LedgerPage(tuple(ids), ledgers, page.more)

    async def iter_ledger_ids(self, *, page_size: int = LIST_PAGE_SIZE_DEFAULT) -> AsyncIterator[int]:
        """Every ledger id, page by page (memory bounded by ``page_size``; not a snapshot)."""
        start_after: int | None = None
        while True:
            page = await self.list_page(start_after=start_after, limit=page_size)
            for ledger_id in page.ledger_ids:
                yield ledger_id
            if not page.more or not page.ledger_ids:
                return
            start_after = page.ledger_ids[-1]

    def watch(self, ledger_id: int) -> AsyncGenerator[VersionedLedger | None, None]:
        """The current metadata, then every change; ``None`` once deleted (then the iterator ends).

        Survives reconnects; after a compaction it re-reads and continues from the fresh state.
        Raises `NoSuchLedger` if the ledger does not exist when the watch starts.
        """
        key = self.keys.ledger(ledger_id)

        def decode(value: bytes, revision: int) -> VersionedLedger:
            return VersionedLedger(serde.decode(value, key=key, ledger_id=ledger_id), revision)

        return watch_value(self._store, key, lambda: self.read(ledger_id), decode, NoSuchLedger)
