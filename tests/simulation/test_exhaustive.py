"""Exhaustive mode (tests/simulation/exhaustive.py): small bounded instances walked whole."""

from __future__ import annotations

import pytest

from tests.simulation.exhaustive import Search, explore, explore_one


@pytest.mark.parametrize(
    ("lost", "deviations"),
    [
        pytest.param(None, 1, id="no-fault"),
        pytest.param("b1", 1, id="lost-fence"),
        pytest.param(None, 2, id="no-fault-2", marks=pytest.mark.slow),  # ~13 s
        pytest.param("b0", 2, id="lost-fence-2", marks=pytest.mark.slow),
    ],
)
def test_every_schedule_within_the_bound_holds_every_invariant(lost: str | None, deviations: int) -> None:
    report = explore(1, lost=lost, deviations_max=deviations, runs_max=2_000)
    assert not report.problems, (report.choices, report.problems)
    assert report.complete, report.summary()
    assert report.states > 50
    assert report.complete_runs >= 2
    assert report.cuts > 0  # the state hashing did prune


def test_a_choice_sequence_replays_exactly() -> None:
    """The search re-executes runs from their choices: the same choices, the same trace."""
    first, explorer = explore_one(Search(), [0, 1, 0, 1], 1, (), None, 10)
    second, _ = explore_one(Search(), [0, 1, 0, 1], 1, (), None, 10)
    assert first.trace == second.trace
    assert not first.cut
    assert [choice for choice, _ in explorer.taken][:4] == [0, 1, 0, 1]
