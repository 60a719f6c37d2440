"""Where fault runs leave their figures: one JSON line per scenario in ``$FAULT_FIGURES`` (unset:
nowhere). docs/reliability.md is made from such a file (`make chaos FAULT_FIGURES=...`)."""

from __future__ import annotations

import json
import os

from tests.faults.history import History


def record(scenario: str, history: History, **extra: object) -> dict[str, object]:
    """The history's figures with ``extra`` (cycles, seed, ...), appended to ``$FAULT_FIGURES``."""
    row: dict[str, object] = {"scenario": scenario, **extra, **history.figures()}
    path = os.environ.get("FAULT_FIGURES")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
    return row
