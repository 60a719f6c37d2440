"""Latency histograms (HdrHistogram, microseconds, 3 significant digits) and the numbers drawn from
them; CPU seconds of other processes from /proc (Linux), split into the event-loop thread and the
rest (a bookie's journal writer)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

try:
    from hdrh.histogram import HdrHistogram
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "bkaio bench needs the hdrhistogram package: pip install 'bookkeeper-aio[bench]'"
    ) from error

__all__ = [
    "LATENCY_US_MAX",
    "PERCENTILES",
    "HdrHistogram",
    "latency_ms",
    "median_of",
    "merge",
    "new_histogram",
    "percentile_curve",
    "rss_bytes",
    "thread_cpu_s",
]

LATENCY_US_MAX = 60_000_000
"""The histogram's range: 1 µs .. 60 s (a slower answer is clamped, and would be a failure anyway)."""
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def new_histogram() -> HdrHistogram:
    return HdrHistogram(1, LATENCY_US_MAX, 3)


def merge(encoded: Iterable[str]) -> HdrHistogram:
    """One histogram of several processes' ``encode()`` strings."""
    total = new_histogram()
    for text in encoded:
        total.add(HdrHistogram.decode(text.encode("ascii")))
    return total


def latency_ms(hist: HdrHistogram) -> dict[str, float]:
    """``{"p50": .., "p90": .., "p99": .., "p99.9": .., "max": ..}`` in milliseconds."""
    if hist.get_total_count() == 0:
        return {}
    data = {f"p{q:g}": round(hist.get_value_at_percentile(q) / 1e3, 3) for q in PERCENTILES}
    data["max"] = round(hist.get_max_value() / 1e3, 3)
    return data


def percentile_curve(hist: HdrHistogram) -> list[tuple[float, float]]:
    """(percentile, ms) points from p0 to the max on a log scale of 1 / (1 - p): for the plot."""
    points: list[tuple[float, float]] = []
    for nines in range(61):
        q = 100.0 * (1 - 10 ** (-nines / 10))
        if q > 99.9999:
            break
        points.append((q, hist.get_value_at_percentile(q) / 1e3))
    points.append((100.0, hist.get_max_value() / 1e3))
    return points


def median_of(runs: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [float(run[key]) for run in runs if run.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def thread_cpu_s(pid: int) -> tuple[float, float] | None:
    """(main thread, every other thread) CPU seconds of ``pid`` from /proc; None when not visible
    (another machine, or the process is gone)."""
    main = others = 0.0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    for task in tasks:
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        if task.name == str(pid):
            main += cpu
        else:
            others += cpu
    return main, others


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
