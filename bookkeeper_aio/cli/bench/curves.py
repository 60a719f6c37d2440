"""``bkaio bench curves``: what write throughput costs, as curves, in one run on one cluster.

Three sweeps of closed-loop writes (``-E/-W/-A``, ``--duration`` and ``--warmup`` per point), each
point through the same client processes and load loop as ``bench write``
(:func:`bookkeeper_aio.cli.bench.writes.run_ours`):

- **entry size** (``--sizes``, default 100 B .. 1 MiB): one client, one ledger; the window is
  ``--window`` but at most :data:`BYTES_IN_FLIGHT_MAX` of payload (1 MiB entries: 64 in flight);
- **open ledgers** (``--ledger-counts``, default 1 .. 10,000): one client, ``--size`` entries,
  the adds spread round robin over that many ledgers, the window ``max(--window, ledgers)`` (each
  ledger keeps one add in flight at least). 100,000 ledgers take about a minute to create (an
  etcd create each; the key derivation is paid once per client and password since key format 3)
  and as long to delete, so they are not in the default sweep;
- **journal size**: one run of ``--journal-s`` seconds at ``--size``, one ledger; its throughput
  over time, against the journal each bookie had written by then: the bookies' own count
  (``bookie_journal_written_bytes_total`` on their ``/metrics``) before and after the run, spread
  over the timeline as the entries were acknowledged (the sweeps before it wrote to the same
  journals: its first point is where they left it).

Every point is also given as a ratio to the first point of its sweep: on a shared machine the
absolute numbers drift, the shape of a curve taken in one run less so. ``--reps`` repeats the two
point sweeps (in reverse order every other rep, so neither end always runs first) and reports
medians. Plotted to ``curves.png``; the points are in ``result.json`` (``curves``).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from bookkeeper_aio.cli.bench import bookies
from bookkeeper_aio.cli.bench.live import LiveLine
from bookkeeper_aio.cli.bench.options import BenchOptions
from bookkeeper_aio.cli.bench.report import Report, Run
from bookkeeper_aio.cli.bench.writes import run_ours

BYTES_IN_FLIGHT_MAX = 64 * 1024 * 1024
"""Payload in flight per client at most (a window of 1,000 entries of 1 MiB would be 1 GiB)."""
RECORD_OVERHEAD_BYTES = 60
"""Journal record header + entry header per entry (roughly: the estimate of the journal curve)."""


def window_for(opts: BenchOptions, size: int, ledgers: int) -> int:
    return max(ledgers, min(opts.window, max(1, BYTES_IN_FLIGHT_MAX // size)))


async def run_curves(opts: BenchOptions, url: str, report: Report, live: LiveLine) -> None:
    endpoints = await bookies.discover(url)
    report.cluster = {"metadata_url": url, "bookies": [e.bookie_id for e in endpoints]}
    if len(endpoints) < opts.ensemble:
        report.notes.append(f"only {len(endpoints)} bookies registered for an ensemble of {opts.ensemble}")
    sizes: dict[int, list[Run]] = {size: [] for size in opts.sizes}
    counts: dict[int, list[Run]] = {count: [] for count in opts.ledger_counts}
    for rep in range(opts.reps):
        order = 1 if rep % 2 == 0 else -1
        for size in list(opts.sizes)[::order]:
            point = dataclasses.replace(
                opts, size=size, clients=1, ledgers=1, window=window_for(opts, size, 1)
            )
            sizes[size].append(await _point(point, url, rep, live, f"size {size} B", report))
        for count in list(opts.ledger_counts)[::order]:
            point = dataclasses.replace(
                opts, clients=1, ledgers=count, window=window_for(opts, opts.size, count)
            )
            counts[count].append(await _point(point, url, rep, live, f"ledgers {count}", report))
    report.curves["entry_size"] = _curve("entry size (bytes)", sizes, size_of=lambda x: x)
    report.curves["open_ledgers"] = _curve("open ledgers", counts, size_of=lambda _: opts.size)
    report.curves["journal_size"] = await _journal_curve(opts, url, live, report, len(endpoints))
    report.notes.append(
        "curves: each point's ratio is to the first point of its sweep, in the same run; the "
        f"window is at most {BYTES_IN_FLIGHT_MAX >> 20} MiB of payload and at least one add per ledger"
    )


async def _point(opts: BenchOptions, url: str, rep: int, live: LiveLine, name: str, report: Report) -> Run:
    live.show(f"{name}, rep {rep} ...")
    run = await run_ours(opts, url, rep, live)
    run.system = name
    run.timeline = None  # throughput.png shows the journal run's timeline only
    run.metrics["size"] = opts.size
    run.metrics["window"] = opts.window
    run.metrics["mib_per_s"] = round(run.metrics["entries_per_s"] * opts.size / 2**20, 2)
    report.add(run)
    return run


def _curve(x_label: str, points: dict[int, list[Run]], size_of: Any) -> dict[str, Any]:
    rows = []
    for x, runs in points.items():
        rate = statistics.median(run.metrics["entries_per_s"] for run in runs)
        rows.append(
            {
                "x": x,
                "entries_per_s": round(rate, 1),
                "mib_per_s": round(rate * size_of(x) / 2**20, 2),
                "p50_ms": statistics.median(run.metrics["p50_ms"] for run in runs),
                "p99_ms": statistics.median(run.metrics["p99_ms"] for run in runs),
                "client_cpu_us_per_entry": _median(r.metrics.get("client_cpu_us_per_entry") for r in runs),
                "bookies_cpu_us_per_entry": _median(r.metrics.get("bookies_cpu_us_per_entry") for r in runs),
                "reps": len(runs),
            }
        )
    first = rows[0]["entries_per_s"] if rows else 0
    for row in rows:
        row["ratio_to_first"] = round(row["entries_per_s"] / first, 3) if first else None
    return {"x_label": x_label, "points": rows}


def _median(values: Any) -> float | None:
    present = [v for v in values if isinstance(v, int | float)]
    return round(statistics.median(present), 2) if present else None


async def _journal_curve(
    opts: BenchOptions, url: str, live: LiveLine, report: Report, bookie_count: int
) -> dict[str, Any]:
    """One long run; its timeline against the journal bytes per bookie written by then."""
    endpoints = await bookies.discover(url)
    before = await bookies.sample(endpoints)
    journal_start = _journal_bytes(before) / max(1, len(endpoints))
    point = dataclasses.replace(
        opts,
        clients=1,
        ledgers=1,
        window=window_for(opts, opts.size, 1),
        duration_s=opts.journal_s,
    )
    live.show(f"journal curve: {opts.journal_s:.0f} s ...")
    run = await run_ours(point, url, 0, live)
    run.system = "journal run"
    report.add(run)
    assert run.timeline is not None
    after = await bookies.sample(endpoints)
    interval = run.timeline_interval_s
    per_entry = (opts.size + RECORD_OVERHEAD_BYTES) * opts.write_quorum / max(1, bookie_count)
    # the warm-up's entries are in the journal too (estimated at the measured span's first rate)
    warmup = (run.timeline[0] if run.timeline else 0) * opts.warmup_s * per_entry
    estimated = [rate * interval * per_entry for rate in run.timeline]
    # the bookies' own count over the run, spread over the timeline as the entries were
    real = (_journal_bytes(after) - _journal_bytes(before)) / max(1, len(endpoints))
    scale = real / (warmup + sum(estimated)) if real > 0 and warmup + sum(estimated) > 0 else 1.0
    written = journal_start + warmup * scale
    rows: list[dict[str, Any]] = []
    for rate, grown in zip(run.timeline, estimated, strict=True):
        written += grown * scale
        rows.append({"x": round(written / 2**30, 4), "entries_per_s": rate})
    first = statistics.mean(r["entries_per_s"] for r in rows[: max(1, len(rows) // 10)]) if rows else 0
    for row in rows:
        row["ratio_to_first"] = round(row["entries_per_s"] / first, 3) if first else None
    return {
        "x_label": "journal written per bookie (GiB)"
        if scale != 1.0
        else "journal per bookie (GiB, estimated)",
        "points": rows,
        "journal_start_gib": round(journal_start / 2**30, 4),
    }


def _journal_bytes(samples: dict[str, bookies.BookieSample]) -> float:
    """The bookies' journal bytes written so far (their ``/metrics``; 0 where unknown)."""
    return sum(sample.metrics.get("bookie_journal_written_bytes_total", 0.0) for sample in samples.values())
