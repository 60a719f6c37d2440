"""The open-ledger grace period counts from when the writer's bookie was first marked, not from the
ledger's first mark (an older mark for another bookie must not make the fence come early)."""

from __future__ import annotations

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from metadata.memory import MemoryStore
from metadata.underreplication import UnderReplicationManager

ROOT = "/bookkeeper/grace"


async def test_grace_counts_from_the_bookies_own_mark() -> None:
    store = MemoryStore()
    now = [1_000_000]
    urm = UnderReplicationManager(store, ROOT, now_ms=lambda: now[0])
    ledgers = LedgerManager(store, ROOT)
    bk = BookKeeper(ledgers, StaticDirectory(["a", "b", "c", "d"]))
    try:
        created = await ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
        await urm.mark(created.ledger_id, ["gone-long-ago"], reason="check")
        now[0] += 100_000
        await urm.mark(created.ledger_id, ["b"], reason="lost")  # b is in the writer's fragment
        now[0] += 10_000
        worker = ReplicationWorker(
            bk, urm, AutorecoveryConfig(open_ledger_grace_s=30), worker_id="w", now_ms=lambda: now[0]
        )
        mark = await urm.get(created.ledger_id)
        assert mark is not None
        result = await worker.heal(mark)
        assert not result.fenced  # 10 s after b's mark, although 110 s after the ledger's first
        assert result.healed == ("gone-long-ago",)
        assert result.left == ("b",)
        assert (await ledgers.read(created.ledger_id)).metadata.state is LedgerState.OPEN
        left = await urm.get(created.ledger_id)
        assert left is not None
        assert left.missing == ("b",)
        assert left.since_ms("b") == 1_100_000
    finally:
        await bk.close()


async def test_a_mark_stamped_by_a_clock_behind_this_workers_does_not_shorten_the_grace() -> None:
    """The auditor that marked b runs 60 s behind this worker: by the stamp alone the 30 s grace
    has long passed and the writer's ledger would be fenced at once. The worker counts the grace on
    its own clock from when it first saw the mark."""
    store = MemoryStore()
    auditor_now = [1_000_000]
    urm = UnderReplicationManager(store, ROOT, now_ms=lambda: auditor_now[0])
    ledgers = LedgerManager(store, ROOT)
    bk = BookKeeper(ledgers, StaticDirectory(["a", "b", "c", "d"]))
    local = [500.0]
    try:
        created = await ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
        await urm.mark(created.ledger_id, ["b"], reason="lost")
        worker = ReplicationWorker(
            bk,
            urm,
            AutorecoveryConfig(open_ledger_grace_s=30, worker_idle_poll_s=1),
            worker_id="w",
            now_ms=lambda: auditor_now[0] + 60_000,
            monotonic_s=lambda: local[0],
        )
        mark = await urm.get(created.ledger_id)
        assert mark is not None
        first = await worker.heal(mark)
        assert not first.fenced
        assert first.left == ("b",)
        assert first.wait_s == 30  # the whole grace, on this worker's clock
        local[0] += 20
        second = await worker.heal(mark)
        assert not second.fenced
        assert second.wait_s == 10
        assert (await ledgers.read(created.ledger_id)).metadata.state is LedgerState.OPEN
    finally:
        await bk.close()
