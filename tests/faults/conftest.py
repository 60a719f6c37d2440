"""Fixtures of the fault suite (the cluster itself lives in tests/faults/cluster.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.faults.cluster import FaultCluster
from tests.harness.etcd import EtcdCluster

SHARED_BOOKIES = 5
SHARED_FAULTY_MAX = 2
"""Bookies of the shared cluster a nemesis holds faulty at once: 3 stay up, so E3 ensembles can form."""
SHARED_BOOKIE_ARGS = ["--checkpoint-interval-s", "0.2"]
"""The shared cluster's bookies checkpoint their index often: test_disk_faults flips bits only in
records a checkpoint covers."""
ON_SHARED = pytest.mark.asyncio(loop_scope="package")
"""The mark of a test on the `shared` cluster: it runs on the package's event loop, the one the
cluster's proxies serve on."""


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


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def _shared_cluster(
    etcd_server: EtcdCluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FaultCluster]:
    root = f"/bookkeeper/faults-shared-{uuid.uuid4().hex[:12]}"
    cluster = FaultCluster(etcd_server.url(root), root, tmp_path_factory.mktemp("faults-shared"))
    await cluster.start(SHARED_BOOKIES, bookie_args=SHARED_BOOKIE_ARGS)
    cluster.faulty_max = SHARED_FAULTY_MAX
    yield cluster
    await cluster.close()


@pytest_asyncio.fixture(loop_scope="package")
async def shared(_shared_cluster: FaultCluster) -> FaultCluster:
    """`make test`'s fault cluster: 5 bookies started once for the package's quick scenarios (each
    test marked `ON_SHARED`), healed before each. Its data dirs and logs are in its ``base``."""
    await _shared_cluster.heal()
    return _shared_cluster
