"""Client metrics hooks (bookkeeper_aio.client.metrics): the right calls, once per operation, through
fake-bookie scenarios; the Prometheus exporter's names and values."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bookkeeper_aio import (
    BookKeeper,
    ClientMetrics,
    DigestError,
    LedgerFenced,
    PrometheusClientMetrics,
    RandomPlacement,
)
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.client.metrics import LATENCY_SECONDS_BOUNDS
from metadata.ledger_manager import LedgerManager
from tests.harness.fake_bookie import FakeCluster
from tests.unit.client.conftest import FAST

CONFIG = dataclasses.replace(FAST, explicit_lac_interval_ms=0)  # recovery finds a known LAC


class Recording(ClientMetrics):
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def add_completed(self, latency_s: float) -> None:
        self.calls.append(("add_completed", latency_s))

    def add_failed(self, error: BaseException) -> None:
        self.calls.append(("add_failed", error))

    def ensemble_changed(self, ledger_id: int) -> None:
        self.calls.append(("ensemble_changed", ledger_id))

    def read_completed(self, latency_s: float) -> None:
        self.calls.append(("read_completed", latency_s))

    def read_failed(self, error: BaseException) -> None:
        self.calls.append(("read_failed", error))

    def recovery_finished(self, ledger_id: int, seconds: float, entries: int) -> None:
        self.calls.append(("recovery_finished", (ledger_id, seconds, entries)))

    def of(self, name: str) -> list[object]:
        return [value for call, value in self.calls if call == name]

    def names(self) -> list[str]:
        return [call for call, _ in self.calls]


def client(ledgers: LedgerManager, cluster: FakeCluster, metrics: ClientMetrics | None) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory(cluster.ids),
        config=CONFIG,
        placement=RandomPlacement(random.Random(7)),
        metrics=metrics,
    )


@pytest.fixture
async def recorded(
    ledgers: LedgerManager, cluster: FakeCluster
) -> AsyncIterator[tuple[BookKeeper, Recording]]:
    metrics = Recording()
    bk = client(ledgers, cluster, metrics)
    yield bk, metrics
    await bk.close()


async def test_writes__one_add_completed_per_add_not_per_ack(
    recorded: tuple[BookKeeper, Recording],
) -> None:
    bk, metrics = recorded
    lh = await bk.create_ledger(3, 3, 2)  # three acks per entry, two needed
    for i in range(5):
        await lh.append(b"%d" % i)
    futures = [await lh.append_async(b"%d" % i) for i in range(5, 20)]
    await asyncio.gather(*futures)
    await asyncio.sleep(0.05)  # late third acks arrive: no further calls
    latencies = metrics.of("add_completed")
    assert len(latencies) == 20
    assert all(isinstance(x, float) and 0 <= x < 1.0 for x in latencies)
    assert metrics.names() == ["add_completed"] * 20
    await lh.close()


async def test_ensemble_change__reported_once_and_adds_still_complete_once(
    recorded: tuple[BookKeeper, Recording], cluster: FakeCluster
) -> None:
    bk, metrics = recorded
    lh = await bk.create_ledger(3, 2, 2)
    for i in range(5):
        await lh.append(b"%d" % i)
    await cluster.by_id(lh.metadata.current_ensemble[0]).kill()
    futures = [await lh.append_async(b"%d" % i) for i in range(5, 30)]
    assert await asyncio.gather(*futures) == list(range(5, 30))
    assert metrics.of("ensemble_changed") == [lh.id]
    assert len(metrics.of("add_completed")) == 30
    assert metrics.of("add_failed") == []
    await lh.close()


async def test_failed_adds__one_add_failed_per_add(
    recorded: tuple[BookKeeper, Recording], cluster: FakeCluster
) -> None:
    bk, metrics = recorded
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    await lh.append(b"a")
    for bookie in cluster.bookies:
        if lh.id in bookie.ledgers:
            bookie.ledgers[lh.id].fenced = True
    futures = [await lh.append_async(b"b") for _ in range(3)]
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert all(isinstance(r, LedgerFenced) for r in results)
    failed = metrics.of("add_failed")
    assert len(failed) == 3
    assert all(isinstance(e, LedgerFenced) for e in failed)
    assert len(metrics.of("add_completed")) == 1
    lh.abort()


async def test_reads__one_call_per_entry_and_failures_after_every_replica(
    recorded: tuple[BookKeeper, Recording], cluster: FakeCluster
) -> None:
    bk, metrics = recorded
    lh = await bk.create_ledger(3, 2, 2)
    for i in range(10):
        await lh.append(b"%d" % i)
    await lh.close()
    for bookie in cluster.bookies:
        bookie.corrupt_reads.add((lh.id, 7))
    metrics.calls.clear()
    rh = await bk.open_ledger(lh.id)
    assert [(await rh.read_entry(i)).payload for i in range(5)] == [b"%d" % i for i in range(5)]
    assert [e.payload async for e in rh.read(0, 6)] == [b"%d" % i for i in range(7)]
    assert len(metrics.of("read_completed")) == 12
    assert all(isinstance(x, float) and x >= 0 for x in metrics.of("read_completed"))
    with pytest.raises(DigestError):
        await rh.read_entry(7)  # both replicas corrupt
    (failure,) = metrics.of("read_failed")
    assert isinstance(failure, DigestError)
    assert set(metrics.names()) == {"read_completed", "read_failed"}


async def test_recovery__recovery_finished_with_the_entries_it_wrote_back(
    recorded: tuple[BookKeeper, Recording],
) -> None:
    bk, metrics = recorded
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    for i in range(5):
        await lh.append(b"%d" % i)  # entry 4 is known only to carry LAC 3: recovery finds entry 4
    metrics.calls.clear()
    rh = await bk.open_ledger(lh.id, password=b"pw", recovery=True)
    assert rh.last_add_confirmed == 4
    (finished,) = metrics.of("recovery_finished")
    assert isinstance(finished, tuple)
    ledger_id, seconds, entries = finished
    assert ledger_id == lh.id
    assert 0 <= seconds < 5
    assert entries == 1
    lh.abort()


async def test_no_metrics__nothing_is_recorded_and_adds_carry_no_start_time(
    ledgers: LedgerManager, cluster: FakeCluster
) -> None:
    bk = client(ledgers, cluster, None)
    assert bk.context.metrics is None
    lh = await bk.create_ledger(3, 2, 2)
    for bookie_id in lh.metadata.current_ensemble:
        cluster.by_id(bookie_id).pause()
    future = await lh.append_async(b"x")
    assert not hasattr(lh._pending[0], "started")  # no clock read per add without metrics
    for bookie_id in lh.metadata.current_ensemble:
        cluster.by_id(bookie_id).resume()
    assert await future == 0
    await lh.close()
    await bk.close()


async def test_base_class_hooks_are_no_ops(ledgers: LedgerManager, cluster: FakeCluster) -> None:
    bk = client(ledgers, cluster, ClientMetrics())
    lh = await bk.create_ledger(3, 2, 2)
    assert await lh.append(b"x") == 0
    await lh.close()
    rh = await bk.open_ledger(lh.id)
    assert (await rh.read_entry(0)).payload == b"x"
    await bk.close()


# ---------------------------------------------------------------------------------- Prometheus
NAMES = [
    "bookkeeper_client_add_latency_seconds",
    "bookkeeper_client_add_failures_total",
    "bookkeeper_client_ensemble_changes_total",
    "bookkeeper_client_explicit_lacs_total",
    "bookkeeper_client_read_latency_seconds",
    "bookkeeper_client_read_failures_total",
    "bookkeeper_client_recovery_duration_seconds",
    "bookkeeper_client_recovered_entries_total",
]


def test_prometheus__exposes_every_metric_name_with_units() -> None:
    registry = CollectorRegistry()
    PrometheusClientMetrics(registry)
    text = generate_latest(registry).decode()
    for name in NAMES:
        assert f"# TYPE {name} " in text, name
    assert 'bookkeeper_client_add_latency_seconds_bucket{le="+Inf"} 0.0' in text
    assert registry.get_sample_value("bookkeeper_client_ensemble_changes_total") == 0


def test_prometheus__values_buckets_and_labels() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusClientMetrics(registry)
    for latency in (0.0001, 0.001, 0.001, 0.003, 20.0):
        metrics.add_completed(latency)
    metrics.add_failed(LedgerFenced("x"))
    metrics.add_failed(LedgerFenced("y"))
    metrics.ensemble_changed(1)
    metrics.read_completed(0.002)
    metrics.read_failed(DigestError("z"))
    metrics.recovery_finished(1, 0.3, 4)
    value = registry.get_sample_value
    assert value("bookkeeper_client_add_latency_seconds_count") == 5
    assert value("bookkeeper_client_add_latency_seconds_sum") == pytest.approx(20.0051)
    assert value("bookkeeper_client_add_latency_seconds_bucket", {"le": "0.0001"}) == 1  # le: <=
    assert value("bookkeeper_client_add_latency_seconds_bucket", {"le": "0.001"}) == 3
    assert value("bookkeeper_client_add_latency_seconds_bucket", {"le": "0.005"}) == 4
    assert value("bookkeeper_client_add_latency_seconds_bucket", {"le": "10.0"}) == 4
    assert value("bookkeeper_client_add_latency_seconds_bucket", {"le": "+Inf"}) == 5
    assert value("bookkeeper_client_add_failures_total", {"error": "LedgerFenced"}) == 2
    assert value("bookkeeper_client_ensemble_changes_total") == 1
    assert value("bookkeeper_client_read_latency_seconds_count") == 1
    assert value("bookkeeper_client_read_failures_total", {"error": "DigestError"}) == 1
    assert value("bookkeeper_client_recovery_duration_seconds_count") == 1
    assert value("bookkeeper_client_recovered_entries_total") == 4
    buckets = [
        k for k in generate_latest(registry).decode().splitlines() if "add_latency_seconds_bucket" in k
    ]
    assert len(buckets) == len(LATENCY_SECONDS_BOUNDS) + 1


def test_prometheus__one_instance_per_registry_and_unregister() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusClientMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusClientMetrics(registry)
    metrics.unregister()
    PrometheusClientMetrics(registry)


async def test_prometheus__through_a_client(ledgers: LedgerManager, cluster: FakeCluster) -> None:
    registry = CollectorRegistry()
    bk = client(ledgers, cluster, PrometheusClientMetrics(registry))
    lh = await bk.create_ledger(3, 2, 2)
    for i in range(5):
        await lh.append(b"%d" % i)
    await cluster.by_id(lh.metadata.current_ensemble[1]).kill()
    await asyncio.gather(*[await lh.append_async(b"x") for _ in range(5)])
    await lh.close()
    rh = await bk.open_ledger(lh.id)
    assert len([e async for e in rh.read()]) == 10
    value = registry.get_sample_value
    assert value("bookkeeper_client_add_latency_seconds_count") == 10
    assert value("bookkeeper_client_ensemble_changes_total") == 1
    assert value("bookkeeper_client_read_latency_seconds_count") == 10
    await bk.close()
