"""Shared fixtures. Logic lives in tests/harness/; keep this file small."""

from __future__ import annotations

import os

# Every child process of the tests is fork + exec (bookies, etcd, Spark's JVM): gRPC's fork handlers
# are not needed, and a fork while the etcd client's gRPC threads run skips them ("Other threads
# are currently calling into gRPC") and could leave Spark's JVM gateway dead before its first word.
# Read by gRPC when it loads: set before anything imports it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from hypothesis import settings

from tests.harness.etcd import EtcdCluster, require_etcd_binary

# No example has a time limit: hypothesis's default 200 ms deadline is a timed assertion, and on a
# loaded 2-core machine an example of the codec's property tests can take longer (a DeadlineExceeded
# that says nothing of the code). Performance is measured in benchmarks/, never asserted in tests.
settings.register_profile("bookkeeper_aio", deadline=None)
settings.load_profile("bookkeeper_aio")

_configure_structlog = structlog.configure


def _configure_without_caching(*args: Any, **kwargs: Any) -> None:
    """A test that configures logging in-process (the CLI's main, configure_logging) must not
    freeze the module loggers it touches: a cached logger escapes ``structlog.testing.capture_logs``
    in every later test of the session, whose assertions on log events then fail by test order."""
    kwargs["cache_logger_on_first_use"] = False
    _configure_structlog(*args, **kwargs)


structlog.configure = _configure_without_caching


@pytest.fixture(autouse=True)
def _structlog_configuration_restored() -> Iterator[None]:
    """A test that configures logging in-process (the CLI's ``main`` sets its level) leaves the
    next test the configuration it found: a level left at "error" filtered the warnings every later
    ``capture_logs`` of the worker looked for."""
    saved = structlog.get_config()
    yield
    _configure_without_caching(**saved)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simulation", "deterministic simulation (tests/simulation)")
    group.addoption("--seed", type=int, default=None, help="replay this one seed and print its trace")
    group.addoption("--sim-seeds", type=int, default=None, help="how many seeds to run (default 300)")
    group.addoption("--sim-first", type=int, default=0, help="the first seed of the run (default 0)")
    group.addoption(
        "--race-seeds", type=int, default=None, help="how many seeds of the race profile to run (default 50)"
    )
    group.addoption(
        "--autorecovery-seeds",
        type=int,
        default=None,
        help="how many seeds of the autorecovery profile to run (default 40)",
    )


_SHARED_GROUPS = {
    # one SparkSession per run: every Spark test on one worker
    "tests/integration/spark/": "spark",
    # the fault suite's tests share one cluster per module and load the machine: one worker
    "tests/faults/": "faults",
}
_NETNS_MODULES = (
    # network namespaces, bridges and fixed test-host addresses: never two at once
    "tests/faults/test_netns.py",
    "tests/integration/cli/test_operations_doc.py",
    "tests/integration/cli/test_sandbox_hosts.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist loadgroup``) a module's tests stay on
    one worker (its module-scoped clusters are started once), and the groups above stay together."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        path = item.nodeid.split("::", 1)[0]
        group = "netns" if path in _NETNS_MODULES else path
        for prefix, shared in _SHARED_GROUPS.items():
            if path.startswith(prefix) and group != "netns":
                group = shared
        item.add_marker(pytest.mark.xdist_group(group))


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
