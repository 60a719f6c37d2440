"""Bookie metrics and health: a snapshot of plain counters, turned into Prometheus text at scrape.

Strategy (docs/internals.md §6: CPU per entry is the limit): nothing on the request path calls
prometheus_client. The objects that already count keep plain ints (``Processor.adds``,
``Journal.records_written``, ``BookieServer.connections_refused``) and the journal's writer thread
fills fixed-bucket histograms once per group (:mod:`bookie.stats`). At scrape time
:func:`snapshot` reads them all into a :class:`Snapshot` (on the event loop, so nothing mutates
underneath), and :class:`BookieCollector` turns a snapshot into metric families. ``/state`` and
``/health`` (:mod:`bookie.admin`) read the same snapshot, so the three never disagree.

Names follow Prometheus conventions: a ``bookie_`` prefix, the unit last (``_seconds``, ``_bytes``),
counters end in ``_total``. The list, with meanings, is in docs/bookie.md (*Metrics*).

Bookie state (:class:`BookieState`), derived, never stored: ``starting`` until the listener is up,
``failed`` once the journal hit an I/O error (nothing more can be made durable until a restart),
``read_only`` in read-only mode (:mod:`bookie.mode`: disk below ``disk_free_bytes_min``, set by the
operator, ...) or when the data dir's filesystem is read-only, not writable or nearly full,
``stopping`` during shutdown, else ``writable``.
"""

from __future__ import annotations

import enum
import importlib.metadata
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from bookie.journal import PREALLOCATE_BYTES
from bookie.stats import FSYNC_SECONDS_BOUNDS, GROUP_RECORDS_BOUNDS, BucketHistogram
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import PROTOCOL_VERSION, OpCode, StatusCode

if TYPE_CHECKING:
    from bookie.server import BookieServer

__all__ = [
    "CONTENT_TYPE_LATEST",
    "BookieCollector",
    "BookieState",
    "DiskStatus",
    "Snapshot",
    "health_problems",
    "make_registry",
    "probe_disk",
    "render",
    "snapshot",
]

DISK_FREE_BYTES_MIN = 2 * PREALLOCATE_BYTES
"""Below this much free space the bookie counts as read-only: the journal grows in preallocated
16 MiB steps, so with less than two steps left the next segment growth may fail (ENOSPC)."""

try:
    VERSION = importlib.metadata.version("bookkeeper_aio")
except importlib.metadata.PackageNotFoundError:  # running from a source tree without an install
    VERSION = "unknown"


class BookieState(enum.Enum):
    STARTING = "starting"
    WRITABLE = "writable"
    READ_ONLY = "read_only"
    FAILED = "failed"
    STOPPING = "stopping"


@dataclass(frozen=True)
class DiskStatus:
    """The data dir's filesystem as seen by statvfs/access; ``error`` when statvfs itself failed."""

    total_bytes: int = 0
    free_bytes: int = 0
    read_only: bool = False
    """Mounted read-only (``ST_RDONLY``) or the directory is not writable by this process."""
    error: str | None = None


def probe_disk(path: str) -> DiskStatus:
    """statvfs + access on ``path``: two metadata syscalls (microseconds), fine on the loop."""
    try:
        stat = os.statvfs(path)
    except OSError as exc:
        return DiskStatus(error=f"statvfs {path}: {exc.strerror or exc}", read_only=True)
    read_only = bool(stat.f_flag & os.ST_RDONLY) or not os.access(path, os.W_OK | os.X_OK)
    return DiskStatus(stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize, read_only)


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts per upper bound (the last is +Inf) and the sum, at scrape time."""

    bounds: tuple[float, ...]
    cumulative: list[int]
    sum: float

    @property
    def count(self) -> int:
        return self.cumulative[-1] if self.cumulative else 0


def _empty(bounds: tuple[float, ...]) -> Histogram:
    return Histogram(bounds, [0] * (len(bounds) + 1), 0.0)


@dataclass(frozen=True)
class Snapshot:
    """Everything the metrics, ``/state`` and ``/health`` report, read at one instant."""

    bookie_id: str
    state: BookieState
    ready: bool
    address: str | None = None
    admin_address: str | None = None
    version: str = VERSION
    protocol_version: int = PROTOCOL_VERSION
    uptime_s: float = 0.0
    ledgers: int = 0
    registration_failed: str | None = None
    """Why the metadata registration ended for good while the bookie runs (None: registered or none)."""
    foreign_cluster: str | None = None
    """GC found another cluster at the metadata root than the data dir's (``bookie.gc.ForeignCluster``)."""
    limbo_ledgers: int = 0
    """Ledgers in limbo (bookie/limbo.py); -1 while every ledger is, before metadata narrowed it."""
    adds: int = 0
    requests: dict[str, int] = field(default_factory=dict)
    """Requests received by op name (adds included)."""
    entries_read: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Error responses by status name."""
    journal_groups: int = 0
    journal_records: int = 0
    journal_bytes: int = 0
    journal_queue_bytes: int = 0
    journal_queue_records: int = 0
    journal_queue_bytes_max: int = 0
    journal_pressure: bool = False
    journal_failed: str | None = None
    journal_fsync: Histogram = field(default_factory=lambda: _empty(FSYNC_SECONDS_BOUNDS))
    journal_group_records: Histogram = field(default_factory=lambda: _empty(GROUP_RECORDS_BOUNDS))
    journal_write: Histogram = field(default_factory=lambda: _empty(FSYNC_SECONDS_BOUNDS))
    journal_queue_wait: Histogram = field(default_factory=lambda: _empty(FSYNC_SECONDS_BOUNDS))
    journal_completion: Histogram = field(default_factory=lambda: _empty(FSYNC_SECONDS_BOUNDS))
    connections: int = 0
    connections_max: int = 0
    connections_refused: int = 0
    connections_tarpitted: int = 0
    connections_held: int = 0
    answer_bytes_held: int = 0
    answer_throttles: int = 0
    in_flight: int = 0
    in_flight_max: int = 0
    sockets_paused: bool = False
    long_poll_waiters: int = 0
    disk: DiskStatus = field(default_factory=DiskStatus)
    read_only_mode: bool = False
    """The mode machine's answer (:mod:`bookie.mode`): normal adds get EREADONLY."""
    read_only_reason: str | None = None
    read_only_manual: bool = False
    mode_transitions: int = 0
    registered_read_only: bool | None = None
    """The registration set metadata holds the bookie in (None: no registration)."""
    gc_running: bool = False
    gc_passes: int = 0
    gc_ledgers_collected: int = 0
    gc_over_replicated_collected: int = 0
    gc_orphans_collected: int = 0
    gc_bytes_copied: int = 0
    gc_bytes_freed: int = 0
    gc_segments_deleted: int = 0


def _read(histogram: BucketHistogram) -> Histogram:
    cumulative, total = histogram.snapshot()
    return Histogram(histogram.bounds, cumulative, total)


def _op_name(request_type: type[Any]) -> str:
    return OpCode(m.REQUEST_OP[request_type]).name.lower()


def _status_name(status: int) -> str:
    try:
        return StatusCode(status).name
    except ValueError:
        return str(status)


def snapshot(server: BookieServer, disk: DiskStatus | None = None) -> Snapshot:
    """Read the live server's counters (call on its event loop). ``disk`` defaults to a probe."""
    config = server.config
    disk = probe_disk(config.data_dir) if disk is None else disk
    base: dict[str, Any] = {
        "bookie_id": config.bookie_id,
        "address": "{}:{}".format(*server.address) if server.address else None,
        "admin_address": server.admin_address,
        "uptime_s": server.clock.monotonic() - server.started_s,
        "connections": server.connection_count,
        "connections_max": config.connections_max,
        "connections_refused": server.connections_refused,
        "connections_tarpitted": server.tarpit.held_total,
        "connections_held": server.tarpit.held,
        "answer_bytes_held": server.answers.held,
        "answer_throttles": server.answers.throttles,
        "in_flight": server.load.in_flight,
        "in_flight_max": config.in_flight_total_max,
        "sockets_paused": server.load.sockets_paused,
        "journal_queue_bytes_max": config.journal_queue_bytes_max,
        "disk": disk,
        "read_only_mode": server.mode.read_only,
        "read_only_reason": server.mode.reason,
        "read_only_manual": server.mode.manual,
        "mode_transitions": server.mode.transitions,
        "registered_read_only": server.registered_read_only if server.registration is not None else None,
        "registration_failed": _registration_failure(server),
        "foreign_cluster": server.mode.foreign_cluster,
    }
    storage, processor = server.storage, server.processor
    if storage is not None:
        journal = storage.journal
        fsync_cumulative, fsync_sum = journal.sync_seconds.snapshot()
        group_cumulative, group_sum = journal.group_records.snapshot()
        failed = journal.failed
        base.update(
            ledgers=len(storage.ledgers),
            limbo_ledgers=0 if storage.limbo is None else storage.limbo.count(),
            journal_groups=journal.groups_written,
            journal_records=journal.records_written,
            journal_bytes=journal.bytes_written,
            journal_queue_bytes=journal.queue_bytes,
            journal_queue_records=journal.queue_records,
            journal_pressure=journal.under_pressure,
            journal_failed=None if failed is None else repr(failed),
            journal_fsync=Histogram(journal.sync_seconds.bounds, fsync_cumulative, fsync_sum),
            journal_group_records=Histogram(journal.group_records.bounds, group_cumulative, group_sum),
            journal_write=_read(journal.write_seconds),
            journal_queue_wait=_read(journal.queue_wait_seconds),
            journal_completion=_read(journal.completion_seconds),
        )
    if processor is not None:
        requests = {_op_name(kind): count for kind, count in processor.requests.items()}
        requests[_op_name(m.AddEntryRequest)] = processor.adds
        base.update(
            adds=processor.adds,
            requests=requests,
            entries_read=processor.entries_read,
            errors={_status_name(status): count for status, count in processor.errors.items()},
            long_poll_waiters=processor.long_poll_waiters(),
        )
    gc = server.gc
    if gc is not None:
        base.update(
            gc_running=gc.running is not None,
            gc_passes=gc.passes,
            gc_ledgers_collected=gc.ledgers_collected_total,
            gc_over_replicated_collected=gc.over_replicated_collected_total,
            gc_orphans_collected=gc.orphans_collected_total,
            gc_bytes_copied=gc.bytes_copied_total,
            gc_bytes_freed=gc.bytes_freed_total,
            gc_segments_deleted=gc.segments_deleted_total,
        )
    state = _state(server, base)
    ready = server.ready and state is not BookieState.STOPPING and base["registration_failed"] is None
    return Snapshot(state=state, ready=ready, **base)


def _registration_failure(server: BookieServer) -> str | None:
    failure = None if server.registration is None else server.registration.failure
    return None if failure is None else repr(failure)


def _state(server: BookieServer, values: dict[str, Any]) -> BookieState:
    if server.closing:
        return BookieState.STOPPING
    if server.address is None:
        return BookieState.STARTING
    if values.get("journal_failed") is not None:
        return BookieState.FAILED
    if values["read_only_mode"] or _disk_problem(values["disk"]) is not None:
        return BookieState.READ_ONLY
    return BookieState.WRITABLE


def _disk_problem(disk: DiskStatus) -> str | None:
    if disk.error is not None:
        return f"data dir unusable: {disk.error}"
    if disk.read_only:
        return "data dir is read-only (filesystem mounted read-only or directory not writable)"
    if disk.free_bytes < DISK_FREE_BYTES_MIN:
        return f"data dir nearly full: {disk.free_bytes} bytes free, need {DISK_FREE_BYTES_MIN}"
    return None


def health_problems(snap: Snapshot) -> list[str]:
    """Why the bookie is unhealthy (empty: healthy). Starting and stopping are healthy (liveness:
    a bookie replaying its journal must not be restarted for being slow)."""
    problems: list[str] = []
    if snap.journal_failed is not None:
        problems.append(f"journal failed: {snap.journal_failed}")
    if snap.registration_failed is not None:
        problems.append(
            f"registration ended: {snap.registration_failed} "
            "(the cluster no longer sees this bookie: restart it)"
        )
    if snap.foreign_cluster is not None:
        problems.append(snap.foreign_cluster)
    disk_problem = _disk_problem(snap.disk)
    if disk_problem is not None:
        problems.append(disk_problem)
    return problems


class BookieCollector(Collector):
    """Evaluated at scrape time: ``source()`` gives the snapshot to expose."""

    def __init__(self, source: Callable[[], Snapshot]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        return families(self._source())


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
    labels = [_bound_label(bound) for bound in hist.bounds] + ["+Inf"]
    return HistogramMetricFamily(
        name, doc, buckets=list(zip(labels, hist.cumulative, strict=True)), sum_value=hist.sum
    )


def _bound_label(bound: float) -> str:
    return repr(float(bound))


def families(snap: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (pure: unit-tested from a hand-made snapshot)."""
    info = GaugeMetricFamily(
        "bookie_info", "Bookie identity (value 1)", labels=["bookie_id", "version", "protocol_version"]
    )
    info.add_metric([snap.bookie_id, snap.version, str(snap.protocol_version)], 1)
    yield info
    state = GaugeMetricFamily(
        "bookie_state", "1 for the bookie's current state, 0 for others", labels=["state"]
    )
    for candidate in BookieState:
        state.add_metric([candidate.value], 1 if candidate is snap.state else 0)
    yield state
    yield _gauge("bookie_ready", "1 once serving (and registered when metadata is set)", int(snap.ready))
    yield _gauge("bookie_healthy", "1 when /health answers 200", int(not health_problems(snap)))
    yield from _request_families(snap)
    yield from _journal_families(snap)
    yield from _network_families(snap)
    yield _gauge("bookie_ledgers", "Ledgers this bookie holds state for", snap.ledgers)
    yield _gauge(
        "bookie_limbo_ledgers",
        "Ledgers in limbo after a journal cut (reads of what is lacking answer EUNKNOWNLEDGERSTATE); "
        "-1: every ledger, until metadata is listed",
        snap.limbo_ledgers,
    )
    yield _gauge("bookie_long_poll_waiters", "Long-poll LAC reads parked", snap.long_poll_waiters)
    yield _gauge("bookie_disk_total_bytes", "Size of the data dir's filesystem", snap.disk.total_bytes)
    yield _gauge(
        "bookie_disk_free_bytes",
        "Free bytes (for this user) on the data dir's filesystem",
        snap.disk.free_bytes,
    )
    yield _gauge(
        "bookie_disk_read_only", "1 when the data dir is read-only or unusable", int(snap.disk.read_only)
    )
    yield _gauge(
        "bookie_read_only_mode", "1 while normal adds are refused (EREADONLY)", int(snap.read_only_mode)
    )
    yield _gauge(
        "bookie_read_only_manual",
        "1 while the operator holds the bookie read-only",
        int(snap.read_only_manual),
    )
    yield _counter(
        "bookie_mode_transitions", "Transitions between writable and read-only mode", snap.mode_transitions
    )
    yield from _gc_families(snap)


def _gc_families(snap: Snapshot) -> Iterator[Metric]:
    yield _gauge("bookie_gc_running", "1 while a garbage-collection pass runs", int(snap.gc_running))
    yield _counter("bookie_gc_passes", "Garbage-collection passes finished", snap.gc_passes)
    yield _counter(
        "bookie_gc_ledgers_collected",
        "Ledgers GC removed (deleted from metadata, or held here but listed elsewhere)",
        snap.gc_ledgers_collected,
    )
    yield _counter(
        "bookie_gc_over_replicated_collected",
        "Closed ledgers GC removed because metadata lists this bookie in none of their ensembles",
        snap.gc_over_replicated_collected,
    )
    yield _counter(
        "bookie_gc_orphans_collected",
        "Of those, orphans: copies no metadata ever listed here (a failed or retried re-replication)",
        snap.gc_orphans_collected,
    )
    yield _counter("bookie_gc_copied_bytes", "Bytes of live entries compaction copied", snap.gc_bytes_copied)
    yield _counter("bookie_gc_freed_bytes", "Bytes of journal segments GC deleted", snap.gc_bytes_freed)
    yield _counter("bookie_gc_deleted_segments", "Journal segments GC deleted", snap.gc_segments_deleted)


def _request_families(snap: Snapshot) -> Iterator[Metric]:
    requests = CounterMetricFamily("bookie_requests", "Requests received, by op", labels=["op"])
    for op, count in sorted(snap.requests.items()):
        requests.add_metric([op], count)
    yield requests
    yield _counter("bookie_read_entries", "Entries served by READ_ENTRY and BATCH_READ", snap.entries_read)
    errors = CounterMetricFamily(
        "bookie_request_errors",
        "Error responses, by wire status (EBADREQ includes closed bad frames)",
        labels=["status"],
    )
    for status, count in sorted(snap.errors.items()):
        errors.add_metric([status], count)
    yield errors


def _journal_families(snap: Snapshot) -> Iterator[Metric]:
    yield _histogram("bookie_journal_fsync_seconds", "Latency of each journal fdatasync", snap.journal_fsync)
    yield _histogram("bookie_journal_group_records", "Records per group commit", snap.journal_group_records)
    yield _histogram("bookie_journal_write_seconds", "Time of each group's journal write", snap.journal_write)
    yield _histogram(
        "bookie_journal_queue_wait_seconds",
        "Per group: from its first record appended to the group handed to the writer",
        snap.journal_queue_wait,
    )
    yield _histogram(
        "bookie_journal_completion_seconds",
        "Per group: completing its records after the fdatasync (index updates, answers)",
        snap.journal_completion,
    )
    yield _counter("bookie_journal_groups", "Group commits written and synced", snap.journal_groups)
    yield _counter("bookie_journal_records", "Records made durable by the journal", snap.journal_records)
    yield _counter(
        "bookie_journal_written_bytes", "Bytes written and synced by the journal", snap.journal_bytes
    )
    yield _gauge("bookie_journal_queue_bytes", "Bytes appended but not yet durable", snap.journal_queue_bytes)
    yield _gauge(
        "bookie_journal_queue_records", "Records waiting for an fdatasync", snap.journal_queue_records
    )
    yield _gauge(
        "bookie_journal_queue_max_bytes",
        "Backlog above which sockets stop being read",
        snap.journal_queue_bytes_max,
    )
    yield _gauge(
        "bookie_journal_pressure", "1 while the journal backlog holds reads", int(snap.journal_pressure)
    )
    yield _gauge("bookie_journal_failed", "1 after a journal I/O error", int(snap.journal_failed is not None))


def _network_families(snap: Snapshot) -> Iterator[Metric]:
    yield _gauge("bookie_connections", "Open client connections", snap.connections)
    yield _gauge("bookie_connections_max", "Client connection limit", snap.connections_max)
    yield _counter(
        "bookie_connections_refused",
        "Connections closed at accept (over connections_max or connections_per_address_max)",
        snap.connections_refused,
    )
    yield _counter(
        "bookie_connections_tarpitted",
        "Refused connections held unread before their reset instead of reset at once (bookie.tarpit)",
        snap.connections_tarpitted,
    )
    yield _gauge(
        "bookie_connections_held", "Refused connections held in the tarpit now", snap.connections_held
    )
    yield _gauge(
        "bookie_answer_bytes_held",
        "Answer bytes queued for clients that have not read them, all connections (answer_bytes_total_max)",
        snap.answer_bytes_held,
    )
    yield _counter(
        "bookie_answer_throttles",
        "Connections stopped for holding the most unread answers while over answer_bytes_total_max",
        snap.answer_throttles,
    )
    yield _gauge("bookie_in_flight_requests", "Requests received and not yet answered", snap.in_flight)
    yield _gauge("bookie_in_flight_requests_max", "In-flight limit across connections", snap.in_flight_max)
    yield _gauge(
        "bookie_sockets_paused", "1 while every connection's reading is paused", int(snap.sockets_paused)
    )


def make_registry(source: Callable[[], Snapshot]) -> CollectorRegistry:
    """A registry of its own (not the process-global default): the bookie's collector plus the
    standard process / platform / GC collectors (CPU seconds, memory, open fds)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BookieCollector(source))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition (content type :data:`CONTENT_TYPE_LATEST`)."""
    return generate_latest(registry)


def state_json(snap: Snapshot) -> dict[str, Any]:
    """``/state``: the snapshot as JSON-ready data (histograms as count + sum)."""
    return {
        "bookie_id": snap.bookie_id,
        "address": snap.address,
        "admin_address": snap.admin_address,
        "state": snap.state.value,
        "ready": snap.ready,
        "healthy": not health_problems(snap),
        "problems": health_problems(snap),
        "version": snap.version,
        "protocol_version": snap.protocol_version,
        "uptime_s": round(snap.uptime_s, 3),
        "pid": os.getpid(),
        "ledgers": snap.ledgers,
        "limbo_ledgers": snap.limbo_ledgers,
        "requests": snap.requests,
        "entries_read": snap.entries_read,
        "errors": snap.errors,
        "journal": {
            "groups": snap.journal_groups,
            "records": snap.journal_records,
            "written_bytes": snap.journal_bytes,
            "queue_bytes": snap.journal_queue_bytes,
            "queue_records": snap.journal_queue_records,
            "pressure": snap.journal_pressure,
            "failed": snap.journal_failed,
            "fsync_count": snap.journal_fsync.count,
            "fsync_seconds_sum": round(snap.journal_fsync.sum, 6),
            "write_seconds_sum": round(snap.journal_write.sum, 6),
            "queue_wait_seconds_sum": round(snap.journal_queue_wait.sum, 6),
            "completion_seconds_sum": round(snap.journal_completion.sum, 6),
        },
        "connections": snap.connections,
        "connections_refused": snap.connections_refused,
        "connections_tarpitted": snap.connections_tarpitted,
        "connections_held": snap.connections_held,
        "answer_bytes_held": snap.answer_bytes_held,
        "answer_throttles": snap.answer_throttles,
        "in_flight": snap.in_flight,
        "sockets_paused": snap.sockets_paused,
        "long_poll_waiters": snap.long_poll_waiters,
        "gc": {
            "running": snap.gc_running,
            "passes": snap.gc_passes,
            "ledgers_collected": snap.gc_ledgers_collected,
            "over_replicated_collected": snap.gc_over_replicated_collected,
            "orphans_collected": snap.gc_orphans_collected,
            "copied_bytes": snap.gc_bytes_copied,
            "freed_bytes": snap.gc_bytes_freed,
            "deleted_segments": snap.gc_segments_deleted,
        },
        "read_only": {
            "mode": "readonly" if snap.read_only_mode else "writable",
            "reason": snap.read_only_reason,
            "manual": snap.read_only_manual,
            "transitions": snap.mode_transitions,
            "registered_read_only": snap.registered_read_only,
        },
        "disk": {
            "total_bytes": snap.disk.total_bytes,
            "free_bytes": snap.disk.free_bytes,
            "read_only": snap.disk.read_only,
            "error": snap.disk.error,
        },
    }
