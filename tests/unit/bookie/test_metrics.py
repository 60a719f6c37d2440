"""bookie.stats histograms, bookie.metrics families / health / state from hand-made snapshots."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from bookie import metrics
from bookie.metrics import (
    BookieCollector,
    BookieState,
    DiskStatus,
    Histogram,
    Snapshot,
    health_problems,
    probe_disk,
    state_json,
)
from bookie.stats import FSYNC_SECONDS_BOUNDS, BucketHistogram

HEALTHY_DISK = DiskStatus(total_bytes=100 << 30, free_bytes=50 << 30)


def make_snapshot(**changes: object) -> Snapshot:
    fsync = BucketHistogram(FSYNC_SECONDS_BOUNDS)
    for seconds in (0.0002, 0.0002, 0.003, 7.0):
        fsync.observe(seconds)
    cumulative, total = fsync.snapshot()
    base = Snapshot(
        bookie_id="b-1",
        state=BookieState.WRITABLE,
        ready=True,
        address="127.0.0.1:3181",
        ledgers=3,
        adds=300,
        requests={"add_entry": 300, "read_entry": 7},
        entries_read=9,
        errors={"EFENCED": 2, "EUA": 1},
        journal_groups=40,
        journal_records=301,
        journal_bytes=330_000,
        journal_queue_bytes=1234,
        journal_queue_records=5,
        journal_fsync=Histogram(FSYNC_SECONDS_BOUNDS, cumulative, total),
        connections=2,
        in_flight=5,
        long_poll_waiters=4,
        disk=HEALTHY_DISK,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def scrape(snap: Snapshot) -> dict[str, float]:
    """Render through a real registry and parse the text back: ``{"name{labels}": value}``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BookieCollector(lambda: snap))
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render(registry).decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


# ---------------------------------------------------------------------- stats
def test_bucket_histogram__bounds_are_inclusive_and_snapshot_is_cumulative() -> None:
    hist = BucketHistogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 3.0):
        hist.observe(value)
    cumulative, total = hist.snapshot()
    assert cumulative == [2, 4, 5]  # le=1 holds 0.5 and 1.0; +Inf holds everything
    assert total == 8.0


def test_bucket_histogram__empty() -> None:
    assert BucketHistogram(FSYNC_SECONDS_BOUNDS).snapshot() == ([0] * (len(FSYNC_SECONDS_BOUNDS) + 1), 0.0)


# ---------------------------------------------------------------------- families
def test_families__counters_and_gauges_from_a_snapshot() -> None:
    samples = scrape(make_snapshot())
    assert samples['bookie_requests_total{op="add_entry"}'] == 300
    assert samples['bookie_requests_total{op="read_entry"}'] == 7
    assert samples["bookie_read_entries_total"] == 9
    assert samples['bookie_request_errors_total{status="EFENCED"}'] == 2
    assert samples['bookie_request_errors_total{status="EUA"}'] == 1
    assert samples["bookie_journal_groups_total"] == 40
    assert samples["bookie_journal_records_total"] == 301
    assert samples["bookie_journal_written_bytes_total"] == 330_000
    assert samples["bookie_journal_queue_bytes"] == 1234
    assert samples["bookie_journal_queue_records"] == 5
    assert samples["bookie_connections"] == 2
    assert samples["bookie_in_flight_requests"] == 5
    assert samples["bookie_long_poll_waiters"] == 4
    assert samples["bookie_ledgers"] == 3
    assert samples["bookie_disk_free_bytes"] == 50 << 30
    assert samples["bookie_disk_total_bytes"] == 100 << 30
    assert samples["bookie_ready"] == 1
    assert samples["bookie_healthy"] == 1
    assert samples['bookie_info{bookie_id="b-1",protocol_version="1",version="' + metrics.VERSION + '"}'] == 1


def test_families__fsync_histogram() -> None:
    samples = scrape(make_snapshot())
    assert samples['bookie_journal_fsync_seconds_bucket{le="0.0001"}'] == 0
    assert samples['bookie_journal_fsync_seconds_bucket{le="0.00025"}'] == 2
    assert samples['bookie_journal_fsync_seconds_bucket{le="0.005"}'] == 3
    assert samples['bookie_journal_fsync_seconds_bucket{le="2.5"}'] == 3
    assert samples['bookie_journal_fsync_seconds_bucket{le="+Inf"}'] == 4
    assert samples["bookie_journal_fsync_seconds_count"] == 4
    assert abs(samples["bookie_journal_fsync_seconds_sum"] - 7.0034) < 1e-9


def test_families__state_is_one_hot() -> None:
    samples = scrape(make_snapshot(state=BookieState.FAILED, journal_failed="OSError(5)"))
    states = {s.value: samples[f'bookie_state{{state="{s.value}"}}'] for s in BookieState}
    assert states == {s.value: (1 if s is BookieState.FAILED else 0) for s in BookieState}
    assert samples["bookie_journal_failed"] == 1
    assert samples["bookie_healthy"] == 0


def test_families__an_empty_snapshot_renders() -> None:
    """A bookie still recovering has no storage or processor yet: every family still renders."""
    samples = scrape(Snapshot(bookie_id="b", state=BookieState.STARTING, ready=False, disk=HEALTHY_DISK))
    assert samples['bookie_state{state="starting"}'] == 1
    assert samples["bookie_journal_fsync_seconds_count"] == 0
    assert samples["bookie_ready"] == 0


def test_make_registry__includes_process_metrics() -> None:
    text = metrics.render(metrics.make_registry(make_snapshot)).decode()
    assert "process_cpu_seconds_total" in text
    assert "bookie_journal_fsync_seconds_bucket" in text


# ---------------------------------------------------------------------- health and state
def test_health__healthy() -> None:
    assert health_problems(make_snapshot()) == []


def test_health__journal_failed() -> None:
    problems = health_problems(make_snapshot(journal_failed="OSError(5, 'EIO')"))
    assert len(problems) == 1
    assert problems[0].startswith("journal failed")


def test_health__disk_read_only_full_or_unusable() -> None:
    read_only = dataclasses.replace(HEALTHY_DISK, read_only=True)
    assert "read-only" in health_problems(make_snapshot(disk=read_only))[0]
    full = dataclasses.replace(HEALTHY_DISK, free_bytes=metrics.DISK_FREE_BYTES_MIN - 1)
    assert "nearly full" in health_problems(make_snapshot(disk=full))[0]
    broken = DiskStatus(error="statvfs /x: No such file or directory", read_only=True)
    assert "unusable" in health_problems(make_snapshot(disk=broken))[0]


def test_health__starting_is_healthy_but_not_ready() -> None:
    snap = make_snapshot(state=BookieState.STARTING, ready=False)
    assert health_problems(snap) == []


def test_state_json() -> None:
    state = state_json(make_snapshot(journal_failed="OSError(5)", state=BookieState.FAILED))
    assert state["state"] == "failed"
    assert state["healthy"] is False
    assert state["journal"]["records"] == 301
    assert state["journal"]["fsync_count"] == 4
    assert state["requests"]["add_entry"] == 300
    assert state["disk"]["free_bytes"] == 50 << 30


def test_probe_disk(tmp_path: Path) -> None:
    disk = probe_disk(str(tmp_path))
    assert disk.error is None
    assert not disk.read_only
    assert 0 < disk.free_bytes <= disk.total_bytes
    missing = probe_disk(str(tmp_path / "missing"))
    assert missing.error is not None
    assert missing.read_only
