"""Review fixtures: reuse the recovery world (fake bookies + in-memory metadata)."""

from tests.unit.recovery.conftest import cluster, world

__all__ = ["cluster", "world"]
