"""The log manager: create / read / CAS write / update (CAS loop) / list / delete log metadata.

Keys: ``<root>/logs/<name>`` (see `metadata.keys`). Values: `metadata.log_metadata.encode`. The
update loop follows `metadata.ledger_manager.LedgerManager.update`: read -> ``transform`` -> CAS at
the version read; on `BadVersion` re-read and decide again. The log writer uses `write` (one CAS at
a version it holds) where a conflict must not be retried blindly (docs/replication.md §7).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from bookkeeper_aio.errors import NoSuchLog
from metadata import log_metadata as serde
from metadata.errors import BadVersion, NoNode, UpdateRetriesExhausted
from metadata.keys import ClusterKeys
from metadata.ledger_manager import UNCHANGED, _Unchanged
from metadata.log_metadata import LogMetadata
from metadata.store import MetadataStore, list_all, watch_value

log = structlog.get_logger("metadata.log_manager")

CAS_ATTEMPTS_MAX = 200
CAS_CONFLICT_SLEEP_S_MAX = 0.02
LIST_PAGE_SIZE_DEFAULT = 1000

__all__ = ["UNCHANGED", "LogManager", "VersionedLog"]

LogTransform = Callable[[LogMetadata], "LogMetadata | _Unchanged"]


@dataclass(frozen=True, slots=True)
class VersionedLog:
    """Log metadata with the store version it was read at (the CAS token)."""

    metadata: LogMetadata
    version: int

    @property
    def name(self) -> str:
        return self.metadata.name


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class LogManager:
    """Log metadata under one cluster root. Stateless."""

    def __init__(
        self,
        store: MetadataStore,
        root: str,
        *,
        now_ms: Callable[[], int] = _now_ms,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self.keys = ClusterKeys(root)
        self._now_ms = now_ms
        self._rng = rng or random.Random()

    def now_ms(self) -> int:
        """Wall-clock milliseconds for what a log's list records (ctime, a ledger's ``closed_ms``,
        the retention cut's "now"): the clock this manager was given, so a simulation keeps wall
        time out of its metadata."""
        return self._now_ms()

    async def create(self, name: str, *, sequenced: bool = False) -> VersionedLog:
        """A new empty log, without cursors: those a deleted log of that name left (one committed
        while it was being deleted, or all of them when ``delete_log`` stopped half way) are
        removed first, so they never hold back its truncation. (Should another caller create the
        log meanwhile, a cursor committed to it in that moment is removed too: truncation may then
        cut what that consumer had not read, which its next read reports, `LogTruncated`.)
        Raises `NodeExists`, `InvalidMetadata` (bad name), `CasResultUnknown`."""
        metadata = LogMetadata(name, (), self._now_ms(), sequenced=sequenced)
        key = self.keys.log(name)
        await self.delete_cursors(name)
        version = await self._store.create(key, serde.encode(metadata))
        return VersionedLog(metadata, version)

    async def read(self, name: str) -> VersionedLog:
        """Raises `NoSuchLog`, `MetadataFormatError` (naming the log), `MetadataUnavailable`."""
        key = self.keys.log(name)
        current = await self._store.get(key)
        if current is None:
            raise NoSuchLog(name)
        return VersionedLog(serde.decode(current.value, key=key, name=name), current.version)

    async def read_if_changed(self, name: str, version: int) -> VersionedLog | None:
        """The log as stored, or None when it is still at ``version``: then nothing is decoded
        (a full list, about 1 MiB, takes ~80 ms of CPU to decode). Raises as :meth:`read`."""
        key = self.keys.log(name)
        current = await self._store.get(key)
        if current is None:
            raise NoSuchLog(name)
        if current.version == version:
            return None
        return VersionedLog(serde.decode(current.value, key=key, name=name), current.version)

    async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
        """One CAS at ``expected_version``. Raises `BadVersion`, `NoSuchLog`, `CasResultUnknown`."""
        try:
            version = await self._store.compare_and_set(
                self.keys.log(metadata.name), serde.encode(metadata), expected_version
            )
        except NoNode:
            raise NoSuchLog(metadata.name) from None
        return VersionedLog(metadata, version)

    async def update(
        self,
        name: str,
        transform: LogTransform,
        *,
        attempts_max: int = CAS_ATTEMPTS_MAX,
        current: VersionedLog | None = None,
    ) -> VersionedLog:
        """Read-modify-write with CAS until it applies, ``transform`` says `UNCHANGED`, or it raises."""
        if current is None:
            current = await self.read(name)
        for attempt in range(1, attempts_max + 1):
            proposed = transform(current.metadata)
            if isinstance(proposed, _Unchanged):
                return current
            if proposed.name != name:
                raise ValueError(f"transform changed the log name {name!r} -> {proposed.name!r}")
            try:
                return await self.write(proposed, current.version)
            except BadVersion as error:
                log.debug("log.cas_conflict", log=name, attempt=attempt, error=repr(error))
            await asyncio.sleep(self._rng.uniform(0, min(CAS_CONFLICT_SLEEP_S_MAX, 0.001 * attempt)))
            current = await self.read(name)
        raise UpdateRetriesExhausted(self.keys.log(name), attempts_max)

    async def delete(self, name: str, expected_version: int | None = None) -> None:
        """Delete the log's metadata (not its ledgers). Raises `NoSuchLog`, `BadVersion`."""
        try:
            await self._store.delete(self.keys.log(name), expected_version)
        except NoNode:
            raise NoSuchLog(name) from None

    def watch(self, name: str) -> AsyncGenerator[VersionedLog | None, None]:
        """The current list, then every change; ``None`` once the log is deleted (then it ends).
        Survives reconnects; after a compaction it re-reads and goes on. Raises `NoSuchLog` if the
        log does not exist when the watch starts. Close it with ``aclose()``."""
        key = self.keys.log(name)

        def decode(value: bytes, revision: int) -> VersionedLog:
            return VersionedLog(serde.decode(value, key=key, name=name), revision)

        return watch_value(self._store, key, lambda: self.read(name), decode, NoSuchLog)

    # ------------------------------------------------------------------ named cursors
    async def write_cursor(self, name: str, cursor: str, ledger_id: int, entry_id: int) -> None:
        """Store ``cursor``'s position (the last record it consumed); last writer wins. Raises
        `InvalidMetadata` (bad names or position), `CasResultUnknown`."""
        value = serde.encode_cursor(ledger_id, entry_id, self._now_ms())
        await self._store.put(self.keys.log_cursor(name, cursor), value)

    async def read_cursors(self, name: str) -> dict[str, tuple[int, int]]:
        """Every cursor of the log: name -> (ledger id, entry id). Raises `MetadataFormatError`."""
        prefix = self.keys.log_cursors_prefix(name)
        items, _ = await list_all(self._store, prefix)
        return {
            kv.key.removeprefix(prefix): serde.decode_cursor(kv.value, key=kv.key, name=name) for kv in items
        }

    async def delete_cursor(self, name: str, cursor: str) -> bool:
        """Whether the cursor existed."""
        try:
            await self._store.delete(self.keys.log_cursor(name, cursor))
        except NoNode:
            return False
        return True

    async def delete_cursors(self, name: str) -> None:
        """Remove every cursor of the log (their values are not read: a corrupt one goes too)."""
        prefix = self.keys.log_cursors_prefix(name)
        start_after: str | None = None
        while True:
            page = await self._store.list(
                prefix, start_after=start_after, limit=LIST_PAGE_SIZE_DEFAULT, keys_only=True
            )
            for kv in page.items:
                with contextlib.suppress(NoNode):
                    await self._store.delete(kv.key)
            if not page.more or not page.items:
                return
            start_after = page.items[-1].key

    async def iter_names(self, *, page_size: int = LIST_PAGE_SIZE_DEFAULT) -> AsyncIterator[str]:
        """Every log name in key order, page by page (not a snapshot; keys only: log values may be
        large)."""
        start_after: str | None = None
        while True:
            page = await self._store.list(
                self.keys.logs_prefix, start_after=start_after, limit=page_size, keys_only=True
            )
            for kv in page.items:
                yield self.keys.log_name_of(kv.key)
            if not page.more or not page.items:
                return
            start_after = page.items[-1].key
