"""Plain counters for the bookie's metrics: what the hot paths touch instead of a metrics library.

Rules (docs/internals.md §6: CPU per entry is the limit):

- Nothing here is called per entry. A histogram is observed once per journal group (fsync latency,
  records per group); per-request counts are a ``+= 1`` on an attribute of an object that already
  exists (the processor, the server).
- No locks. A histogram is written by one thread (the journal writer thread or the loop) and read at
  scrape time by the loop; under the GIL a reader may see one observation half-applied (a bucket
  bumped, the sum not yet): :meth:`BucketHistogram.snapshot` derives the count from the buckets so
  the exposition stays self-consistent, the sum may lag by one observation.
- Pure: no asyncio, no prometheus_client (``bookie.metrics`` turns these into metric families).
"""

from __future__ import annotations

from bisect import bisect_left

FSYNC_SECONDS_BOUNDS: tuple[float, ...] = (
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
)
"""fdatasync latency buckets: ~0.2 ms is a healthy local SSD (docs/internals.md §6), seconds a sick disk."""

GROUP_RECORDS_BOUNDS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
"""Records per group commit: 1 at idle, hundreds at peak (adaptive grouping)."""


class BucketHistogram:
    """Fixed buckets (upper bounds, inclusive, like Prometheus ``le``), a count per bucket and a sum.

    ``observe`` is a bisect and three additions; one writer thread only (see the module rules).
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(set(bounds)), "bounds must be strictly increasing"
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> tuple[list[int], float]:
        """Cumulative counts per bound (the last is +Inf, i.e. the total count) and the sum."""
        cumulative: list[int] = []
        running = 0
        for count in list(self.counts):
            running += count
            cumulative.append(running)
        return cumulative, self.sum
