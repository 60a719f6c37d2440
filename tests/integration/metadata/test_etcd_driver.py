"""etcd-driver specifics: budgets, unreachable endpoints, endpoint failover, watch resume across restarts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

from metadata.errors import MetadataUnavailable, WatchCompacted
from metadata.etcd import EtcdConfig, EtcdStore
from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore
from metadata.store import EventKind, WatchEvent
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd


@pytest.fixture
def info_logged() -> None:
    """Info events reach ``capture_logs``: importing the client configures structlog at warning
    (the autouse fixture in tests/conftest.py restores the configuration after the test)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))


@pytest.fixture
def dead() -> Iterator[tuple[str, int]]:
    """An address that refuses connections for the whole test: bound, never listening, so no other
    test's etcd or bookie can take the port meanwhile (a port from free_port() could be)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield "127.0.0.1", held.getsockname()[1]


async def test_unreachable_store_fails_within_the_budget_and_stays_usable(
    etcd_server: EtcdCluster, dead: tuple[str, int], info_logged: None
) -> None:
    store = EtcdStore(EtcdConfig((dead,), op_timeout_s=0.5, connect_timeout_s=0.2))
    try:
        for operation in (lambda: store.get("/x"), lambda: store.create("/x", b"1")):
            started = time.monotonic()
            with pytest.raises(MetadataUnavailable), capture_logs() as logs:
                await operation()
            assert time.monotonic() - started < 1.5
            # One endpoint: nothing to switch to, so no "switched" line per backoff.
            assert not [line for line in logs if line["event"] == "metadata.etcd.endpoint_switched"]
    finally:
        await store.close()


async def test_dead_first_endpoint_fails_over_to_a_live_one(
    etcd_server: EtcdCluster, root: str, dead: tuple[str, int], info_logged: None
) -> None:
    store = EtcdStore(EtcdConfig((dead, *etcd_server.endpoints), op_timeout_s=3, connect_timeout_s=0.3))
    try:
        with capture_logs() as logs:
            version = await store.create(f"{root}/k", b"v")
        switched = [line for line in logs if line["event"] == "metadata.etcd.endpoint_switched"]
        # the first switch leaves the dead endpoint (a loaded machine may time out the live one too)
        assert switched, logs
        assert switched[0]["failed"] == "{}:{}".format(*dead)
        got = await store.get(f"{root}/k")
        assert got is not None
        assert got.version == version
    finally:
        await store.close()


async def test_cancelled_call_leaves_the_store_usable(etcd_server: EtcdCluster, root: str) -> None:
    store = EtcdStore(EtcdConfig(etcd_server.endpoints))
    try:
        task = asyncio.create_task(store.put(f"{root}/k", b"v"))
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert await store.create(f"{root}/k2", b"v") > 0
    finally:
        await store.close()


async def test_watch_resumes_after_an_etcd_outage_longer_than_its_budget_without_gaps_or_duplicates(
    etcd_private: EtcdCluster, root: str
) -> None:
    # The watcher's budget (0.5 s) is shorter than the outage (2 s): the watch must keep waiting.
    watcher_store = EtcdStore(EtcdConfig(etcd_private.endpoints, op_timeout_s=0.5, backoff_max_s=0.2))
    store = EtcdStore(EtcdConfig(etcd_private.endpoints, op_timeout_s=5))
    events: list[WatchEvent] = []
    try:
        start = await store.current_revision() + 1

        async def follow() -> None:
            watch = watcher_store.watch(f"{root}/", prefix=True, start_revision=start)
            async with contextlib.aclosing(watch) as stream:
                async for event in stream:
                    events.append(event)
                    if len(events) == 4:
                        return

        follower = asyncio.create_task(follow())
        await store.put(f"{root}/a", b"1")
        await asyncio.sleep(0.3)
        member = etcd_private.members[0]
        member.stop()
        await asyncio.sleep(2.0)
        assert not follower.done()
        member.start()
        await asyncio.to_thread(member.wait_ready)
        await store.put(f"{root}/b", b"2")
        await store.put(f"{root}/c", b"3")
        await store.delete(f"{root}/a")
        await asyncio.wait_for(follower, 15)
    finally:
        await store.close()
        await watcher_store.close()
    assert [(e.kind, e.key) for e in events] == [
        (EventKind.PUT, f"{root}/a"),
        (EventKind.PUT, f"{root}/b"),
        (EventKind.PUT, f"{root}/c"),
        (EventKind.DELETE, f"{root}/a"),
    ]


async def test_memory_watch_reports_compaction_and_ledger_watch_rereads() -> None:
    store = MemoryStore()
    manager = LedgerManager(store, "/r")
    created = await manager.create(("a", "b"), write_quorum=2, ack_quorum=1)
    raw = store.watch(manager.keys.ledger(created.ledger_id), start_revision=1)
    await manager.update(created.ledger_id, lambda md: md.in_recovery())
    store.compact()
    with pytest.raises(WatchCompacted):
        await anext(raw)
    await raw.aclose()

    updates = manager.watch(created.ledger_id)
    async with contextlib.aclosing(updates):
        assert await anext(updates) == await manager.read(created.ledger_id)
        await manager.update(created.ledger_id, lambda md: md.with_custom_metadata({"x": b"1"}))
        closed = await manager.update(created.ledger_id, lambda md: md.closed(-1, 0))
        store.compact()  # the history the watch would resume from is gone: it must re-read
        assert await anext(updates) == closed


async def test_a_stuck_member_costs_reads_and_lease_keepalives_one_attempt_not_the_budget(
    etcd_cluster3: EtcdCluster, root: str
) -> None:
    # A SIGSTOPped member keeps its TCP connection (the channel stays READY) but never answers: each
    # read must give up on it after one capped attempt and go on to a healthy member within its
    # budget, so a lease kept alive through the same store outlives the stall.
    store = EtcdStore(
        EtcdConfig(
            etcd_cluster3.endpoints,
            op_timeout_s=5.0,
        )
    )
    stuck = etcd_cluster3.members[0]  # the endpoint the store talks to first
    try:
        await store.put(f"{root}/k", b"v")
        lease = await store.grant_lease(2)
        await store.create(f"{root}/held", b"x", lease_id=lease)
        stuck.pause()
        try:
            for _ in range(4):  # > one lease TTL of keepalives, all through the store
                got = await store.get(f"{root}/k")
                assert got is not None
                assert got.value == b"v"
                assert await store.keepalive(lease) > 0
                await asyncio.sleep(0.6)
            held = await store.get(f"{root}/held")
            assert held is not None
            assert held.lease_id == lease
        finally:
            stuck.resume()
    finally:
        await store.close()
