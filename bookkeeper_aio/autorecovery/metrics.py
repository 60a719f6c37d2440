"""Autorecovery metrics: plain counters in the daemon, published to metadata for
``bkaio autorecovery status`` and exposed to Prometheus (``--metrics-port``).

Names carry their unit and the ``bookkeeper_autorecovery_`` prefix. Counters only grow;
``under_replicated_ledgers`` is a gauge (the marks counted at the last status publication).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(slots=True)
class AutorecoveryMetrics:
    under_replicated_ledgers: int = 0
    ledgers_marked: int = 0
    """Marks written by this daemon's auditor (lost bookies and the periodic check)."""
    ledgers_healed: int = 0
    """Marks this daemon's workers resolved (every missing bookie replaced)."""
    fragments_healed: int = 0
    entries_copied: int = 0
    bytes_copied: int = 0
    heal_failures: int = 0
    locks_lost: int = 0
    """Heals stopped because the worker's lock was gone before its commit (a pause past the lease)."""
    ledgers_fenced: int = 0
    """Open ledgers fenced and recovered after the grace period."""
    heal_seconds_sum: float = 0.0
    heal_seconds_max: float = 0.0
    heal_seconds_last: float = 0.0
    """Time to heal: from a ledger's first mark to its resolution (wall clock)."""
    checks_run: int = 0
    is_auditor: bool = False

    def healed(self, seconds: float) -> None:
        self.ledgers_healed += 1
        self.heal_seconds_sum += seconds
        self.heal_seconds_max = max(self.heal_seconds_max, seconds)
        self.heal_seconds_last = seconds

    def snapshot(self) -> dict[str, float | int | bool]:
        return asdict(self)


class AutorecoveryCollector(Collector):
    """Reads an :class:`AutorecoveryMetrics` at scrape time."""

    def __init__(self, metrics: AutorecoveryMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        prefix = "bookkeeper_autorecovery_"
        yield GaugeMetricFamily(
            f"{prefix}under_replicated_ledgers", "ledgers marked", m.under_replicated_ledgers
        )
        yield GaugeMetricFamily(f"{prefix}auditor", "1 while this daemon is the auditor", int(m.is_auditor))
        for name, value, text in (
            ("ledgers_marked", m.ledgers_marked, "ledgers marked by this daemon's auditor"),
            ("ledgers_healed", m.ledgers_healed, "marks resolved by this daemon's workers"),
            ("fragments_healed", m.fragments_healed, "fragments re-replicated"),
            ("entries_copied", m.entries_copied, "entries written to replacement bookies"),
            ("copied_bytes", m.bytes_copied, "entry bytes written to replacement bookies"),
            ("heal_failures", m.heal_failures, "healing attempts that failed (retried later)"),
            ("locks_lost", m.locks_lost, "heals refused at commit: the worker's lock was gone"),
            ("ledgers_fenced", m.ledgers_fenced, "open ledgers fenced after the grace period"),
            ("checks", m.checks_run, "periodic checks of every ledger completed"),
            ("heal_seconds", m.heal_seconds_sum, "sum of times from first mark to healed"),
        ):
            yield CounterMetricFamily(f"{prefix}{name}", text, value=value)
