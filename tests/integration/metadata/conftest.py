"""The ``store`` fixture: every contract test runs against both drivers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from metadata.etcd import EtcdConfig, EtcdStore
from metadata.memory import MemoryStore
from metadata.store import MetadataStore, WatchEvent
from tests.harness.etcd import EtcdCluster


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[MetadataStore]:
    if request.param == "memory":
        driver: MetadataStore = MemoryStore()
    else:
        server: EtcdCluster = request.getfixturevalue("etcd_server")
        driver = EtcdStore(EtcdConfig(server.endpoints, op_timeout_s=5.0))
    try:
        yield driver
    finally:
        await driver.close()


@pytest.fixture
def root() -> str:
    """A cluster root of the test's own, so tests sharing one etcd never see each other's keys."""
    return f"/test/{uuid.uuid4().hex[:12]}"


async def compact(store: MetadataStore) -> None:
    """Compact the store's whole history (etcd's compaction; the twin's ``compact()``)."""
    if isinstance(store, MemoryStore):
        store.compact()
    else:
        assert isinstance(store, EtcdStore)
        await store.compact(await store.current_revision())


class WatchCounter:
    """Counts the watches started on ``store`` (wraps its ``watch``)."""

    def __init__(self, store: MetadataStore) -> None:
        self.starts = 0
        inner = store.watch

        def watch(key: str, **kwargs: Any) -> AsyncGenerator[WatchEvent, None]:
            self.starts += 1
            return inner(key, **kwargs)

        store.watch = watch  # type: ignore[method-assign]
