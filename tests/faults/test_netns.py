"""Bookies on separate hosts: each in its own network namespace with its own IP on a bridge
(bookkeeper_aio/cli/netns.py), registered and reached by its real address, not loopback. The fault is a
host's link going down and up (packets dropped both ways, no reset), plus kill -9 of a bookie; the
history is checked as in test_nemesis. Skips with the reason where `ip netns` is not permitted."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.cli.netns import NetnsHosts, NetnsUnavailable
from tests.faults import figures
from tests.faults.cluster import (
    CONFIG,
    NetnsFaultCluster,
    Workload,
    fault_cycles,
    fault_seed,
    recover_and_read,
    stop_writers,
)
from tests.faults.history import History
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd

SHAPES = [(3, 2, 2), (3, 3, 2)]
BOOKIES = 4


@pytest.fixture
async def hosts_cluster(etcd_server: EtcdCluster, tmp_path: Path) -> AsyncIterator[NetnsFaultCluster]:
    try:
        hosts = await asyncio.to_thread(NetnsHosts.create, BOOKIES)
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    root = f"/bookkeeper/netns-{uuid.uuid4().hex[:12]}"
    cluster = NetnsFaultCluster(etcd_server.url(root), root, tmp_path, hosts)
    try:
        yield cluster
    finally:
        await cluster.close()  # the bookies first: then their namespaces can go
        await asyncio.to_thread(hosts.close)


async def _run(cluster: NetnsFaultCluster, cycles: int, tmp_path: Path) -> None:
    seed = fault_seed()
    rng = random.Random(seed)
    await cluster.start(BOOKIES)
    history = History()
    stop = asyncio.Event()
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk:
        workload = Workload(bk, history, SHAPES, stop, [])
        writers = [asyncio.create_task(workload.writer(f"w{i}", random.Random(seed + i))) for i in range(3)]
        await asyncio.sleep(0.3)
        for cycle in range(cycles):
            index = rng.randrange(BOOKIES)
            if cycle % 3 == 1:
                await cluster.kill(index)
                await asyncio.sleep(rng.uniform(0.05, 0.4))
                await cluster.restart(index)
            else:
                await cluster.link_down(index)
                await asyncio.sleep(rng.uniform(0.5, 2.0))  # across the add timeout, sometimes
                await cluster.link_up(index)
            await asyncio.sleep(rng.uniform(0.05, 0.3))
        await stop_writers(stop, writers)
        await cluster.heal()
        await recover_and_read(cluster, history, workload.ledgers)
    problems = history.check()
    row = figures.record("netns: link down/up + kill -9", history, cycles=cycles, seed=seed)
    if problems:
        history.dump(tmp_path / "history.jsonl")
        pytest.fail(f"{len(problems)} violations (seed {seed}; kept in {tmp_path}):\n" + "\n".join(problems))
    assert row["ok"], row
    ensembles = {bookie for ledger in workload.ledgers for bookie in await _ensemble(cluster, ledger)}
    assert ensembles <= {f"b{i}" for i in range(BOOKIES)}


async def _ensemble(cluster: NetnsFaultCluster, ledger_id: int) -> set[str]:
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk:
        handle = await bk.open_ledger(ledger_id, password=b"f")
        return {bookie for _, ensemble in handle.metadata.ensembles for bookie in ensemble}


async def test_bookies_on_separate_hosts_link_down_and_kill(
    hosts_cluster: NetnsFaultCluster, tmp_path: Path
) -> None:
    """`make test`: one link down/up, one kill -9."""
    await _run(hosts_cluster, fault_cycles(2), tmp_path)
    for index, bookie in enumerate(hosts_cluster.bookies):
        assert bookie.address[0] == hosts_cluster.hosts.address(index)  # a real address, not loopback


@pytest.mark.slow
async def test_chaos_bookies_on_separate_hosts(hosts_cluster: NetnsFaultCluster, tmp_path: Path) -> None:
    """`make chaos`: FAULT_CYCLES cycles (default 30), two link down/up for each kill -9."""
    await _run(hosts_cluster, fault_cycles(30), tmp_path)
    for index, bookie in enumerate(hosts_cluster.bookies):
        assert bookie.address[0] == hosts_cluster.hosts.address(index)  # a real address, not loopback
