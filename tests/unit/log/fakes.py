"""A log test's world: fake bookies (tests/harness/fake_bookie.py), one MemoryStore, and clients
of it with seeded ledger ids and placement."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator

from bookkeeper_aio import BookKeeper, ClientConfig, RandomPlacement
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore
from tests.harness.fake_bookie import FakeCluster
from tests.unit.client.conftest import FAST, ROOT


@dataclasses.dataclass
class World:
    cluster: FakeCluster
    store: MemoryStore
    clients: list[BookKeeper]


@contextlib.asynccontextmanager
async def world(config: ClientConfig = FAST, clients: int = 2) -> AsyncIterator[World]:
    async with FakeCluster(4, add_acks=True) as cluster:
        store = MemoryStore()
        made = [
            BookKeeper(
                LedgerManager(store, ROOT, rng=random.Random(i)),
                StaticDirectory(cluster.ids),
                config=config,
                placement=RandomPlacement(random.Random(7 + i)),
            )
            for i in range(clients)
        ]
        try:
            yield World(cluster, store, made)
        finally:
            for client in made:
                with contextlib.suppress(Exception):
                    await client.close()
