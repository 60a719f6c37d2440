"""Shared fixtures. Logic lives in tests/harness/; keep this file small."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.etcd import EtcdCluster, require_etcd_binary


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simulation", "deterministic simulation (tests/simulation)")
    group.addoption("--seed", type=int, default=None, help="replay this one seed and print its trace")
    group.addoption("--sim-seeds", type=int, default=None, help="how many seeds to run (default 300)")
    group.addoption("--sim-first", type=int, default=0, help="the first seed of the run (default 0)")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdCluster]:
    """One etcd member shared by the session (tests isolate themselves by key prefix)."""
    cluster = EtcdCluster(require_etcd_binary()).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_private() -> Iterator[EtcdCluster]:
    """A single-member etcd of the test's own, for tests that stop or restart it."""
    cluster = EtcdCluster(require_etcd_binary()).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def etcd_cluster3() -> Iterator[EtcdCluster]:
    """A 3-member etcd cluster on a crash-safe etcd version (skips otherwise), for SIGKILL tests."""
    cluster = EtcdCluster(require_etcd_binary(crash_safe=True), size=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()
