"""Acceptance scenarios of issue 3 with several client processes and real etcd (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import pytest

from metadata.bookies import BookieSet, list_bookies, watch_bookies
from metadata.cluster import connect
from metadata.errors import MetadataUnavailable
from metadata.ledger_manager import LedgerManager
from tests.harness.etcd import EtcdCluster, require_etcd_binary
from tests.integration.metadata.procs import Worker

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

BOOKIES = ("127.0.0.1:3181", "127.0.0.1:3182", "127.0.0.1:3183")


async def test_cas_increments_from_50_tasks_in_4_processes_lose_nothing(
    etcd_server: EtcdCluster, root: str
) -> None:
    url = etcd_server.url(root)
    async with connect(url) as conn:
        manager = LedgerManager(conn.store, conn.root)
        ledger = await manager.create(BOOKIES, write_quorum=2, ack_quorum=2)
        tasks_per_process, per_task = [13, 13, 12, 12], 4
        workers = [
            await Worker.spawn("increment", url, str(ledger.ledger_id), str(tasks), str(per_task))
            for tasks in tasks_per_process
        ]
        try:
            for worker in workers:
                await worker.expect("done", timeout_s=120)
        finally:
            for worker in workers:
                await worker.reap()
        final = await manager.read(ledger.ledger_id)
    assert sum(tasks_per_process) == 50
    assert int(final.metadata.custom_metadata["count"]) == 50 * per_task


@pytest.mark.parametrize("restart", ["graceful", "kill9"])
async def test_ids_from_4_processes_across_an_etcd_restart_are_unique(
    restart: str, root: str, tmp_path: Path
) -> None:
    # SIGKILL only on a crash-safe etcd (3.5.0-3.5.5 have crash bugs, etcd-io/etcd#13766).
    etcd = EtcdCluster(require_etcd_binary(crash_safe=restart == "kill9")).start()
    url = etcd.url(root) + "?op_timeout_s=2"
    outputs = [tmp_path / f"ids-{i}.txt" for i in range(4)]
    workers = [await Worker.spawn("ids", url, "2500", str(out)) for out in outputs]
    try:
        for worker in workers:
            await worker.expect("ready")
        await workers[0].expect("progress 500", timeout_s=60)
        member = etcd.members[0]
        member.kill9() if restart == "kill9" else member.stop()
        # Down longer than the workers' 2 s op budget: their retries inside one call cannot hide
        # the outage, so every worker that is still drawing ids sees MetadataUnavailable.
        await asyncio.sleep(3.0)
        member.start()
        await asyncio.to_thread(member.wait_ready)
        dones = [await worker.expect("done", timeout_s=120) for worker in workers]
    finally:
        for worker in workers:
            await worker.reap()
        etcd.stop()
    # The restart really hit the workers mid-run: they saw the store unavailable and carried on.
    assert sum(int(done.split()[-1]) for done in dones) > 0
    ids = [int(line) for out in outputs for line in out.read_text().split()]
    assert len(ids) == 10_000
    assert len(set(ids)) == 10_000
    assert all(0 < i < 2**63 for i in ids)


async def _wait_until(predicate: object, timeout_s: float) -> float:
    started = time.monotonic()
    while not await predicate():  # type: ignore[operator]
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_killed_bookie_disappears_within_ttl_and_watcher_sees_it(
    etcd_server: EtcdCluster, root: str
) -> None:
    url, ttl_s = etcd_server.url(root), 2
    worker = await Worker.spawn("register", url, "127.0.0.1:4001", str(ttl_s))
    snapshots: list[BookieSet] = []
    async with connect(url) as conn:

        async def follow() -> None:
            async with contextlib.aclosing(watch_bookies(conn.store, conn.root)) as updates:
                async for snapshot in updates:
                    snapshots.append(snapshot)

        follower = asyncio.create_task(follow())
        try:
            await worker.expect("registered 1")

            async def present() -> bool:
                return "127.0.0.1:4001" in (await list_bookies(conn.store, conn.root)).writable

            async def gone() -> bool:
                return not await present()

            assert await present()
            worker.signal(signal.SIGKILL)
            elapsed_s = await _wait_until(gone, timeout_s=ttl_s + 3)
            await asyncio.sleep(0.3)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            await worker.reap()
    assert elapsed_s <= ttl_s + 1.5
    assert any("127.0.0.1:4001" in s.writable for s in snapshots)
    assert "127.0.0.1:4001" not in snapshots[-1].writable


async def test_paused_bookie_reregisters_after_its_lease_expired(etcd_server: EtcdCluster, root: str) -> None:
    url, ttl_s = etcd_server.url(root), 2
    worker = await Worker.spawn("register", url, "127.0.0.1:4002", str(ttl_s))
    try:
        await worker.expect("registered 1")
        async with connect(url) as conn:

            async def present() -> bool:
                return "127.0.0.1:4002" in (await list_bookies(conn.store, conn.root)).writable

            async def gone() -> bool:
                return not await present()

            worker.signal(signal.SIGSTOP)
            await _wait_until(gone, timeout_s=ttl_s + 3)
            worker.signal(signal.SIGCONT)
            await worker.expect("registered 2", timeout_s=15)
            await _wait_until(present, timeout_s=5)
    finally:
        await worker.reap()


async def test_three_member_cluster_survives_one_kill_and_fails_fast_without_majority(
    etcd_cluster3: EtcdCluster, root: str
) -> None:
    op_timeout_s = 2.0
    url = etcd_cluster3.url(root) + f"?op_timeout_s={op_timeout_s}"
    async with connect(url) as conn:
        manager = LedgerManager(conn.store, conn.root)
        first = await manager.create(BOOKIES, write_quorum=2, ack_quorum=2)
        etcd_cluster3.members[0].kill9()  # the endpoint the client talks to first
        created = [await manager.create(BOOKIES, write_quorum=2, ack_quorum=2) for _ in range(10)]
        for ledger in [first, *created]:
            closed = await manager.update(ledger.ledger_id, lambda md: md.closed(-1, 0))
            assert closed.metadata.is_closed
        assert len([i async for i in manager.iter_ledger_ids()]) == 11

        etcd_cluster3.members[1].kill9()  # majority down
        for operation in (
            lambda: manager.read(first.ledger_id),
            lambda: manager.create(BOOKIES, write_quorum=2, ack_quorum=2),
        ):
            started = time.monotonic()
            with pytest.raises(MetadataUnavailable):
                await operation()
            assert time.monotonic() - started < op_timeout_s + 1.0
