"""Faults on real bookie processes, checked by a history (tests/faults/history.py).

Each bookie runs as its own process behind its own fault proxy (tests/faults/proxy.py): clients
reach it only through the proxy, whose address is what the bookie's registration says
(tests/faults/cluster.py). `make test` runs 20 kill -9, 10 SIGSTOP and 5 partition cycles in one
scenario on the package's shared cluster, overlapped in 3 lanes, with log writers fighting for a
log meanwhile (tests/faults/logs.py), and an etcd member loss on a 3-member etcd; the slow set
(`make chaos`) runs each nemesis for many cycles, and the etcd quorum loss. Writer tasks
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
from collections.abc import Sequence
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper
from tests.faults import figures
from tests.faults.cluster import (
    CONFIG,
    FaultCluster,
    Workload,
    abandon_writers,
    fault_cycles,
    fault_seed,
    recover_and_read,
    stop_writers,
)
from tests.faults.conftest import ON_SHARED
from tests.faults.history import History
from tests.faults.logs import LogFight
from tests.faults.nemesis import (
    Nemesis,
    etcd_member_loss,
    etcd_quorum_loss,
    kill_restart,
    partition,
    pause_resume,
)

pytestmark = pytest.mark.etcd

SHAPES = [(3, 2, 2), (3, 3, 2)]
STRIPED = (5, 3, 2)


async def _phase(
    cluster: FaultCluster,
    scenario: str,
    shapes: list[tuple[int, int, int]],
    nemesis: Nemesis | Sequence[Nemesis],
    cycles: int,
    tmp_path: Path,
    roll_every: int = 0,
    log: LogFight | None = None,
    lanes: int = 1,
) -> History:
    """One scenario on a started cluster: writers, ``cycles`` nemesis cycles, heal, recover, read
    back, check. The cluster is healed afterwards, so the next scenario can share it. Several
    nemeses: cycle i is the (i mod n)-th, the cycles in a seeded order. ``log``: log writers fight for
    a log meanwhile (its nemeses may be among ``nemesis``), checked after the heal too. ``lanes``:
    that many cycles run at once (each on a bookie of its own, `FaultCluster.claimed`)."""
    seed = fault_seed()
    rng = random.Random(seed)
    kinds = [nemesis] if callable(nemesis) else list(nemesis)
    schedule = [kinds[i % len(kinds)] for i in range(cycles)]
    if len(kinds) > 1:
        rng.shuffle(schedule)
    history = History()
    stop = asyncio.Event()
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk:
        workload = Workload(bk, history, shapes, stop, [], roll_every)
        writers = [asyncio.create_task(workload.writer(f"w{i}", random.Random(seed + i))) for i in range(3)]
        try:
            await asyncio.sleep(0.3)

            async def lane() -> None:
                while schedule:
                    await schedule.pop(0)(cluster, rng)
                    await asyncio.sleep(rng.uniform(0.05, 0.3))

            await asyncio.gather(*(lane() for _ in range(lanes)))
        except BaseException:
            abandon_writers(stop, writers)
            raise
        await stop_writers(stop, writers)
        if log is not None:
            await log.stop()
        await cluster.heal()
        await recover_and_read(cluster, history, workload.ledgers)
        log_problems = [] if log is None else await log.finish(f"{scenario}: the log", cycles)
    problems = history.check()
    row = figures.record(scenario, history, cycles=cycles, seed=seed, ledgers=len(workload.ledgers))
    if problems or log_problems:
        os.makedirs(tmp_path, exist_ok=True)
        history.dump(tmp_path / "history.jsonl")
        replay = f"FAULT_SEED={seed} pytest {os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}"
        where = f"history kept in {tmp_path}, data dirs and logs in {cluster.base}"
        ledgers = f"{scenario}: {len(problems)} violations (seed {seed}; {where}; replay: {replay}):"
        pytest.fail("\n".join([ledgers, *problems, *log_problems]))
    assert row["ok"], row  # the workload made progress through the faults
    return history


LANES = 3
"""`make test`'s nemesis runs 3 cycles at once, at most 2 of them on bookies (of the shared 5): the
cycles overlap, the run takes a third of their time."""


@ON_SHARED
async def test_ledgers_and_logs_under_one_nemesis(shared: FaultCluster, tmp_path: Path) -> None:
    """`make test`'s run on the shared 5 bookies: ledger writer tasks, and three log writer processes
    fighting for one log (tests/faults/logs.py), under one seeded nemesis of 20 bookie kill -9,
    10 bookie SIGSTOP, 5 partition, 2 log writer kill -9 and 2 log writer SIGSTOP cycles, in 3
    parallel lanes. Both histories are checked. More cycles of each are `make chaos`'s (the slow
    tests below, and tests/faults/test_logs.py)."""
    async with LogFight(shared, tmp_path / "log") as fight:
        kinds: list[Nemesis] = [*[kill_restart] * 20, *[pause_resume] * 10, *[partition] * 5]
        kinds += [fight.kill_writer, fight.pause_writer] * 2
        history = await _phase(
            shared,
            "kill -9 + SIGSTOP + partition + log writers",
            SHAPES,
            kinds,
            len(kinds),
            tmp_path / "ledgers",
            log=fight,
            lanes=LANES,
        )
    assert history.counts()["ok"] > 500, history.counts()


async def test_etcd_member_loss(faults3: FaultCluster, tmp_path: Path) -> None:
    """A 3-member etcd under write load (writers roll to a new ledger every 100 appends, so
    creates, closes and ensemble changes hit the metadata): one member killed with SIGKILL, and a
    bookie with it. Writes go on or fail typed, nothing acked is lost. (The quorum loss is
    `make chaos`'s: test_chaos_etcd.)"""
    await faults3.start(4)
    await _phase(faults3, "etcd member loss", SHAPES, etcd_member_loss, fault_cycles(1), tmp_path, 100)


@pytest.mark.slow
async def test_kill_pause_partition_one_after_the_other(faults: FaultCluster, tmp_path: Path) -> None:
    """What `make test` ran before it had to be quick: on 4 bookies, 20 kill -9, then 10 SIGSTOP,
    then 5 partition cycles (FAULT_CYCLES kill -9, half as many SIGSTOP, a quarter partitions),
    each scenario's history checked on its own."""
    await faults.start(4)
    cycles = fault_cycles(20)
    kills = await _phase(faults, "kill -9 (4 bookies)", SHAPES, kill_restart, cycles, tmp_path / "kill")
    assert kills.counts()["ok"] > 500, kills.counts()
    await _phase(faults, "SIGSTOP (4 bookies)", SHAPES, pause_resume, max(1, cycles // 2), tmp_path / "pause")
    await _phase(
        faults, "partition (4 bookies)", SHAPES, partition, max(1, cycles // 4), tmp_path / "partition"
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
