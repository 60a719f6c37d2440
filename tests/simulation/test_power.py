"""Power: each planted bug (a ``bug.*`` failpoint switch) is found within a few seeds.

The same seeds run clean with the real code (test_seeds.py sweeps them), so what finds the planted
bug is the bug, not noise. The seeds are tried in order; the first that reports a problem ends the
search, and it must report the kind of problem the bug causes.
"""

from __future__ import annotations

import pytest

from bookkeeper_aio.common import failpoints
from tests.simulation.scenario import run_seed

PLANTED = [
    # A bookie that acks before fdatasync loses acked entries in a crash: fewer than Qa copies.
    pytest.param(
        failpoints.BUG_ACK_BEFORE_SYNC, 20, "AllCommittedEntriesReachAckQuorum", id="ack-before-fdatasync"
    ),
]


@pytest.mark.parametrize(("bug", "seeds_max", "expected"), PLANTED)
def test_a_planted_bug_is_found_within_a_few_seeds(
    bug: str, seeds_max: int, expected: str, replaying: bool
) -> None:
    if replaying:
        pytest.skip("replaying one seed")
    for seed in range(seeds_max):
        outcome = run_seed(seed, (bug,))
        if outcome.problems:
            break
    else:
        pytest.fail(f"{bug} was not found in {seeds_max} seeds")
    assert any(expected in problem for problem in outcome.problems), outcome.problems
