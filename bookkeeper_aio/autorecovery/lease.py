"""The lease an autorecovery process binds its replication locks (and status) to, kept alive.

Shared by the daemon and the inline heal of ``bkaio recover`` / ``bkaio decommission``: a lease
lost while alive (a pause or a metadata outage past its TTL) is replaced by a new one, and what
was bound to the old one (a lock, the status key) went with it: a heal in flight then commits
nothing (its writes are guarded by its lock: LockLost) and is retried under a new lock.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from metadata.errors import LeaseExpired, MetadataError
from metadata.store import MetadataStore

log = structlog.get_logger("bookkeeper_aio.autorecovery.lease")

REVOKE_TIMEOUT_S = 5.0
"""A revoke at close that takes longer is given up: the lease expires by itself after its TTL."""


class KeptLease:
    """``await lease.start()`` ... ``await lease.close()``; ``lease_id()`` is the current lease
    (renewed every third of its TTL; a new one once it expired)."""

    def __init__(self, store: MetadataStore, ttl_s: int, *, owner: str) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._owner = owner
        self._lease_id = 0
        self._task: asyncio.Task[None] | None = None

    def lease_id(self) -> int:
        return self._lease_id

    async def start(self) -> None:
        """Grant the lease and keep it alive. Raises MetadataError / TimeoutError (no lease)."""
        self._lease_id = await self._store.grant_lease(self._ttl_s)
        self._task = asyncio.get_running_loop().create_task(self._keep(), name=f"lease-{self._owner}")

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            try:
                await self._store.keepalive(self._lease_id)
            except LeaseExpired:
                log.warning("autorecovery.lease_lost", owner=self._owner)
                try:
                    self._lease_id = await self._store.grant_lease(self._ttl_s)
                except (MetadataError, TimeoutError) as error:  # tried again at the next round
                    log.warning("autorecovery.lease_grant_failed", owner=self._owner, error=repr(error))
            except (MetadataError, TimeoutError) as error:
                log.warning("autorecovery.keepalive_failed", owner=self._owner, error=repr(error))

    async def close(self) -> None:
        """Stop renewing and revoke the lease (what is bound to it goes at once)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._lease_id:
            with contextlib.suppress(MetadataError, TimeoutError):
                async with asyncio.timeout(REVOKE_TIMEOUT_S):
                    await self._store.revoke_lease(self._lease_id)
            self._lease_id = 0
