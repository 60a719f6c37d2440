"""The auditor's periodic check on real bookies: a replica that silently lacks its entries is
found (first/last entry of each fragment), marked, and healed by a worker."""

from __future__ import annotations

import dataclasses

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.autorecovery.auditor import Auditor
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from metadata.underreplication import UnderReplicationManager
from tests.integration.autorecovery.conftest import Cluster, verify_every_replica

pytestmark = pytest.mark.etcd

PASSWORD = b"pw"


async def test_check_finds_a_replica_without_its_entries_and_the_worker_heals_it(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(5)
    handle = await bk.create_ledger(3, 2, 2, password=PASSWORD)
    payloads = [f"checked {i}".encode() for i in range(30)]
    for payload in payloads:
        await handle.append(payload)
    await handle.close()
    healthy = await bk.create_ledger(3, 2, 2, password=PASSWORD)
    await healthy.append(b"fine")
    await healthy.close()
    stored = await bk.context.ledgers.read(handle.id)
    ensemble = stored.metadata.ensembles[0][1]
    empty = next(b for b in ("b0", "b1", "b2", "b3", "b4") if b not in ensemble)
    silent = (ensemble[0], empty, ensemble[2])  # as if ensemble[1] had lost its disk to a stranger
    await bk.context.ledgers.write(
        dataclasses.replace(stored.metadata, ensembles=((0, silent),)), stored.version
    )
    urm = UnderReplicationManager(cluster.meta.store, cluster.root)
    config = AutorecoveryConfig(passwords=(PASSWORD,))
    auditor = Auditor(bk.context, urm, config, candidate_id="auditor-test")
    assert await auditor.check_all() == [handle.id]
    mark = await urm.get(handle.id)
    assert mark is not None
    assert mark.missing == (empty,)
    assert mark.reasons == ("check",)
    assert auditor.metrics.checks_run == 1
    result = await ReplicationWorker(bk, urm, config, worker_id="w").heal(mark)
    assert result.resolved
    await verify_every_replica(bk, handle.id, PASSWORD, payloads, absent=[empty])
    assert await auditor.check_all() == []
