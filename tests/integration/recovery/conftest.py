"""Real bookie processes + real etcd: the client integration fixtures, reused."""

from tests.integration.client.conftest import CONFIG, Cluster, bk, cluster

__all__ = ["CONFIG", "Cluster", "bk", "cluster"]
