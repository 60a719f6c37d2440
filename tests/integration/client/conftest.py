"""Real bookie processes + real etcd for client tests.

Each test gets its own cluster root on the session's etcd and its own bookie processes (ids b0..).
The bookie CLI has no metadata option yet, so the test process registers each bookie in etcd (a
lease-bound key through ``metadata.BookieRegistration``) — the client then discovers and resolves
bookies exactly as in production. ``Cluster.kill(i)`` kills the process with SIGKILL and withdraws
its registration (what lease expiry would do).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper, ClientConfig
from metadata import BookieInfo, BookieRegistration
from metadata.cluster import connect as metadata_connect
from metadata.cluster import ensure_cluster
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd


class Cluster:
    def __init__(self, url: str, root: str, base: Path) -> None:
        self.url = url
        self.root = root
        self.base = base
        self.procs: list[BookieProcess] = []
        self.registrations: list[BookieRegistration | None] = []
        self.meta = metadata_connect(url)

    async def start(self, n: int) -> None:
        await ensure_cluster(self.meta.store, self.root)
        for i in range(n):
            proc = BookieProcess(self.base / f"b{i}", bookie_id=f"b{i}")
            # Off the loop: the registrations' keepalives run on it. A start blocks until READY
            # (seconds on a loaded machine), and two of them in a row outlasted b0's 5 s lease:
            # the client then saw two writable bookies and a create of E=3 failed.
            host, port = await asyncio.to_thread(proc.start)
            self.procs.append(proc)
            registration = BookieRegistration(
                self.meta.store, self.root, BookieInfo(f"b{i}", host, port), ttl_s=5
            )
            await registration.start()
            self.registrations.append(registration)

    def proc(self, bookie_id: str) -> BookieProcess:
        return next(p for p in self.procs if p.bookie_id == bookie_id)

    async def kill(self, bookie_id: str) -> None:
        index = next(i for i, p in enumerate(self.procs) if p.bookie_id == bookie_id)
        self.procs[index].kill()
        registration = self.registrations[index]
        if registration is not None:
            await registration.close()
            self.registrations[index] = None

    async def close(self) -> None:
        for registration in self.registrations:
            if registration is not None:
                await registration.close()
        for proc in self.procs:
            proc.cleanup()
        await self.meta.close()


@pytest.fixture
async def cluster(etcd_server: EtcdCluster, tmp_path: Path) -> AsyncIterator[Cluster]:
    root = f"/bookkeeper/client-{uuid.uuid4().hex[:12]}"
    fixture = Cluster(etcd_server.url(root), root, tmp_path)
    yield fixture
    await fixture.close()


CONFIG = ClientConfig(add_timeout_s=2.0, read_timeout_s=2.0, reconnect_backoff_max_s=0.5)


@pytest.fixture
async def bk(cluster: Cluster) -> AsyncIterator[BookKeeper]:
    async with BookKeeper.connect(cluster.url, config=CONFIG) as client:
        yield client
