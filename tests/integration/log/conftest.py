"""Real bookies + real etcd for the log tests: the client tests' cluster fixtures, reused."""

from __future__ import annotations

from tests.integration.client.conftest import CONFIG, Cluster, bk, cluster

__all__ = ["CONFIG", "Cluster", "bk", "cluster"]
