"""Client-side metrics hooks: what the client reports, and a ready-made Prometheus exporter.

    from bookkeeper_aio import BookKeeper, PrometheusClientMetrics

    async with BookKeeper.connect(url, metrics=PrometheusClientMetrics()) as bk: ...

Rules:

- :class:`ClientMetrics` is the interface: a base class whose methods do nothing. Subclass it and
  override what you want; pass an instance as ``BookKeeper(..., metrics=...)`` /
  ``BookKeeper.connect(url, metrics=...)``. Without one (the default) the client makes no call at
  all: the hot path only tests ``metrics is not None`` (measured in docs/api.md, *Metrics*).
- Hooks are called on the event loop, synchronously, from the client's completion paths: they must
  be quick and must not raise (an exception would surface in the code completing the add).
- Once per *operation*, never per bookie answer: ``add_completed`` once per add when it completes
  (Qa acks and every lower entry done), ``add_failed`` once per add that fails,
  ``ensemble_changed`` once per ensemble change stored in metadata, ``explicit_lac_sent`` once per
  WRITE_LAC (sent to the whole ensemble), ``read_completed`` /
  ``read_failed`` once per entry read (whatever the replicas and speculative retries behind it),
  ``recovery_finished`` once per successful recovery run.
- Latencies are seconds of the loop's monotonic clock, from the call that started the operation
  (``append``/``append_async``, the entry read being issued) to its completion.

:class:`PrometheusClientMetrics` keeps plain counters and fixed-bucket histograms (no
prometheus_client call on the hot path) and exposes them through a collector at scrape time, like
the bookie's metrics. Metric names carry their unit and a ``bookkeeper_client_`` prefix.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["LATENCY_SECONDS_BOUNDS", "ClientMetrics", "PrometheusClientMetrics"]


class ClientMetrics:
    """The client's metrics hooks; every method is a no-op here. Subclass and override."""

    __slots__ = ()

    def add_completed(self, latency_s: float) -> None:
        """An add completed (its future resolved with the entry id) ``latency_s`` after it started."""

    def add_failed(self, error: BaseException) -> None:
        """An add failed with ``error`` (LedgerFenced, LedgerClosed, NotEnoughBookies, ...)."""

    def ensemble_changed(self, ledger_id: int) -> None:
        """A write handle replaced failed bookies of ``ledger_id`` (the new ensemble is stored)."""

    def read_completed(self, latency_s: float) -> None:
        """One entry was read and verified ``latency_s`` after its read was issued."""

    def read_failed(self, error: BaseException) -> None:
        """Reading one entry failed with ``error`` after every replica was tried."""

    def explicit_lac_sent(self, ledger_id: int) -> None:
        """A write handle of ``ledger_id`` sent its LAC to the ensemble with WRITE_LAC (it was idle
        for its explicit-LAC interval)."""

    def recovery_finished(self, ledger_id: int, seconds: float, entries: int) -> None:
        """Recovery of ``ledger_id`` closed it (or adopted someone else's close) after ``seconds``,
        having found and written back ``entries`` entries past the fenced LAC."""


LATENCY_SECONDS_BOUNDS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds of the add and read latency histograms (100 µs to 10 s; +Inf is implicit)."""

RECOVERY_SECONDS_BOUNDS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    """Fixed buckets as plain ints (one ``bisect`` and two additions per observation)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum  # one consistent copy
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=total)


def _error_name(error: BaseException) -> str:
    return type(error).__name__


class PrometheusClientMetrics(ClientMetrics, Collector):
    """:class:`ClientMetrics` exported to Prometheus.

    Registers itself with ``registry`` (default: prometheus_client's global ``REGISTRY``, which
    ``prometheus_client.start_http_server`` serves); one instance per registry. Metrics:

    - ``bookkeeper_client_add_latency_seconds`` (histogram): completed adds.
    - ``bookkeeper_client_add_failures_total{error}``: failed adds by exception class.
    - ``bookkeeper_client_ensemble_changes_total``: ensemble changes by this client's writers.
    - ``bookkeeper_client_explicit_lacs_total``: WRITE_LACs sent by this client's writers (once per
      idle ledger, to its whole ensemble).
    - ``bookkeeper_client_read_latency_seconds`` (histogram): entries read.
    - ``bookkeeper_client_read_failures_total{error}``: entry reads that failed, by exception class.
    - ``bookkeeper_client_recovery_duration_seconds`` (histogram): successful recoveries.
    - ``bookkeeper_client_recovered_entries_total``: entries found and written back by recoveries.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        latency_bounds_s: Sequence[float] = LATENCY_SECONDS_BOUNDS,
    ) -> None:
        self._add_latency = _Histogram(latency_bounds_s)
        self._read_latency = _Histogram(latency_bounds_s)
        self._recovery_seconds = _Histogram(RECOVERY_SECONDS_BOUNDS)
        self._add_failures: dict[str, int] = {}
        self._read_failures: dict[str, int] = {}
        self._ensemble_changes = 0
        self._explicit_lacs = 0
        self._recovered_entries = 0
        self.registry = REGISTRY if registry is None else registry
        self.registry.register(self)

    # ------------------------------------------------------------------ hooks
    def add_completed(self, latency_s: float) -> None:
        self._add_latency.observe(latency_s)

    def read_completed(self, latency_s: float) -> None:
        self._read_latency.observe(latency_s)

    def add_failed(self, error: BaseException) -> None:
        name = _error_name(error)
        self._add_failures[name] = self._add_failures.get(name, 0) + 1

    def ensemble_changed(self, ledger_id: int) -> None:
        self._ensemble_changes += 1

    def explicit_lac_sent(self, ledger_id: int) -> None:
        self._explicit_lacs += 1

    def read_failed(self, error: BaseException) -> None:
        name = _error_name(error)
        self._read_failures[name] = self._read_failures.get(name, 0) + 1

    def recovery_finished(self, ledger_id: int, seconds: float, entries: int) -> None:
        self._recovery_seconds.observe(seconds)
        self._recovered_entries += entries

    def unregister(self) -> None:
        """Remove the metrics from the registry (e.g. when the client is closed for good)."""
        self.registry.unregister(self)

    # ------------------------------------------------------------------ Collector
    def describe(self) -> Iterator[Metric]:
        """The families (names) without waiting for a scrape: a second instance on the same
        registry is refused at registration."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        yield self._add_latency.family(
            "bookkeeper_client_add_latency_seconds", "Time from append to completion of an add."
        )
        yield _by_error(
            "bookkeeper_client_add_failures", "Adds that failed, by exception class.", self._add_failures
        )
        yield CounterMetricFamily(
            "bookkeeper_client_ensemble_changes",
            "Ensemble changes (failed bookies replaced) by this client's write handles.",
            value=self._ensemble_changes,
        )
        yield CounterMetricFamily(
            "bookkeeper_client_explicit_lacs",
            "WRITE_LACs sent by this client's write handles (a ledger idle for its explicit-LAC interval).",
            value=self._explicit_lacs,
        )
        yield self._read_latency.family(
            "bookkeeper_client_read_latency_seconds", "Time to read and verify one entry."
        )
        yield _by_error(
            "bookkeeper_client_read_failures",
            "Entry reads that failed on every replica, by exception class.",
            self._read_failures,
        )
        yield self._recovery_seconds.family(
            "bookkeeper_client_recovery_duration_seconds", "Duration of successful ledger recoveries."
        )
        yield CounterMetricFamily(
            "bookkeeper_client_recovered_entries",
            "Entries found past the fenced LAC and written back by recoveries.",
            value=self._recovered_entries,
        )


def _by_error(name: str, documentation: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["error"])
    for error, count in sorted(dict(counts).items()):
        family.add_metric([error], count)
    return family
