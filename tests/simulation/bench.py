"""Simulator throughput in one process: ``python -m tests.simulation.bench GENERAL [RACE [AUTORECOVERY]]``
runs that many seeds of each profile (from seed 0) and prints, per profile and in all, the simulated
seconds, the CPU seconds inside the seeds (``Outcome.cpu_s``) and their ratio; ``--hashes FILE``
writes a digest of every seed's trace (compare two trees' files: a speed-up must not change one).
Run the tree before and after alternately, several times, and take medians (docs/internals.md)."""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from tests.simulation.autorecovery import AutorecoveryScenario
from tests.simulation.race import RaceScenario
from tests.simulation.scenario import Scenario, run_seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("counts", type=int, nargs="+", help="seeds of the general, race, autorecovery runs")
    parser.add_argument("--hashes", default="", help="write each seed's trace digest to this JSON file")
    args = parser.parse_args(argv)
    counts = [*args.counts, 0, 0][:3]
    hashes: dict[str, str] = {}
    total_sim = total_cpu = 0.0
    seeds = 0
    wall_start = time.perf_counter()
    for profile, count in zip((Scenario, RaceScenario, AutorecoveryScenario), counts, strict=True):
        sim = cpu = 0.0
        for seed in range(count):
            outcome = run_seed(seed, profile=profile)
            sim += outcome.simulated_s
            cpu += outcome.cpu_s
            digest = hashlib.sha256(outcome.trace.encode()).hexdigest()[:16]
            hashes[f"{profile.__name__}/{seed}"] = digest + ("!" if outcome.problems else "")
        if count:
            name = profile.__name__
            print(f"{name:22s} seeds={count} sim={sim:.1f}s cpu={cpu:.2f}s ratio={sim / cpu:.1f}x")
            total_sim, total_cpu, seeds = total_sim + sim, total_cpu + cpu, seeds + count
    if seeds:
        wall_s = time.perf_counter() - wall_start
        print(
            f"all seeds={seeds} sim={total_sim:.1f}s cpu={total_cpu:.2f}s ratio={total_sim / total_cpu:.1f}x "
            f"seeds/cpu-min={60 * seeds / total_cpu:.0f} wall={wall_s:.1f}s"
        )
    if args.hashes:
        with open(args.hashes, "w") as out:
            json.dump(hashes, out, indent=0, sort_keys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
