"""``bkaio bench write`` end to end: a real etcd, three real bookie processes registered in it (as
the sandbox's), the command as a user types it, and its results folder read back."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import metadata
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


async def _init(url: str) -> None:
    async with metadata.connect(url) as meta:
        await metadata.init_cluster(meta.store, meta.root)


async def _ledgers(url: str) -> list[int]:
    async with metadata.connect(url) as meta:
        return [ledger_id async for ledger_id in meta.ledger_manager().iter_ledger_ids()]


@pytest.fixture
def cluster(etcd_server: EtcdCluster, tmp_path: Path) -> Iterator[str]:
    url = etcd_server.url(f"/bookkeeper/bench-{uuid.uuid4().hex[:8]}")
    asyncio.run(_init(url))
    procs = [
        BookieProcess(tmp_path / f"b{i}", f"b{i}", extra_args=["--metadata", url, "--admin-port", "0"])
        for i in range(3)
    ]
    try:
        for proc in procs:
            proc.start()
        yield url
    finally:
        for proc in procs:
            proc.cleanup()


def test_bench_write__two_client_processes_leave_a_results_folder(cluster: str, tmp_path: Path) -> None:
    out = tmp_path / "results"
    argv = [
        "bench", "write", "--metadata", cluster, "--duration", "2", "--warmup", "0.5",
        "--clients", "2", "--ledgers", "2", "--window", "200", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "bookkeeper_aio.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"results: {out}" in done.stdout
    assert done.stderr == ""  # no progress line without a terminal

    result = json.loads((out / "result.json").read_text())
    assert result["scenario"] == "write"
    assert result["command"] == "bkaio " + " ".join(argv)
    [run] = result["runs"]
    assert run["system"] == "bookkeeper"
    assert run["failed"] == 0
    assert run["entries_per_s"] > 100
    assert 0 < run["p50_ms"] <= run["p90_ms"] <= run["p99_ms"] <= run["p99.9_ms"] <= run["max_ms"]
    assert len(run["clients"]) == 2
    assert all(c["entries"] > 0 and c["cpu_us_per_entry"] > 0 for c in run["clients"])
    assert run["client_rss_peak_mib"] == max(c["rss_peak_mib"] for c in run["clients"]) > 10
    assert run["client_rss_end_mib"] == max(c["rss_end_mib"] for c in run["clients"]) > 10
    assert run["client_cpu_us_per_entry"] > 0
    assert len(run["timeline_entries_per_s"]) == round(2 / run["timeline_interval_s"])
    measured = sum(run["timeline_entries_per_s"]) * run["timeline_interval_s"]
    assert measured == pytest.approx(run["entries_per_s"] * 2, rel=0.01)
    assert 0 < run["fairness_min_over_max"] <= 1

    side = run["bookie_side"]
    assert sorted(side["bookies"]) == ["b0", "b1", "b2"]
    assert side["cpu_us_per_entry"] > 0
    records = sum(b["journal_records"] for b in side["bookies"].values())
    # E3/Qw2: every entry is journaled on two bookies (the span's edges blur it a little)
    assert records == pytest.approx(2 * run["entries_per_s"] * 2, rel=0.25)
    for bookie in side["bookies"].values():
        assert bookie["stages"]["fdatasync_ms_per_group"] > 0
        assert bookie["stages"]["journal_write_ms_per_group"] > 0
        assert bookie["records_per_group"] >= 1
    assert result["summary"]["bookkeeper"]["entries_per_s"] == run["entries_per_s"]

    summary = (out / "summary.md").read_text()
    assert "| bookkeeper |" in summary
    assert "bkaio bench write --metadata" in summary
    assert summary in done.stdout
    for png in ("latency.png", "throughput.png"):
        assert (out / png).read_bytes().startswith(PNG_MAGIC)
    # the benchmark's ledgers are deleted afterwards
    assert asyncio.run(_ledgers(cluster)) == []


def _bench(url: str, out: Path, *argv: str) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bookkeeper_aio.cli.main",
            "bench",
            *argv,
            "--metadata",
            url,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


@pytest.mark.slow
def test_bench_scenarios__read_tail_recovery_restart_log_each_report_and_clean_up(
    cluster: str, tmp_path: Path
) -> None:
    [read] = _bench(cluster, tmp_path / "read", "read", "-W", "3", "--entries", "3000")["runs"]
    assert read["entries_per_s"] > 0
    assert read["batch_reads"] is True
    assert read["client_cpu_us_per_entry"] > 0

    [tail] = _bench(cluster, tmp_path / "tail", "tail", "--duration", "1")["runs"]
    assert tail["entries"] > 10
    assert 0 < tail["tail_after_ack_p50_ms"] <= tail["tail_after_ack_max_ms"]

    [recovery] = _bench(cluster, tmp_path / "recovery", "recovery", "--in-flight", "200")["runs"]
    assert recovery["lac_at_death"] >= 399
    assert recovery["recovery_s"] > 0

    [restart] = _bench(cluster, tmp_path / "restart", "restart", "--journal-mib", "4")["runs"]
    assert 0 < restart["serving_s"] <= restart["ready_s"]
    assert restart["registered_s"] > 0

    log = _bench(
        cluster, tmp_path / "log", "log", "--duration", "1", "--warmup", "0.2", "--roll-every", "500"
    )
    assert {run["system"] for run in log["runs"]} == {"ledger", "log", "log_roll"}
    assert next(r for r in log["runs"] if r["system"] == "log_roll")["ledgers"] > 1
    assert any(note.startswith("log / ledger throughput") for note in log["notes"])

    assert asyncio.run(_ledgers(cluster)) == []  # nothing the benchmarks made is left behind


@pytest.mark.slow
def test_bench_curves_and_the_fan_in_pair__points_ratios_plot_and_clean_up(
    cluster: str, tmp_path: Path
) -> None:
    curves = _bench(
        cluster,
        tmp_path / "curves",
        "curves",
        "--duration", "1", "--warmup", "0.2", "--sizes", "100,65536", "--ledger-counts", "1,300",
        "--journal-s", "2",
    )  # fmt: skip
    sizes = curves["curves"]["entry_size"]["points"]
    assert [p["x"] for p in sizes] == [100, 65536]
    assert sizes[0]["ratio_to_first"] == 1.0
    assert all(p["entries_per_s"] > 0 for p in sizes)
    assert sizes[1]["mib_per_s"] > sizes[1]["entries_per_s"] * 65536 / 2**20 * 0.99
    counts = {r["system"]: r for r in curves["runs"]}
    assert counts["ledgers 300"]["window"] == 1000
    assert counts["ledgers 300"]["fairness_min_over_max"] is not None  # 300 ledgers written
    journal = curves["curves"]["journal_size"]["points"]
    assert len(journal) >= 10
    assert journal[-1]["x"] > journal[0]["x"] > 0  # the journal grew during the run
    assert curves["curves"]["journal_size"]["x_label"] == "journal written per bookie (GiB)"  # measured
    assert (tmp_path / "curves" / "curves.png").read_bytes().startswith(PNG_MAGIC)

    fan_in = _bench(
        cluster, tmp_path / "fan-in", "write", "--clients", "2", "--ledgers", "5", "--duration", "1",
        "--warmup", "0.2", "--compare", "one-client",
    )  # fmt: skip
    by_system = {run["system"]: run for run in fan_in["runs"]}
    assert len(by_system["bookkeeper"]["clients"]) == 2
    assert len(by_system["one-client"]["clients"]) == 1
    assert by_system["bookkeeper"]["fairness_min_over_max"] > 0
    assert fan_in["ratios"]["bookkeeper/one-client"]["entries_per_s"] > 0
    assert asyncio.run(_ledgers(cluster)) == []  # nothing the benchmarks made is left behind


async def _plant_restart_leftover(url: str) -> tuple[int, int]:
    """What an interrupted ``bench restart`` of an older version left: a ledger marked as the
    restart scenario's, on a benchmark bookie whose cookie is gone; and one the sweep must keep
    (marked the same but on a real bookie)."""
    async with metadata.connect(url) as meta:
        manager = meta.ledger_manager()
        mark = {"bkaio-bench": b"restart"}
        stale = await manager.create(
            ["bkaio-bench-dead0000"], write_quorum=1, ack_quorum=1, custom_metadata=mark
        )
        kept = await manager.create(["b0"], write_quorum=1, ack_quorum=1, custom_metadata=mark)
        return stale.metadata.ledger_id, kept.metadata.ledger_id


async def _restart_state(url: str) -> tuple[list[int], list[str]]:
    async with metadata.connect(url) as meta:
        ledgers = [i async for i in meta.ledger_manager().iter_ledger_ids()]
        page = await meta.store.list(f"{meta.root}/cookies/", limit=100)
        return ledgers, [kv.key.rsplit("/", 1)[1] for kv in page.items]


async def _restart_ledger_closed(url: str, known: set[int]) -> bool:
    async with metadata.connect(url) as meta:
        manager = meta.ledger_manager()
        async for ledger_id in manager.iter_ledger_ids():
            if ledger_id not in known:
                md = (await manager.read(ledger_id)).metadata
                return md.state.name == "CLOSED"
    return False


def test_bench_restart__ctrl_c_mid_run_leaves_no_ledger_no_cookie_and_no_traceback(
    cluster: str, tmp_path: Path
) -> None:
    stale, kept = asyncio.run(_plant_restart_leftover(cluster))
    argv = [
        sys.executable, "-m", "bookkeeper_aio.cli.main", "bench", "restart", "--metadata", cluster,
        "--journal-mib", "1", "--reps", "50", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # the journal is filled (its ledger closed): the run is in its kill/restart reps. Both
        # planted ledgers are known: the run deletes the stale one as it starts, and a poll that
        # took it for the run's own listed it, then found it gone (NoSuchLedger)
        while not asyncio.run(_restart_ledger_closed(cluster, {stale, kept})):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            # SIGTERM first: the run stops its bookie (a SIGKILL left that child running, orphaned)
            proc.terminate()
            try:
                proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()  # reaped, its pipes closed
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "never retrieved" not in err, err
    assert "interrupted" in err
    ledgers, cookies = asyncio.run(_restart_state(cluster))
    assert ledgers == [kept]  # the run's own ledger and the older run's leftover are deleted
    assert stale not in ledgers
    assert sorted(cookies) == ["b0", "b1", "b2"]  # the benchmark's bookie took its cookie with it
