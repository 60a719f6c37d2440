"""Client fixtures: fake bookies on real TCP, the in-memory metadata store, a BookKeeper on top."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from bookkeeper_aio import BookKeeper, ClientConfig, RandomPlacement
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore
from tests.harness.fake_bookie import FakeCluster

ROOT = "/bookkeeper/test"

FAST = ClientConfig(
    add_timeout_s=1.0,
    read_timeout_s=1.0,
    connect_timeout_s=1.0,
    reconnect_backoff_initial_s=0.01,
    reconnect_backoff_max_s=0.05,
    explicit_lac_interval_ms=50,
    speculative_read_delay_ms=50,
    metadata_timeout_s=2.0,
)


@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    """Four fake bookies that batch their EOK add answers (FEATURE_ADD_ACKS), as real ones do;
    the mangling bookies of the ack tests answer each add alone."""
    async with FakeCluster(4, add_acks=True) as fakes:
        yield fakes


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def ledgers(store: MemoryStore) -> LedgerManager:
    return LedgerManager(store, ROOT, rng=random.Random(1))


@pytest.fixture
def directory(cluster: FakeCluster) -> StaticDirectory:
    return StaticDirectory(cluster.ids)


def make_client(
    ledgers: LedgerManager, directory: StaticDirectory, config: ClientConfig = FAST, seed: int = 7
) -> BookKeeper:
    return BookKeeper(ledgers, directory, config=config, placement=RandomPlacement(random.Random(seed)))


@pytest.fixture
async def bk(ledgers: LedgerManager, directory: StaticDirectory) -> AsyncIterator[BookKeeper]:
    client = make_client(ledgers, directory)
    yield client
    await client.close()
