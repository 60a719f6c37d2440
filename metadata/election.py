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
# The leader gives up this long before its lease may expire: max(MIN, ttl * FRACTION).
LOST_MARGIN_S_MIN = 0.5
LOST_MARGIN_TTL_FRACTION = 0.1
# After a failed keepalive the leader tries again this soon (well within its remaining lease).
KEEPALIVE_RETRY_S = 0.5


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
        # When our lease may expire at the earliest: the send time of the last grant or keepalive
        # that succeeded, plus the TTL it gave (the store counts from when it received the call).
        self._expires_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        return (
            self._task is not None
            and not self.lost.is_set()
            and asyncio.get_running_loop().time() < self._lost_at
        )

    @property
    def _lost_at(self) -> float:
        """When to stop acting as leader: a margin before the lease can expire, so `lost` is set
        before another candidate can be elected (clock rates and loop delays differ a little)."""
        return self._expires_at - max(LOST_MARGIN_S_MIN, self._ttl_s * LOST_MARGIN_TTL_FRACTION)

    async def _grant(self) -> None:
        sent = asyncio.get_running_loop().time()
        self._lease_id = await self._store.grant_lease(self._ttl_s)
        self._expires_at = sent + self._ttl_s

    async def _keepalive(self) -> None:
        sent = asyncio.get_running_loop().time()
        ttl_s = await self._store.keepalive(self._lease_id)
        self._expires_at = sent + ttl_s

    async def leader(self) -> str | None:
        """The current leader's candidate id, or None."""
        current = await self._store.get(self._key)
        return None if current is None else current.value.decode()

    async def campaign(self) -> None:
        """Block until this candidate leads. Cancel it to give up. Raises `MetadataUnavailable`."""
        assert self._task is None, "already leading"
        await self._grant()
        try:
            while not await self._try_acquire():
                try:
                    await self._wait_vacant()
                except LeaseExpired:  # our candidacy outlived its lease (e.g. a long pause): renew
                    await self._grant()
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
        except (NodeExists, CasResultUnknown):
            # The key may be our own: a create whose answer was lost may have applied, even after
            # the read-back of an earlier try (still in flight then). Bound to our lease, it is ours.
            current = await self._store.get(self._key)
            return current is not None and current.lease_id == self._lease_id

    async def _wait_vacant(self) -> None:
        # Keep our own lease alive while waiting: campaigns can last longer than one TTL.
        await self._keepalive()
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
        """Refresh the lease every ttl / 3 (sooner after a failure); set `lost` at `_lost_at`, even
        while a keepalive is still waiting for its answer: a margin before the lease may expire,
        so before anyone else can be elected."""
        loop = asyncio.get_running_loop()
        delay_s = self._ttl_s / 3
        try:
            while True:
                async with asyncio.timeout_at(self._lost_at):
                    # never sleep past half of what is left (the last refresh may be a while ago)
                    await asyncio.sleep(min(delay_s, max(0.0, (self._lost_at - loop.time()) / 2)))
                    try:
                        await self._keepalive()
                        delay_s = self._ttl_s / 3
                    except LeaseExpired:
                        break
                    except MetadataError as error:
                        log.warning(
                            "election.keepalive_failed",
                            key=self._key,
                            error=str(error),
                            lease_left_s=round(self._lost_at - loop.time(), 2),
                        )
                        delay_s = min(KEEPALIVE_RETRY_S, self._ttl_s / 3)
        except TimeoutError:
            pass  # no keepalive succeeded in time: the lease may be gone by now
        log.warning("election.lost", key=self._key, candidate=self._candidate_id)
        self.lost.set()

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
