"""Log writers fighting for the leadership of one log while the nemesis runs (tests/faults/logs.py).

`make test` runs them together with ledger writers under one nemesis
(tests/faults/test_nemesis.py::test_ledgers_and_logs_under_one_nemesis). `make chaos` runs them here
alone, for FAULT_CYCLES cycles of log writer kill -9, log writer SIGSTOP, bookie kill -9, bookie
SIGSTOP and partitions in turn (in a seeded order), then heals and checks as `LogFight.finish` says.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tests.faults.cluster import FaultCluster, fault_cycles
from tests.faults.logs import LogFight
from tests.faults.nemesis import kill_restart, partition, pause_resume

pytestmark = pytest.mark.etcd


@pytest.mark.slow
async def test_chaos_log_writers(faults: FaultCluster, tmp_path: Path) -> None:
    """`make chaos`: FAULT_CYCLES (default 200) cycles on 5 bookies, each fault kind in turn."""
    await faults.start(5)
    cycles = fault_cycles(200)
    scenario = "chaos log writers fighting (5 bookies)"
    async with LogFight(faults, tmp_path) as fight:
        rng = random.Random(fight.seed)
        kinds = [fight.kill_writer, fight.pause_writer, kill_restart, pause_resume, partition]
        schedule = [kinds[i % len(kinds)] for i in range(cycles)]
        rng.shuffle(schedule)
        await asyncio.sleep(0.5)
        for cycle in schedule:
            await cycle(faults, rng)
            await asyncio.sleep(rng.uniform(0.1, 0.4))
        await fight.stop()
        await faults.heal()
        problems = await fight.finish(scenario, cycles)
    if problems:
        pytest.fail("\n".join(problems))
