"""Every safety mutant (`make mutants`, tests/faults/mutants.py) still finds its line exactly once:
code that moved would otherwise surface only when someone runs the mutants."""

from __future__ import annotations

import pytest

from tests.faults.mutants import MUTANTS, REPO, Mutant


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda mutant: mutant.name)
def test_the_mutants_line_is_in_its_file_once(mutant: Mutant) -> None:
    text = (REPO / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.path}: update the line of mutant {mutant.name}"
