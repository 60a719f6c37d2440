"""Seeds for the simulation tests, and the throughput summary at the end of the run.

``pytest tests/simulation --seed N`` replays seed N alone in each sweep (and prints its traces);
``--sim-seeds K --sim-first S`` runs seeds S..S+K-1 of the general scenario (default 0..299),
``--race-seeds K`` seeds S..S+K-1 of the race profile (default 0..49), ``--autorecovery-seeds K``
those of the autorecovery profile (default 0..39), in batches of ``BATCH``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.simulation.scenario import Outcome

SEEDS_DEFAULT = 300
RACE_SEEDS_DEFAULT = 50
AUTORECOVERY_SEEDS_DEFAULT = 40
BATCH = 25


@dataclass
class Stats:
    seeds: int = 0
    simulated_s: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    acked: int = 0

    def add(self, outcome: Outcome) -> None:
        self.seeds += 1
        self.simulated_s += outcome.simulated_s
        self.wall_s += outcome.wall_s
        self.cpu_s += outcome.cpu_s
        self.acked += outcome.acked


STATS = Stats()


def replay_command(seed: int, test: str = "") -> str:
    where = f"tests/simulation/test_seeds.py::{test}" if test else "tests/simulation"
    return f"pytest {where} --seed {seed}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for name, option, default in (
        ("seed_batch", "sim_seeds", SEEDS_DEFAULT),
        ("race_batch", "race_seeds", RACE_SEEDS_DEFAULT),
        ("autorecovery_batch", "autorecovery_seeds", AUTORECOVERY_SEEDS_DEFAULT),
    ):
        if name not in metafunc.fixturenames:
            continue
        config = metafunc.config
        one = config.getoption("seed", None)
        if one is not None:
            metafunc.parametrize(name, [[one]], ids=[f"seed{one}"])
            return
        count = config.getoption(option, None) or default
        first = config.getoption("sim_first", 0) or 0
        seeds = list(range(first, first + count))
        batches = [seeds[i : i + BATCH] for i in range(0, len(seeds), BATCH)]
        metafunc.parametrize(name, batches, ids=[f"seeds{b[0]}-{b[-1]}" for b in batches])


@pytest.fixture
def replaying(request: pytest.FixtureRequest) -> bool:
    """True when one seed is replayed (``--seed``): print its trace, skip the seed sweeps."""
    return request.config.getoption("seed", None) is not None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not STATS.seeds or not STATS.wall_s:
        return
    ratio = STATS.simulated_s / STATS.wall_s
    per_minute = 60 * STATS.seeds / STATS.wall_s
    cpu_ratio = STATS.simulated_s / max(STATS.cpu_s, 1e-9)
    terminalreporter.write_line(
        f"simulation: {STATS.seeds} seeds, {STATS.simulated_s:.1f} simulated s in {STATS.wall_s:.1f} wall s "
        f"({ratio:.0f}x real time, {per_minute:.0f} seeds/min, {STATS.acked} acked adds); "
        f"{STATS.cpu_s:.1f} CPU s ({cpu_ratio:.0f}x per CPU second: the figure on an unloaded core)"
    )
