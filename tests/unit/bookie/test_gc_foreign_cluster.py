"""A running bookie after its metadata store was wiped and re-initialised (another cluster instance
id, which a start refuses): it judges nothing against that cluster (its ledgers are not in it, and
a new ledger there reuses an old one's id): GC collects nothing, limbo and key lookups refuse, and
the bookie turns read-only and unhealthy, saying what to do, until a restart."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import metadata
from bookie import gc as bookie_gc
from bookie.config import BookieConfig
from bookie.cookie import read_cluster_binding
from bookie.fileio import OS_FILE_IO
from bookie.gc import ForeignCluster, GarbageCollector, GcConfig, MetadataCatalog, MetadataUnusable
from bookie.registration import MetadataRegistration
from bookie.server import BookieServer
from metadata import MetadataConnection
from tests.harness.admin_http import get_json

from .test_gc import CLUSTER, Clock, _Connection, filled, memory_catalog
from .test_storage import add

ME = "b1"


async def _create(store: metadata.MetadataStore, count: int, root: str = "/test") -> list[int]:
    manager = metadata.LedgerManager(store, root)
    return [(await manager.create((ME,), write_quorum=1, ack_quorum=1)).ledger_id for _ in range(count)]


async def _reinitialise(store: metadata.MetadataStore, root: str, instance_id: str) -> None:
    """etcd lost or wiped, then ``bkaio cluster init`` and a client's first ledger (id 1 again)."""
    for item in (await store.list(root + "/", limit=10_000)).items:
        await store.delete(item.key)
    await metadata.init_cluster(store, root, instance_id=instance_id)
    assert await _create(store, 1, root) == [1]


async def test_gc_collects_nothing_against_another_cluster_and_says_so(tmp_path: Path) -> None:
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    ids = await _create(store, 4)
    storage = await filled(tmp_path, range(ids[0], ids[-1] + 1))
    seen: list[str] = []
    clock = Clock()
    catalog = memory_catalog(store)
    gc = GarbageCollector(
        storage,
        GcConfig(deleted_ledger_grace_s=60.0, over_replicated_interval_s=1.0),
        catalog,
        clock,
        replicas=catalog,
        bookie_id=ME,
        on_foreign_cluster=seen.append,
    )
    assert (await gc.run_once()).error is None
    assert seen == []  # its own cluster: nothing to say

    await _reinitialise(store, "/test", "cluster-2")
    for _ in range(3):  # passes past the grace, and past the over-replication check's interval
        clock.now += 61
        report = await gc.run_once()
        assert report.ledgers_collected == 0
        assert report.error is not None
        assert "ForeignCluster" in report.error
    assert sorted(storage.ledgers) == ids
    assert gc.foreign_cluster is not None
    assert (
        f"holds cluster cluster-2, but this bookie's data belongs to cluster {CLUSTER}" in gc.foreign_cluster
    )
    assert seen == [gc.foreign_cluster]  # told once, not every pass
    # every other judgement against metadata refuses too: limbo's, the over-replication check's
    # (under a ledger's lock), a new ledger's key lookup
    with pytest.raises(ForeignCluster):
        _ = [page async for page in catalog.ledgers_on(ME)]
    with pytest.raises(ForeignCluster):
        _ = [page async for page in catalog.ledgers_metadata([1])]
    with pytest.raises(ForeignCluster):
        await catalog.replica_state(1, ME)
    with pytest.raises(ForeignCluster):
        await catalog.key_info(1)

    # its own cluster's metadata comes back (a restored backup): still nothing is judged, until a
    # restart (GC must be off against a restored backup: it lacks the newer ledgers)
    for item in (await store.list("/test/", limit=10_000)).items:
        await store.delete(item.key)
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    assert await _create(store, 4) == ids
    clock.now += 61
    report = await gc.run_once()
    assert report.error is not None
    assert "ForeignCluster" in report.error
    assert (report.ledgers_collected, sorted(storage.ledgers)) == (0, ids)
    assert (await memory_catalog(store).view()).id_counter > 0  # a restarted bookie's catalog judges
    await storage.close()


async def test_a_key_lookup_finds_another_cluster_by_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new ledger of the other cluster under a held ledger's id would have its key confirmed and
    the held record dropped as a squatter's: key lookups check the cluster too (within
    CLUSTER_RECHECK_S of the last check, so a burst of new ledgers costs one more read a second)."""
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    await _create(store, 1)
    catalog = memory_catalog(store)
    assert (await catalog.key_info(1)).exists
    await _reinitialise(store, "/test", "cluster-2")
    monkeypatch.setattr(bookie_gc, "CLUSTER_RECHECK_S", 0.0)
    with pytest.raises(ForeignCluster, match="holds cluster cluster-2"):
        await catalog.key_infos([1, 2])
    assert catalog.foreign_cluster is not None


async def test_a_catalog_refuses_before_its_bookie_names_a_cluster() -> None:
    """A COOKIE that names no cluster yet (before the first registration) proves nothing."""
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    await _create(store, 1)
    catalog = MetadataCatalog(
        "memory:///test", connect=lambda url: _Connection(store, "/test"), cluster_id=lambda: None
    )
    with pytest.raises(MetadataUnusable, match="names no cluster yet") as refused:
        await catalog.view()
    assert not isinstance(refused.value, ForeignCluster)
    assert catalog.foreign_cluster is None


async def test_the_bookie_turns_read_only_and_unhealthy_with_what_to_do(tmp_path: Path) -> None:
    """The whole bookie as ``bookie/__main__.py`` builds it: the catalog reads its cluster from the
    data dir's COOKIE (written by the registration at the first start)."""
    root = "/foreign"
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, root, instance_id="cluster-A")
    config = BookieConfig(
        data_dir=str(tmp_path / "data"), bookie_id=ME, port=0, admin_port=0, gc_interval_s=0
    ).validate()
    registration = MetadataRegistration(f"memory://{root}", connection=MetadataConnection(store, root))
    catalog = MetadataCatalog(
        f"memory://{root}",
        connect=lambda url: MetadataConnection(store, root),
        cluster_id=functools.partial(read_cluster_binding, OS_FILE_IO, config.data_dir),
    )
    server = BookieServer(config, registration, catalog=catalog, replicas=catalog)
    await server.start()
    try:
        assert server.storage is not None
        assert server.gc is not None
        assert server.admin is not None
        assert server.admin.address is not None
        host, port = server.admin.address
        assert await _create(store, 1, root) == [1]
        await add(server.storage, 1, 0)
        assert (await server.gc.run_once()).error is None
        assert not server.mode.read_only

        await _reinitialise(store, root, "cluster-B")
        report = await server.gc.run_once()
        assert report.ledgers_collected == 0
        assert list(server.storage.ledgers) == [1]
        assert server.mode.read_only
        assert server.mode.reason is not None
        assert "holds cluster cluster-B" in server.mode.reason
        status, body = await get_json(host, port, "/health")
        assert status == 503
        (problem,) = body["problems"]
        assert "belongs to cluster cluster-A" in problem
        assert "restart the bookie" in problem
        status, body = await get_json(host, port, "/readonly")
        assert body["mode"] == "readonly"
    finally:
        await server.close()
