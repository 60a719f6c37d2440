"""The bookie side of a benchmark: each registered bookie's admin endpoint (``/state``,
``/metrics``), read at both ends of the measured span, and the difference per entry.

CPU: a bookie on this machine (its ``/state`` pid is visible in /proc and runs ``bookie``) is read
from /proc, split into the event-loop thread and the others (the journal writer); a remote one
from ``process_cpu_seconds_total`` of its ``/metrics``. The time breakdown comes from the bookie's
own journal histograms (docs/bookie.md, *Metrics*): queue wait (first record of a group appended ->
the group handed to the writer), journal write, fdatasync, and completion (index updates and
answers of a group), each a sum and count per group.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

import metadata
from bookkeeper_aio.cli.bench.stats import rss_bytes, thread_cpu_s

ADMIN_TIMEOUT_S = 5.0
HISTOGRAMS = {
    "queue": "bookie_journal_queue_wait_seconds",
    "journal_write": "bookie_journal_write_seconds",
    "fdatasync": "bookie_journal_fsync_seconds",
    "completion": "bookie_journal_completion_seconds",
}
"""Per-group time histograms of the bookie, by the stage name reported."""


@dataclass(frozen=True)
class BookieEndpoint:
    bookie_id: str
    address: str
    admin: str | None


@dataclass
class BookieSample:
    """One bookie at one instant."""

    metrics: dict[str, float] = field(default_factory=dict)
    pid: int | None = None
    thread_cpu_s: tuple[float, float] | None = None
    rss_bytes: int | None = None


async def discover(url: str) -> list[BookieEndpoint]:
    """The registered bookies (writable and read-only) with their admin endpoints, if published."""
    async with metadata.connect(url) as meta:
        found = await metadata.list_bookies(meta.store, meta.root)
    infos = {**found.readonly, **found.writable}
    return [
        BookieEndpoint(bookie_id, f"{info.host}:{info.port}", info.attributes.get("admin"))
        for bookie_id, info in sorted(infos.items())
    ]


async def sample(endpoints: list[BookieEndpoint]) -> dict[str, BookieSample]:
    samples = await asyncio.gather(*(asyncio.to_thread(_sample_one, e) for e in endpoints))
    return {e.bookie_id: s for e, s in zip(endpoints, samples, strict=True)}


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=ADMIN_TIMEOUT_S) as response:
        body: bytes = response.read()
        return body


def _sample_one(endpoint: BookieEndpoint) -> BookieSample:
    result = BookieSample()
    if endpoint.admin is None:
        return result
    try:
        state = json.loads(_get(f"http://{endpoint.admin}/state"))
        text = _get(f"http://{endpoint.admin}/metrics").decode()
    except (OSError, ValueError):
        return result
    for family in text_string_to_metric_families(text):
        for item in family.samples:
            if not item.labels or set(item.labels) == {"le"}:
                key = item.name if not item.labels else f"{item.name}{{le={item.labels['le']}}}"
                result.metrics[key] = item.value
    pid = state.get("pid")
    if isinstance(pid, int) and _is_local_bookie(pid):
        result.pid = pid
        result.thread_cpu_s = thread_cpu_s(pid)
        result.rss_bytes = rss_bytes(pid)
    return result


def _is_local_bookie(pid: int) -> bool:
    try:
        return b"bookie" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def breakdown(
    before: dict[str, BookieSample], after: dict[str, BookieSample], entries: int
) -> dict[str, Any]:
    """Per bookie and in total: CPU per entry (µs), journal groups and records, and the mean time
    of each journal stage per group (ms). ``entries``: entries the clients had acknowledged."""
    per_bookie: dict[str, Any] = {}
    cpu_total_s = 0.0
    cpu_known = True
    for bookie_id, end in after.items():
        start = before.get(bookie_id)
        if start is None or not end.metrics:
            cpu_known = False
            continue
        row = _bookie_row(start, end, entries)
        cpu_s = row.pop("_cpu_s")
        if cpu_s is None:
            cpu_known = False
        else:
            cpu_total_s += cpu_s
        per_bookie[bookie_id] = row
    total: dict[str, Any] = {"bookies": per_bookie}
    if cpu_known and per_bookie and entries:
        total["cpu_us_per_entry"] = round(cpu_total_s / entries * 1e6, 2)
    return total


def _bookie_row(start: BookieSample, end: BookieSample, entries: int) -> dict[str, Any]:
    def delta(name: str) -> float:
        return end.metrics.get(name, 0.0) - start.metrics.get(name, 0.0)

    groups = delta("bookie_journal_groups_total")
    records = delta("bookie_journal_records_total")
    row: dict[str, Any] = {
        "journal_groups": int(groups),
        "journal_records": int(records),
        "records_per_group": round(records / groups, 1) if groups else None,
    }
    stages: dict[str, float | None] = {}
    for stage, name in HISTOGRAMS.items():
        count = delta(f"{name}_count")
        stages[f"{stage}_ms_per_group"] = round(delta(f"{name}_sum") / count * 1e3, 3) if count else None
    row["stages"] = stages
    cpu_s: float | None = None
    if start.thread_cpu_s is not None and end.thread_cpu_s is not None:
        loop_s = end.thread_cpu_s[0] - start.thread_cpu_s[0]
        other_s = end.thread_cpu_s[1] - start.thread_cpu_s[1]
        cpu_s = loop_s + other_s
        if entries:
            row["loop_cpu_us_per_entry"] = round(loop_s / entries * 1e6, 2)
            row["other_threads_cpu_us_per_entry"] = round(other_s / entries * 1e6, 2)
    elif "process_cpu_seconds_total" in end.metrics:
        cpu_s = delta("process_cpu_seconds_total")
    if cpu_s is not None and entries:
        row["cpu_us_per_entry"] = round(cpu_s / entries * 1e6, 2)
    if end.rss_bytes is not None:
        row["rss_mib"] = round(end.rss_bytes / 2**20, 1)
    row["_cpu_s"] = cpu_s
    return row
