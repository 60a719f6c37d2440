"""The results folder of one ``bkaio bench`` run: ``result.json`` (everything, for scripts),
``summary.md`` (the table a person reads, with the command that made it), and PNG plots
(``latency.png``: latency by percentile, ``throughput.png``: entries/s over time, ``curves.png``:
the cost curves of ``bench curves``), drawn with
matplotlib (the ``bench`` extra; without it the plots are skipped with a note).

Runs are kept per system (``bookkeeper`` and each ``--compare`` peer) and rep; the summary gives
the median of each number over the reps, and the ratios ours / peer of those medians and, because
a shared machine drifts, the median of the per-rep ratios (each pair ran back to back).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hdrh.histogram import HdrHistogram

from bookkeeper_aio.cli.bench.options import BenchOptions
from bookkeeper_aio.cli.bench.stats import new_histogram, percentile_curve

OURS = "bookkeeper"
OURS_METADATA = "bookkeeper-metadata"
RATIO_KEYS = ("entries_per_s", "ops_per_s", "p50_ms", "p99_ms")
"""The numbers compared ours / peer (higher is better for the rates, lower for the latencies)."""
BASELINE_OF = {"etcd": OURS_METADATA}
"""Which of ours each peer is compared with (default: :data:`OURS`)."""


@dataclass
class Run:
    system: str
    rep: int
    metrics: dict[str, Any]
    histogram: HdrHistogram | None = None
    timeline: list[float] | None = None
    timeline_interval_s: float = 0.5


@dataclass
class Report:
    options: BenchOptions
    command: str
    cluster: dict[str, Any] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    curves: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``bench curves``: name -> ``{"x_label", "points": [{"x", "entries_per_s", ...}]}``."""
    started: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    )
    loadavg_start: tuple[float, ...] = field(default_factory=os.getloadavg)

    def add(self, run: Run) -> None:
        _peak_covers_end(run.metrics)
        for client in run.metrics.get("clients") or []:
            if isinstance(client, dict):
                _peak_covers_end(client, "rss_peak_mib", "rss_end_mib")
        self.runs.append(run)

    def failures(self) -> list[dict[str, Any]]:
        """The runs in which adds failed (or stopped on an error): system, rep, count, first error."""
        found = []
        for run in self.runs:
            failed, first = run.metrics.get("failed") or 0, run.metrics.get("first_error")
            if failed or first:
                found.append({"system": run.system, "rep": run.rep, "failed": failed, "first_error": first})
        return found

    def systems(self) -> list[str]:
        return list(dict.fromkeys(run.system for run in self.runs))

    def summary(self) -> dict[str, dict[str, float]]:
        result: dict[str, dict[str, float]] = {}
        for system in self.systems():
            runs = [run.metrics for run in self.runs if run.system == system]
            keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
            medians = {}
            for key in keys:
                values = [float(r[key]) for r in runs if isinstance(r.get(key), int | float)]
                if values:
                    medians[key] = round(statistics.median(values), 3)
            result[system] = medians
        return result

    def ratios(self) -> dict[str, dict[str, float]]:
        summary = self.summary()
        result: dict[str, dict[str, float]] = {}
        for peer in self.systems():
            if peer in (OURS, OURS_METADATA):
                continue
            base = BASELINE_OF.get(peer, OURS)
            ours = [run for run in self.runs if run.system == base]
            theirs = [run for run in self.runs if run.system == peer]
            row: dict[str, float] = {}
            for key in RATIO_KEYS:
                a, b = summary.get(base, {}).get(key), summary[peer].get(key)
                if a is not None and b:
                    row[key] = round(a / b, 3)
                per_rep = [
                    o.metrics[key] / t.metrics[key]
                    for o, t in zip(ours, theirs, strict=False)
                    if o.metrics.get(key) is not None and t.metrics.get(key)
                ]
                if per_rep:
                    row[f"{key}_median_of_reps"] = round(statistics.median(per_rep), 3)
            if row:
                result[f"{base}/{peer}"] = row
        return result

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.options.scenario,
            "command": self.command,
            "started": self.started,
            "shape": self.options.shape,
            "options": self.options.to_json(),
            "machine": machine(self.loadavg_start),
            "cluster": self.cluster,
            "runs": [
                {
                    "system": run.system,
                    "rep": run.rep,
                    **run.metrics,
                    **(
                        {
                            "timeline_entries_per_s": run.timeline,
                            "timeline_interval_s": run.timeline_interval_s,
                        }
                        if run.timeline is not None
                        else {}
                    ),
                }
                for run in self.runs
            ],
            "summary": self.summary(),
            "ratios": self.ratios(),
            "curves": self.curves,
            "notes": self.notes,
            "failures": self.failures(),
        }

    def write(self) -> dict[str, Any]:
        """Write the folder; returns the JSON written."""
        out = self.options.out
        out.mkdir(parents=True, exist_ok=True)
        data = self.to_json()
        plots = self._plots(out)
        data["files"] = ["result.json", "summary.md", *plots]
        (out / "result.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (out / "summary.md").write_text(markdown(data))
        return data

    def _plots(self, out: Path) -> list[str]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.notes.append("no plots: matplotlib is missing (pip install 'bookkeeper-aio[bench]')")
            return []
        written = []
        hists = {s: _merged([r.histogram for r in self.runs if r.system == s]) for s in self.systems()}
        hists = {s: h for s, h in hists.items() if h is not None}
        if hists:
            fig, ax = plt.subplots(figsize=(8, 4.5))
            for system, hist in hists.items():
                points = percentile_curve(hist)
                ax.plot(
                    [1 / (1 - q / 100) if q < 100 else 1e6 for q, _ in points],
                    [ms for _, ms in points],
                    label=system,
                )
            ax.set_xscale("log")
            ticks = [1, 2, 10, 100, 1000, 10_000, 1e6]
            ax.set_xticks(ticks, ["p0", "p50", "p90", "p99", "p99.9", "p99.99", "max"])
            ax.set_ylabel("latency (ms)")
            ax.set_title(
                f"bkaio bench {self.options.scenario}: latency by percentile ({self.options.shape})",
                fontsize=9,
            )
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / "latency.png", dpi=100)
            plt.close(fig)
            written.append("latency.png")
        timelines = [r for r in self.runs if r.timeline]
        if timelines:
            fig, ax = plt.subplots(figsize=(8, 4.5))
            for run in timelines:
                assert run.timeline is not None
                xs = [(i + 1) * run.timeline_interval_s for i in range(len(run.timeline))]
                ax.plot(xs, run.timeline, label=f"{run.system} rep {run.rep}")
            ax.set_xlabel("seconds into the measured span")
            ax.set_ylabel("entries/s")
            ax.set_ylim(bottom=0)
            ax.set_title(f"bkaio bench {self.options.scenario}: throughput over time", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out / "throughput.png", dpi=100)
            plt.close(fig)
            written.append("throughput.png")
        if self.curves:
            fig, axes = plt.subplots(1, len(self.curves), figsize=(5 * len(self.curves), 4.5), squeeze=False)
            for ax, (name, curve) in zip(axes[0], self.curves.items(), strict=True):
                points = curve["points"]
                xs = [p["x"] for p in points]
                ax.plot(xs, [p["entries_per_s"] for p in points], marker="o", label="entries/s")
                if name != "journal_size":
                    ax.set_xscale("log")
                if name == "entry_size":  # 100 B .. 1 MiB: entries/s span decades
                    ax.set_yscale("log")
                else:
                    ax.set_ylim(bottom=0)
                if name == "entry_size":
                    twin = ax.twinx()
                    twin.plot(xs, [p["mib_per_s"] for p in points], marker="s", color="tab:orange")
                    twin.set_ylabel("MiB/s", color="tab:orange")
                    twin.set_ylim(bottom=0)
                ax.set_xlabel(curve["x_label"])
                ax.set_ylabel("entries/s")
                ax.set_title(name.replace("_", " "), fontsize=9)
                ax.grid(True, alpha=0.3)
            fig.suptitle(f"bkaio bench curves ({self.options.shape})", fontsize=9)
            fig.tight_layout()
            fig.savefig(out / "curves.png", dpi=100)
            plt.close(fig)
            written.append("curves.png")
        return written


def _peak_covers_end(
    metrics: dict[str, Any], peak: str = "client_rss_peak_mib", end: str = "client_rss_end_mib"
) -> None:
    """The peak RSS is sampled, so the end sample can be above it: the peak is at least the end."""
    high, last = metrics.get(peak), metrics.get(end)
    if isinstance(last, int | float) and (not isinstance(high, int | float) or high < last):
        metrics[peak] = last


def failure_lines(failures: Sequence[dict[str, Any]]) -> list[str]:
    """One line per failed run, for the summary and the terminal."""
    return [
        f"{f['system']} rep {f['rep']}: {f['failed']} add(s) failed; first error: {f['first_error'] or '-'}"
        for f in failures
    ]


def _merged(hists: Sequence[HdrHistogram | None]) -> HdrHistogram | None:
    present = [h for h in hists if h is not None and h.get_total_count()]
    if not present:
        return None
    total = new_histogram()
    for hist in present:
        total.add(hist)
    return total


def machine(loadavg_start: tuple[float, ...]) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in loadavg_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


def markdown(data: dict[str, Any]) -> str:
    """``summary.md``: the command, the machine, medians per system, ratios, the bookie breakdown."""
    m = data["machine"]
    lines = [
        f"# bkaio bench {data['scenario']} ({data['started']})",
        "",
        f"    {data['command']}",
        "",
        f"Shape: {data['shape']}. Machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, "
        f"load average {m['loadavg_start'][0]} at the start, {m['loadavg_end'][0]} at the end.",
        "",
    ]
    failures = data.get("failures") or []
    if failures:  # first: the numbers below are of a run that did not write everything
        lines += [
            "**FAILED: adds failed, so the figures below are not a measurement of a healthy cluster.**",
            "",
            *(f"- {line}" for line in failure_lines(failures)),
            "",
        ]
    summary: dict[str, dict[str, float]] = data["summary"]
    keys = list(dict.fromkeys(k for row in summary.values() for k in row))
    if keys:
        lines += ["| system | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for system, row in summary.items():
            lines.append(f"| {system} | " + " | ".join(_fmt(row.get(k)) for k in keys) + " |")
        lines.append("")
    reps = max((run["rep"] for run in data["runs"]), default=0) + 1
    lines.append(f"Medians of {reps} rep(s) per system; systems interleaved rep by rep.")
    lines.append("")
    if data["ratios"]:
        lines += [
            "| ratio (of medians) | rate | p50 | p99 | the same, median of per-rep ratios |",
            "|---|---|---|---|---|",
        ]
        for name, row in data["ratios"].items():
            rate = _fmt(row.get("entries_per_s", row.get("ops_per_s")))
            p50, p99 = _fmt(row.get("p50_ms")), _fmt(row.get("p99_ms"))
            reps = [
                row.get("entries_per_s_median_of_reps", row.get("ops_per_s_median_of_reps")),
                row.get("p50_ms_median_of_reps"),
                row.get("p99_ms_median_of_reps"),
            ]
            lines.append(f"| {name} | {rate} | {p50} | {p99} | {' / '.join(_fmt(v) for v in reps)} |")
        lines.append("")
    for name, curve in data.get("curves", {}).items():
        points = curve["points"]
        if name == "journal_size" and len(points) > 10:  # the timeline: every tenth point
            points = points[:: len(points) // 10] + points[-1:]
        lines += [
            f"Curve {name.replace('_', ' ')}: {curve['x_label']} | entries/s | ratio to the first | "
            "MiB/s | p50 ms | p99 ms",
            "",
            "| x | entries/s | ratio | MiB/s | p50 ms | p99 ms |",
            "|---|---|---|---|---|---|",
        ]
        for p in points:
            lines.append(
                f"| {_fmt(p['x'])} | {_fmt(p['entries_per_s'])} | {_fmt(p.get('ratio_to_first'))} | "
                f"{_fmt(p.get('mib_per_s'))} | {_fmt(p.get('p50_ms'))} | {_fmt(p.get('p99_ms'))} |"
            )
        lines.append("")
    breakdowns = [run for run in data["runs"] if run.get("bookie_side")]
    if breakdowns:
        lines += [
            "Bookie side (last rep; ms per journal group, µs of CPU per entry):",
            "",
            "| bookie | records/group | queue | journal write | fdatasync | completion | CPU µs/entry "
            "| RSS MiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for bookie_id, row in breakdowns[-1]["bookie_side"]["bookies"].items():
            stages = row.get("stages", {})
            lines.append(
                f"| {bookie_id} | {_fmt(row.get('records_per_group'))} | "
                + " | ".join(
                    _fmt(stages.get(f"{s}_ms_per_group"))
                    for s in ("queue", "journal_write", "fdatasync", "completion")
                )
                + f" | {_fmt(row.get('cpu_us_per_entry'))} | {_fmt(row.get('rss_mib'))} |"
            )
        lines.append("")
    lines += [f"- {note}" for note in data["notes"]]
    lines += ["", "Files: " + ", ".join(data.get("files", [])), ""]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:g}"
    return str(value)
