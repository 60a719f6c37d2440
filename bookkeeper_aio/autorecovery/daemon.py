"""The autorecovery daemon: one process beside the bookies (``bkaio autorecovery run``), holding an
auditor candidate, ``workers`` replication workers and one lease.

- The lease (``lease_ttl_s``, a :class:`~bookkeeper_aio.autorecovery.lease.KeptLease`) binds the
  workers' locks and the daemon's status key: when the daemon dies, its locks and its status vanish
  with the lease and other daemons take its ledgers over. A
  lease lost while alive (a pause past the TTL) is replaced by a new one; a heal in flight then
  commits nothing: its writes are guarded by the lock it took (its version, in the same
  transaction), which the lease took with it (LockLost; the ledger is retried under a new lock).
- Replacements are chosen among writable bookies minus those being decommissioned
  (:class:`ReplacementDirectory`).
- Every ``status_interval_s`` the daemon counts the marks and publishes its metrics
  (``R/replication/daemons/<id>``) for ``bkaio autorecovery status``.
- Seams for the deterministic simulation (tests/simulation/autorecovery.py), defaults for
  production: ``clock`` (what marks and the status record as wall-clock time, and the open-ledger
  grace), ``placement`` (the replacements' policy) and ``key_executor`` (where ledger keys are
  derived).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Coroutine, Sequence
from concurrent.futures import Executor
from typing import Any

import structlog

from bookkeeper_aio.autorecovery.auditor import Auditor
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.copier import RateLimiter
from bookkeeper_aio.autorecovery.lease import KeptLease
from bookkeeper_aio.autorecovery.metrics import AutorecoveryMetrics
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.bookkeeper import BookKeeper, RegistryDirectory
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.placement import PlacementPolicy
from bookkeeper_aio.common.clock import SYSTEM_CLOCK, Clock
from metadata.cluster import MetadataConnection
from metadata.errors import MetadataError
from metadata.keys import validate_name
from metadata.underreplication import UnderReplicationManager

log = structlog.get_logger("bookkeeper_aio.autorecovery.daemon")


def default_daemon_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}".replace("/", "_")


class ReplacementDirectory:
    """The writable bookies a replacement may be chosen from: registered writable, not being
    decommissioned (read-only bookies are never writable)."""

    def __init__(self, registry: RegistryDirectory, urm: UnderReplicationManager) -> None:
        self._registry = registry
        self._urm = urm

    async def writable_bookies(self) -> Sequence[str]:
        writable = await self._registry.writable_bookies()
        leaving = await self._urm.decommissioning()
        return [b for b in writable if b not in leaving]


class AutorecoveryDaemon:
    """``await daemon.start()`` ... ``await daemon.close()`` (or ``async with``)."""

    def __init__(
        self,
        meta: MetadataConnection,
        config: AutorecoveryConfig,
        *,
        daemon_id: str | None = None,
        client_config: ClientConfig | None = None,
        clock: Clock = SYSTEM_CLOCK,
        placement: PlacementPolicy | None = None,
        key_executor: Executor | None = None,
    ) -> None:
        self.meta = meta
        self.config = config
        self.daemon_id = validate_name(daemon_id or default_daemon_id(), "daemon id")
        self.metrics = AutorecoveryMetrics()
        self._clock = clock
        self.urm = UnderReplicationManager(meta.store, meta.root, now_ms=self._now_ms)
        registry = RegistryDirectory(meta.store, meta.root)
        self.bk = BookKeeper(
            meta.ledger_manager(),
            ReplacementDirectory(registry, self.urm),
            config=client_config,
            resolver=registry,
            placement=placement,
            key_executor=key_executor,
        )
        self.auditor = Auditor(
            self.bk.context, self.urm, config, candidate_id=self.daemon_id, metrics=self.metrics
        )
        limiter = RateLimiter(config.copy_bytes_per_s)  # one budget for all the daemon's workers
        self.workers = [
            ReplicationWorker(
                self.bk,
                self.urm,
                config,
                worker_id=f"{self.daemon_id}-w{i}",
                metrics=self.metrics,
                now_ms=self._now_ms,
                monotonic_s=self._clock.monotonic,
                limiter=limiter,
            )
            for i in range(config.workers)
        ]
        self._lease = KeptLease(meta.store, config.lease_ttl_s, owner=self.daemon_id)
        self._tasks: list[asyncio.Task[None]] = []
        self._started_ms = self._now_ms()

    def _now_ms(self) -> int:
        return int(self._clock.wall() * 1000)

    def lease_id(self) -> int:
        return self._lease.lease_id()

    async def start(self) -> None:
        await self._lease.start()
        self._spawn(self.auditor.run(), "auditor")
        for worker in self.workers:
            self._spawn(worker.run(self.lease_id), worker.worker_id)
        self._spawn(self._publish_status(), "status")
        log.info(
            "autorecovery.daemon_started",
            daemon=self.daemon_id,
            workers=len(self.workers),
            lost_bookie_recovery_delay_s=self.config.lost_bookie_recovery_delay_s,
            open_ledger_grace_s=self.config.open_ledger_grace_s,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"autorecovery-{name}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("autorecovery.task_failed", task=task.get_name(), error=repr(task.exception()))

    async def _publish_status(self) -> None:
        while True:
            try:
                self.metrics.under_replicated_ledgers = await self.urm.count()
                status = {
                    **self.metrics.snapshot(),
                    "workers": len(self.workers),
                    "started_ms": self._started_ms,
                    "updated_ms": self._now_ms(),
                    "missing_bookies": sorted(self.auditor.missing) if self.metrics.is_auditor else [],
                }
                await self.urm.publish_status(self.daemon_id, self.lease_id(), status)
            except MetadataError as error:
                log.warning("autorecovery.status_failed", daemon=self.daemon_id, error=repr(error))
            await asyncio.sleep(self.config.status_interval_s)

    async def close(self) -> None:
        """Stop every task, release the lease (locks and status go at once), close the client."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._lease.close()
        await self.bk.close()
        log.info("autorecovery.daemon_stopped", daemon=self.daemon_id)

    async def __aenter__(self) -> AutorecoveryDaemon:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
