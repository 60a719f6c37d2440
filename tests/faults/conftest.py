"""Fixtures of the fault suite (the cluster itself lives in tests/faults/cluster.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.faults.cluster import FaultCluster
from tests.harness.etcd import EtcdCluster


@pytest.fixture
async def faults(etcd_server: EtcdCluster, tmp_path: Path) -> AsyncIterator[FaultCluster]:
    """A fault cluster with no bookie yet (``await faults.start(n)``), under a root of its own."""
    root = f"/bookkeeper/faults-{uuid.uuid4().hex[:12]}"
    cluster = FaultCluster(etcd_server.url(root), root, tmp_path)
    yield cluster
    await cluster.close()


@pytest.fixture
async def faults3(etcd_cluster3: EtcdCluster, tmp_path: Path) -> AsyncIterator[FaultCluster]:
    """A fault cluster on a 3-member etcd of its own (crash-safe version: skips where absent)."""
    root = "/bookkeeper/faults3"
    cluster = FaultCluster(etcd_cluster3.url(root), root, tmp_path, etcd=etcd_cluster3)
    yield cluster
    await cluster.close()
