"""Leader election on one key bound to the leader's lease (used by the auditor).

``campaign()`` creates ``key`` = candidate id with ``create_revision == 0``, bound to the candidate's
lease; if another candidate holds it, it watches the key until it is deleted (resign, or lease expiry
when the leader dies) and tries again. The leader's lease is kept alive by a task owned by the
`Election`; if the lease is lost anyway, `lost` is set and the holder must stop acting as leader at
once (another candidate may already lead). ``resign()`` deletes the key and revokes the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import structlog

from metadata.errors import CasResultUnknown, LeaseExpired, MetadataError, NodeExists, WatchCompacted
from metadata.keys import validate_name
from metadata.store import EventKind, MetadataStore

log = structlog.get_logger("metadata.election")

ELECTION_TTL_S_DEFAULT = 10


class Election:
    """One candidate's view of the election on ``key``."""

    def __init__(
        self, store: MetadataStore, key: str, candidate_id: str, *, ttl_s: int = ELECTION_TTL_S_DEFAULT
    ) -> None:
        self._store = store
        self._key = key
        self._candidate_id = validate_name(candidate_id, "candidate id")
        self._ttl_s = ttl_s
        self._lease_id = 0
        self._task: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        return self._task is not None and not self.lost.is_set()

    async def leader(self) -> str | None:
        """The current leader's candidate id, or None."""
        current = await self._store.get(self._key)
        return None if current is None else current.value.decode()

    async def campaign(self) -> None:
        """Block until this candidate leads. Cancel it to give up. Raises `MetadataUnavailable`."""
        assert self._task is None, "already leading"
        self._lease_id = await self._store.grant_lease(self._ttl_s)
        try:
            while not await self._try_acquire():
                try:
                    await self._wait_vacant()
                except LeaseExpired:  # our candidacy outlived its lease (e.g. a long pause): renew
                    self._lease_id = await self._store.grant_lease(self._ttl_s)
        except BaseException:
            with contextlib.suppress(MetadataError):
                await self._store.revoke_lease(self._lease_id)
            raise
        self.lost.clear()
        self._task = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name=f"election-{self._key}"
        )
        log.info("election.won", key=self._key, candidate=self._candidate_id)

    async def _try_acquire(self) -> bool:
        try:
            await self._store.create(self._key, self._candidate_id.encode(), lease_id=self._lease_id)
            return True
        except NodeExists:
            return False
        except CasResultUnknown:
            current = await self._store.get(self._key)
            return current is not None and current.lease_id == self._lease_id

    async def _wait_vacant(self) -> None:
        # Keep our own lease alive while waiting: campaigns can last longer than one TTL.
        await self._store.keepalive(self._lease_id)
        # The page's revision, not the key's version: a key last written before a compaction would
        # make a watch from its version + 1 fail at once, every time (a hot loop of create + watch).
        page = await self._store.list(self._key, limit=1)
        if not any(kv.key == self._key for kv in page.items):
            return
        events = self._store.watch(self._key, start_revision=page.revision + 1)
        try:
            async with contextlib.aclosing(events), asyncio.timeout(self._ttl_s / 3):
                async for event in events:
                    if event.kind is EventKind.DELETE:
                        return
        except (TimeoutError, WatchCompacted):
            return

    async def _keepalive_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self._store.keepalive(self._lease_id)
                last_ok = loop.time()
                continue
            except LeaseExpired:
                pass
            except MetadataError as error:
                log.warning("election.keepalive_failed", key=self._key, error=str(error))
                if loop.time() - last_ok < self._ttl_s:
                    continue  # the lease may still be valid: keep trying until one TTL has passed
            log.warning("election.lost", key=self._key, candidate=self._candidate_id)
            self.lost.set()
            return

    async def resign(self) -> None:
        """Give up leadership (or the candidacy): the key disappears, others may win."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._lease_id:
            with contextlib.suppress(MetadataError):
                await self._store.revoke_lease(self._lease_id)
            self._lease_id = 0
        self.lost.set()

    async def close(self) -> None:
        await self.resign()

    async def observe(self) -> AsyncGenerator[str | None, None]:
        """The current leader, then each change (None while vacant)."""
        while True:
            # One read gives the value and the revision it was read at, so no change slips between.
            page = await self._store.list(self._key, limit=1)
            current = next((kv for kv in page.items if kv.key == self._key), None)
            yield None if current is None else current.value.decode()
            start = page.revision + 1
            events = self._store.watch(self._key, start_revision=start)
            try:
                async with contextlib.aclosing(events):
                    async for event in events:
                        yield (
                            None
                            if event.kind is EventKind.DELETE or event.value is None
                            else event.value.decode()
                        )
            except WatchCompacted:
                continue
