"""Faults on real bookie processes, checked by a history (tests/faults/history.py).

Each bookie runs as its own process behind its own fault proxy (tests/faults/proxy.py): clients
reach it only through the proxy, whose address is what the bookie's registration says
(tests/faults/cluster.py). `make test` runs the kill -9, SIGSTOP and partition scenarios one after
the other on one cluster, and the etcd member/quorum loss on a 3-member etcd. Writer tasks
pipeline unique values into E3/Qw2/Qa2, E3/Qw3/Qa2 and (with 6 bookies) striped E5/Qw3/Qa2 ledgers,
starting a new ledger whenever one fails. A seeded nemesis meanwhile kills bookies with SIGKILL and
restarts them (same data dir and port), pauses them (SIGSTOP/SIGCONT), or partitions them at the
proxy (both directions, or answers only). Then everything heals, every ledger is recovered by three
racing recoverers and read back by three independent clients, and the history is checked: no acked
add lost, readers agree, no phantom, recoverers agree, LACs monotonic.

``FAULT_CYCLES`` scales the number of nemesis cycles (`make chaos` runs many); ``FAULT_SEED`` picks
the schedule. On a violation the test keeps the history next to the bookies' data dirs and logs and
prints how to replay the seed.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper
from tests.faults import figures
from tests.faults.cluster import (
    CONFIG,
    FaultCluster,
    Workload,
    fault_cycles,
    fault_seed,
    recover_and_read,
    stop_writers,
)
from tests.faults.history import History
from tests.faults.proxy import Mode

pytestmark = pytest.mark.etcd

SHAPES = [(3, 2, 2), (3, 3, 2)]
STRIPED = (5, 3, 2)


Nemesis = Callable[[FaultCluster, random.Random], Awaitable[None]]


async def kill_restart(cluster: FaultCluster, rng: random.Random) -> None:
    index = rng.randrange(len(cluster.bookies))
    await cluster.kill(index)
    await asyncio.sleep(rng.uniform(0.05, 0.4))
    await cluster.restart(index)


async def pause_resume(cluster: FaultCluster, rng: random.Random) -> None:
    bookie = rng.choice(cluster.bookies)
    bookie.pause()
    await asyncio.sleep(rng.uniform(0.3, 2.0))  # across the add timeout too, sometimes
    bookie.resume()


async def partition(cluster: FaultCluster, rng: random.Random) -> None:
    proxy = rng.choice(cluster.proxies)
    proxy.set(rng.choice([Mode.BLACKHOLE, Mode.BLACKHOLE_DOWN, Mode.RESET]))
    await asyncio.sleep(rng.uniform(0.3, 2.0))
    proxy.set(Mode.PASS)


async def etcd_member_loss(cluster: FaultCluster, rng: random.Random) -> None:
    """SIGKILL one etcd member of three; while it is down a bookie is killed too (the ensemble
    change's CAS goes to the two left); then both come back."""
    assert cluster.etcd is not None
    member = rng.choice(cluster.etcd.members)
    member.kill9()
    await asyncio.sleep(rng.uniform(0.2, 1.0))
    await kill_restart(cluster, rng)
    await asyncio.sleep(rng.uniform(0.2, 1.0))
    member.start()
    await asyncio.to_thread(member.wait_ready)


async def etcd_quorum_loss(cluster: FaultCluster, rng: random.Random) -> None:
    """SIGKILL two etcd members of three (no quorum: metadata writes fail, typed), then restart them."""
    assert cluster.etcd is not None
    members = rng.sample(cluster.etcd.members, 2)
    for member in members:
        member.kill9()
    await asyncio.sleep(rng.uniform(1.0, 2.5))  # below the registrations' 5 s lease
    for member in members:
        member.start()
    await asyncio.gather(*(asyncio.to_thread(member.wait_ready) for member in members))


async def _phase(
    cluster: FaultCluster,
    scenario: str,
    shapes: list[tuple[int, int, int]],
    nemesis: Nemesis,
    cycles: int,
    tmp_path: Path,
    roll_every: int = 0,
) -> History:
    """One scenario on a started cluster: writers, ``cycles`` nemesis cycles, heal, recover, read
    back, check. The cluster is healed afterwards, so the next scenario can share it."""
    seed = fault_seed()
    rng = random.Random(seed)
    history = History()
    stop = asyncio.Event()
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk:
        workload = Workload(bk, history, shapes, stop, [], roll_every)
        writers = [asyncio.create_task(workload.writer(f"w{i}", random.Random(seed + i))) for i in range(3)]
        await asyncio.sleep(0.3)
        for _ in range(cycles):
            await nemesis(cluster, rng)
            await asyncio.sleep(rng.uniform(0.05, 0.3))
        await stop_writers(stop, writers)
        await cluster.heal()
        await recover_and_read(cluster, history, workload.ledgers)
    problems = history.check()
    row = figures.record(scenario, history, cycles=cycles, seed=seed, ledgers=len(workload.ledgers))
    if problems:
        os.makedirs(tmp_path, exist_ok=True)
        history.dump(tmp_path / "history.jsonl")
        pytest.fail(
            f"{scenario}: {len(problems)} violations (seed {seed}; history, data dirs and logs kept in "
            f"{tmp_path}; replay: FAULT_SEED={seed} "
            f"pytest {os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}):\n" + "\n".join(problems)
        )
    assert row["ok"], row  # the workload made progress through the faults
    return history


async def test_kill_pause_partition_on_one_cluster(faults: FaultCluster, tmp_path: Path) -> None:
    """`make test`'s run: 20 kill -9, 10 SIGSTOP and 5 partition cycles, one scenario after the
    other on one cluster of 4 bookies (started once: the cycles are the cost, not the set-up), each
    scenario's history checked on its own."""
    await faults.start(4)
    kills = await _phase(faults, "kill -9", SHAPES, kill_restart, fault_cycles(20), tmp_path / "kill")
    assert kills.counts()["ok"] > 500, kills.counts()
    await _phase(faults, "SIGSTOP", SHAPES, pause_resume, fault_cycles(10), tmp_path / "pause")
    await _phase(faults, "partition", SHAPES, partition, fault_cycles(5), tmp_path / "partition")


async def test_etcd_member_and_quorum_loss(faults3: FaultCluster, tmp_path: Path) -> None:
    """A 3-member etcd under write load (writers roll to a new ledger every 100 appends, so
    creates, closes and ensemble changes hit the metadata): one member killed with SIGKILL (and a
    bookie with it), then two (quorum lost, regained). Writes go on or fail typed, nothing acked
    is lost."""
    await faults3.start(4)
    await _phase(
        faults3, "etcd member loss", SHAPES, etcd_member_loss, fault_cycles(1), tmp_path / "one", 100
    )
    await _phase(
        faults3, "etcd quorum loss", SHAPES, etcd_quorum_loss, fault_cycles(1), tmp_path / "two", 100
    )


@pytest.mark.slow
async def test_kill_9_with_striped_ledgers(faults: FaultCluster, tmp_path: Path) -> None:
    await faults.start(6)
    await _phase(faults, "kill -9 striped E5/Qw3/Qa2", [STRIPED], kill_restart, fault_cycles(20), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("nemesis", [kill_restart, pause_resume, partition])
async def test_chaos(faults: FaultCluster, tmp_path: Path, nemesis: Nemesis) -> None:
    """`make chaos`: many cycles (FAULT_CYCLES, default 200) of one nemesis, mixed shapes."""
    await faults.start(6)
    scenario = f"chaos {nemesis.__name__} (mixed shapes, 6 bookies)"
    await _phase(faults, scenario, [*SHAPES, STRIPED], nemesis, fault_cycles(200), tmp_path)


@pytest.mark.slow
async def test_chaos_etcd(faults3: FaultCluster, tmp_path: Path) -> None:
    """`make chaos`: FAULT_CYCLES etcd member losses (each with a bookie kill), then as many quorum
    losses, under the rolling writers of the default etcd scenario."""
    await faults3.start(4)
    cycles = fault_cycles(20)
    await _phase(faults3, "chaos etcd member loss", SHAPES, etcd_member_loss, cycles, tmp_path / "one", 100)
    await _phase(faults3, "chaos etcd quorum loss", SHAPES, etcd_quorum_loss, cycles, tmp_path / "two", 100)
