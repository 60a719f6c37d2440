"""The results folder of ``bkaio bench``: medians per system, ratios ours / peer (of the medians and
per rep), the Markdown summary with the command, plots only where there is data."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from bookkeeper_aio.cli.bench import options
from bookkeeper_aio.cli.bench.report import Report, Run
from bookkeeper_aio.cli.bench.stats import new_histogram


def _options(out: Path) -> options.BenchOptions:
    parser = argparse.ArgumentParser()
    options.add_arguments(parser, "write")
    return options.build(parser.parse_args(["--out", str(out)]), "write")


def test_report__medians_ratios_and_files(tmp_path: Path) -> None:
    report = Report(_options(tmp_path / "out"), "bkaio bench write --reps 3")
    hist = new_histogram()
    for value_us in (1000, 2000, 3000):
        hist.record_value(value_us)
    ours = [(100.0, 2.0), (200.0, 2.0), (300.0, 4.0)]
    peer = [(100.0, 1.0), (100.0, 1.0), (400.0, 1.0)]
    for rep, ((o_rate, o_p50), (p_rate, p_p50)) in enumerate(zip(ours, peer, strict=True)):
        report.add(
            Run("bookkeeper", rep, {"entries_per_s": o_rate, "p50_ms": o_p50}, hist, [o_rate, o_rate], 0.5)
        )
        report.add(Run("nats", rep, {"entries_per_s": p_rate, "p50_ms": p_p50}))
    data = report.write()

    assert data["summary"]["bookkeeper"] == {"entries_per_s": 200.0, "p50_ms": 2.0}
    assert data["summary"]["nats"] == {"entries_per_s": 100.0, "p50_ms": 1.0}
    ratio = data["ratios"]["bookkeeper/nats"]
    assert ratio["entries_per_s"] == 2.0  # of the medians
    assert ratio["entries_per_s_median_of_reps"] == 1.0  # 1.0, 2.0, 0.75 rep by rep
    assert ratio["p50_ms"] == 2.0

    out = tmp_path / "out"
    assert json.loads((out / "result.json").read_text())["ratios"] == data["ratios"]
    summary = (out / "summary.md").read_text()
    assert "    bkaio bench write --reps 3" in summary
    assert "| bookkeeper/nats | 2 | 2 | - | 1 / 2 / - |" in summary
    assert data["files"] == ["result.json", "summary.md", "latency.png", "throughput.png"]
    assert (out / "latency.png").stat().st_size > 1000


def test_report__curves_go_to_the_summary_the_json_and_a_plot(tmp_path: Path) -> None:
    report = Report(_options(tmp_path / "out"), "bkaio bench curves")
    report.add(Run("size 100 B", 0, {"entries_per_s": 1000.0}))
    report.curves["entry_size"] = {
        "x_label": "entry size (bytes)",
        "points": [
            {"x": 100, "entries_per_s": 1000.0, "ratio_to_first": 1.0, "mib_per_s": 0.1},
            {"x": 1024, "entries_per_s": 800.0, "ratio_to_first": 0.8, "mib_per_s": 0.78},
        ],
    }
    report.curves["journal_size"] = {
        "x_label": "journal (GiB)",
        "points": [{"x": i / 100, "entries_per_s": 500.0 + i, "ratio_to_first": 1.0} for i in range(30)],
    }
    data = report.write()
    assert data["curves"]["entry_size"]["points"][1]["ratio_to_first"] == 0.8
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| 1024 | 800 | 0.8 | 0.78 | - | - |" in summary
    assert summary.count("| 0.") < 20  # the journal timeline is thinned to about ten rows
    assert "curves.png" in data["files"]
    assert (tmp_path / "out" / "curves.png").stat().st_size > 1000


def test_report__failed_adds_lead_the_summary_and_the_peak_covers_the_end(tmp_path: Path) -> None:
    report = Report(_options(tmp_path / "out"), "bkaio bench write")
    report.add(
        Run(
            "bookkeeper",
            0,
            {
                "entries_per_s": 900.0,
                "failed": 20,
                "first_error": "NotEnoughBookies('no writable bookie')",
                "client_rss_peak_mib": 50.0,
                "client_rss_end_mib": 61.5,
                "clients": [{"rss_peak_mib": 50.0, "rss_end_mib": 61.5}],
            },
        )
    )
    report.add(Run("bookkeeper", 1, {"entries_per_s": 1000.0, "failed": 0, "first_error": None}))
    data = report.write()

    assert data["failures"] == [
        {
            "system": "bookkeeper",
            "rep": 0,
            "failed": 20,
            "first_error": "NotEnoughBookies('no writable bookie')",
        }
    ]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.index("**FAILED") < summary.index("| system |")
    assert (
        "- bookkeeper rep 0: 20 add(s) failed; first error: NotEnoughBookies('no writable bookie')" in summary
    )
    [first, _] = data["runs"]
    assert first["client_rss_peak_mib"] == 61.5  # sampled peak below the end sample: max of the two
    assert first["clients"][0]["rss_peak_mib"] == 61.5


def test_report__no_failure_section_when_every_add_succeeded(tmp_path: Path) -> None:
    report = Report(_options(tmp_path / "out"), "bkaio bench write")
    report.add(Run("bookkeeper", 0, {"entries_per_s": 1000.0, "failed": 0, "first_error": None}))
    data = report.write()
    assert data["failures"] == []
    assert "FAILED" not in (tmp_path / "out" / "summary.md").read_text()


def test_cmd_bench__a_run_with_failed_adds_exits_1_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bookkeeper_aio.cli.bench as bench

    async def failing(opts: options.BenchOptions, url: str, report: Report, live: object) -> None:
        report.add(Run("bookkeeper", 0, {"entries_per_s": 5.0, "failed": 3, "first_error": "BKTimeout()"}))

    monkeypatch.setattr(bench, "_scenario", lambda name: failing)
    parser = argparse.ArgumentParser()
    bench.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "write", "--metadata", "memory:///x", "--out", str(tmp_path), "-q"])
    assert asyncio.run(bench.cmd_bench(args)) == 1
    err = capsys.readouterr().err
    assert "bkaio bench write: bookkeeper rep 0: 3 add(s) failed; first error: BKTimeout()" in err
    assert "exit 1" in err
