"""The profiles with bookie GC on (tests/simulation/gc_sweep.py): a few seeds in every run, chosen
for what GC did in them, the determinism check, and the sweep (``make simulate-gc``)."""

from __future__ import annotations

import os

import pytest

from tests.simulation.gc_sweep import GC_PROFILES
from tests.simulation.scenario import run_seed

SEEDS: dict[tuple[str, int], str] = {
    ("general", 2): "collects a deleted ledger",
    ("race", 3): "collects an orphan (a copy no metadata lists)",
    ("race", 207): (
        "a fresh journal whose first fdatasync failed lost its segment header at a later power cut, "
        "and the bookie refused to start (JournalCorrupt: the header zero under the checkpoint; "
        "bookie/replay.py _make_durable)"
    ),
    ("race", 1020): (
        "a rotten record's entry written back by a recovery, its segment compacted and deleted: the "
        "entry's new copy at the same offset of a later segment was taken for the rotten one "
        "(tests/simulation/invariants.py rot_problems compared offsets, not segments)"
    ),
    ("autorecovery", 1): "collects a copy autorecovery moved elsewhere (over-replicated)",
}
"""Seeds of the GC profiles (each pinned for what it does): they must hold every invariant."""

COLLECTED = ("gc.ledgers_collected", "gc.over_replicated_collected", "gc.orphan_collected")


@pytest.mark.parametrize(("profile", "seed"), sorted(SEEDS))
def test_gc_seed_holds_every_invariant(profile: str, seed: int) -> None:
    outcome = run_seed(seed, profile=GC_PROFILES[profile])
    assert not outcome.problems, f"{SEEDS[profile, seed]}: {outcome.problems[:5]}"
    trace = outcome.trace
    assert "bookie_gc=on" in trace
    assert "gc.finished" in trace
    # GC judged against metadata (no refusal: the cluster the COOKIEs name is the world's)
    assert "ForeignCluster" not in trace
    assert "no cluster" not in trace
    if (profile, seed) not in (("race", 207), ("race", 1020)):
        assert any(f"{event} " in trace for event in COLLECTED), f"seed {seed} collected nothing"


def test_gc_seeds_replay_the_same_trace() -> None:
    for profile in sorted(GC_PROFILES):
        first, second = run_seed(0, profile=GC_PROFILES[profile]), run_seed(0, profile=GC_PROFILES[profile])
        assert first.trace == second.trace, f"seed 0 of {profile} with GC is not deterministic"


SWEEP_SEEDS = int(os.environ.get("SIM_GC_SEEDS", "0"))
SWEEP_FIRST = int(os.environ.get("SIM_GC_FIRST", "0"))


@pytest.mark.skipif(not SWEEP_SEEDS, reason="the sweep runs with SIM_GC_SEEDS=N (make simulate-gc)")
@pytest.mark.parametrize("profile", sorted(GC_PROFILES))
def test_gc_sweep(profile: str, capsys: pytest.CaptureFixture[str]) -> None:
    """SIM_GC_SEEDS seeds of ``profile`` with GC on, from SIM_GC_FIRST; one seed prints its trace."""
    failures = []
    for seed in range(SWEEP_FIRST, SWEEP_FIRST + SWEEP_SEEDS):
        outcome = run_seed(seed, profile=GC_PROFILES[profile])
        if SWEEP_SEEDS == 1:
            with capsys.disabled():
                print(f"\n{outcome.trace}")
        if outcome.problems:
            shown = "\n    ".join(outcome.problems[:10])
            test = f"tests/simulation/test_gc_seeds.py::test_gc_sweep[{profile}]"
            replay = f"SIM_GC_SEEDS=1 SIM_GC_FIRST={seed} pytest '{test}'"
            failures.append(f"seed {seed} ({replay}):\n    {shown}")
    assert not failures, "\n".join(failures)
