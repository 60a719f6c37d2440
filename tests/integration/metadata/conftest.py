"""The ``store`` fixture: every contract test runs against both drivers."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from metadata.etcd import EtcdConfig, EtcdStore
from metadata.memory import MemoryStore
from metadata.store import MetadataStore
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
