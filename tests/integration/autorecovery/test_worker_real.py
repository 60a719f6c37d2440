"""A replication worker heals ledgers on real bookies (kill -9 one, mark, heal), verified by reading
every entry from every replica metadata lists afterwards."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.errors import NoPasswordForLedger, ReplicationError
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.errors import LedgerFenced
from metadata.ledger_metadata import LedgerState
from metadata.underreplication import UnderReplicated, UnderReplicationManager
from tests.integration.autorecovery.conftest import CONFIG, Cluster, verify_every_replica
from tests.unit.autorecovery.waiting import wait_until

pytestmark = pytest.mark.etcd

PASSWORD = b"pw"


def _worker(
    bk: BookKeeper, cluster: Cluster, **config: object
) -> tuple[ReplicationWorker, UnderReplicationManager]:
    urm = UnderReplicationManager(cluster.meta.store, cluster.root)
    settings = AutorecoveryConfig(passwords=(b"other", PASSWORD), **config)  # type: ignore[arg-type]
    return ReplicationWorker(bk, urm, settings, worker_id="w-test"), urm


async def _write(
    bk: BookKeeper, count: int, *, close: bool = True, ensemble: int = 3
) -> tuple[int, list[bytes]]:
    handle = await bk.create_ledger(ensemble, 2, 2, password=PASSWORD)
    payloads = [f"ledger {handle.id} entry {i} ".encode() * 3 for i in range(count)]
    for payload in payloads:
        await handle.append(payload)
    if close:
        await handle.close()
    return handle.id, payloads


async def test_heals_closed_ledgers_after_a_kill(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(4)
    ledgers = [await _write(bk, 40) for _ in range(3)]
    md = (await bk.context.ledgers.read(ledgers[0][0])).metadata
    victim = md.ensembles[0][1][1]
    await cluster.kill(victim)
    worker, urm = _worker(bk, cluster)
    marked = []
    for ledger_id, _ in ledgers:
        listed = (await bk.context.ledgers.read(ledger_id)).metadata.ensembles[0][1]
        if victim in listed:
            marked.append(await urm.mark(ledger_id, [victim], reason="lost"))
    assert marked
    for mark in marked:
        result = await worker.heal(mark)
        assert result.healed == (victim,)
        assert result.left == ()
        assert result.resolved
        assert result.copied.entries > 0
        assert await urm.get(mark.ledger_id) is None
    for ledger_id, payloads in ledgers:
        reads = await verify_every_replica(bk, ledger_id, PASSWORD, payloads, absent=[victim])
        assert reads == 2 * len(payloads)
    assert worker.metrics.ledgers_healed == len(marked)
    assert worker.metrics.bytes_copied > 0
    # the replacement's copies were read by the readers above; also through the public reader
    rh = await bk.open_ledger(ledgers[0][0], password=PASSWORD)
    assert [e.payload async for e in rh.read()] == ledgers[0][1]


async def test_open_ledger_is_fenced_only_after_the_grace(cluster: Cluster, bk: BookKeeper) -> None:
    """The writer is a client of its own (as it is in production: another process)."""
    await cluster.start(4)
    writer = await BookKeeper.connect(cluster.url, config=CONFIG)
    try:
        async with asyncio.timeout(60):  # a hang fails with the step it hung in
            await _fenced_only_after_the_grace(cluster, bk, writer)
    finally:
        writer.abort()
        await writer.context.ledgers.store.close()


async def _fenced_only_after_the_grace(cluster: Cluster, bk: BookKeeper, writer: BookKeeper) -> None:
    handle = await writer.create_ledger(3, 2, 2, password=PASSWORD)
    payloads = [f"open entry {i}".encode() for i in range(25)]
    for payload in payloads:
        await handle.append(payload)
    md = (await bk.context.ledgers.read(handle.id)).metadata
    victim = md.current_ensemble[0]
    await cluster.kill(victim)
    within, urm = _worker(bk, cluster, open_ledger_grace_s=3600)
    mark = await urm.mark(handle.id, [victim], reason="lost")
    result = await within.heal(mark)
    assert result.left == (victim,)  # the writer's fragment is left alone within the grace
    assert not result.fenced
    assert (await bk.context.ledgers.read(handle.id)).metadata.state is LedgerState.OPEN
    after_grace, _ = _worker(bk, cluster, open_ledger_grace_s=0, lost_bookie_recovery_delay_s=0)
    result = await after_grace.heal((await urm.get(handle.id)) or mark)
    assert result.fenced
    assert result.resolved
    with pytest.raises(LedgerFenced):
        await handle.append(b"after the fence")
    await verify_every_replica(bk, handle.id, PASSWORD, payloads, absent=[victim])


async def test_open_ledgers_writer_moves_on_and_the_closed_fragments_are_healed(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(5)
    handle = await bk.create_ledger(3, 2, 2, password=PASSWORD)
    payloads = [f"moving entry {i}".encode() for i in range(20)]
    for payload in payloads:
        await handle.append(payload)
    victim = (await bk.context.ledgers.read(handle.id)).metadata.current_ensemble[2]
    await cluster.kill(victim)
    more = [f"after the kill {i}".encode() for i in range(10)]
    for payload in more:
        await handle.append(payload)  # the writer replaces the dead bookie itself
    worker, urm = _worker(bk, cluster, open_ledger_grace_s=3600)
    result = await worker.heal(await urm.mark(handle.id, [victim], reason="lost"))
    assert result.healed == (victim,)
    assert not result.fenced
    assert result.fragments == 1
    more2 = [b"still writing"]
    await handle.append(more2[0])
    await handle.close()
    await verify_every_replica(bk, handle.id, PASSWORD, payloads + more + more2, absent=[victim])


async def test_a_ledger_without_a_known_password_keeps_its_mark(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(4)
    handle = await bk.create_ledger(3, 2, 2, password=b"secret-nobody-gave")
    await handle.append(b"x")
    await handle.close()
    victim = (await bk.context.ledgers.read(handle.id)).metadata.current_ensemble[0]
    worker, urm = _worker(bk, cluster)
    mark = await urm.mark(handle.id, [victim], reason="operator")
    with pytest.raises(NoPasswordForLedger):
        await worker.heal(mark)
    assert await urm.get(handle.id) == mark


async def test_an_entry_no_survivor_has_is_never_given_up(cluster: Cluster, bk: BookKeeper) -> None:
    """E3/Qw2: killing both replicas of entry 0 leaves no copy to read: the copy fails (retriable:
    the bookies may come back), the fragment keeps its bookies and the mark stays."""
    await cluster.start(5)
    ledger_id, _ = await _write(bk, 6)
    md = (await bk.context.ledgers.read(ledger_id)).metadata
    ensemble = md.ensembles[0][1]
    lost = [ensemble[0], ensemble[1]]  # the write set of entry 0
    for bookie_id in lost:
        await cluster.kill(bookie_id)
    worker, urm = _worker(bk, cluster)
    mark = await urm.mark(ledger_id, lost, reason="lost")
    with pytest.raises(ReplicationError, match="entry 0"):
        await worker.heal(mark)
    after = (await bk.context.ledgers.read(ledger_id)).metadata
    assert after.ensembles == md.ensembles
    assert (await urm.get(ledger_id)) == mark


async def test_a_deleted_ledgers_mark_goes(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    ledger_id, _ = await _write(bk, 2)
    worker, urm = _worker(bk, cluster)
    mark = await urm.mark(ledger_id, ["b0"], reason="check")
    await bk.delete_ledger(ledger_id, password=PASSWORD)
    result = await worker.heal(mark)
    assert result.deleted
    assert await urm.get(ledger_id) is None


async def test_two_workers_never_heal_the_same_ledger_at_once(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(4)
    ledgers = [await _write(bk, 8) for _ in range(6)]
    victim = "b3"
    await cluster.kill(victim)
    urm = UnderReplicationManager(cluster.meta.store, cluster.root)
    marked = set()
    for ledger_id, _ in ledgers:
        md = (await bk.context.ledgers.read(ledger_id)).metadata
        if victim in md.ensembles[0][1]:
            await urm.mark(ledger_id, [victim], reason="lost")
            marked.add(ledger_id)
    assert marked
    config = AutorecoveryConfig(passwords=(PASSWORD,), worker_idle_poll_s=0.1)
    healing: dict[int, str] = {}
    overlaps: list[int] = []
    healed_by: dict[int, str] = {}
    workers = [ReplicationWorker(bk, urm, config, worker_id=f"w{i}") for i in range(2)]
    for worker in workers:
        original = worker.heal

        async def heal(
            mark: UnderReplicated, lock: Any = None, *, original: Any = original, name: str = worker.worker_id
        ) -> Any:
            if mark.ledger_id in healing:
                overlaps.append(mark.ledger_id)
            healing[mark.ledger_id] = name
            try:
                await asyncio.sleep(0.05)  # widen the window a second worker would have to slip in
                result = await original(mark, lock)
                healed_by[mark.ledger_id] = name
                return result
            finally:
                del healing[mark.ledger_id]

        worker.heal = heal  # type: ignore[method-assign]
    leases = [await cluster.meta.store.grant_lease(10) for _ in workers]
    tasks = [
        asyncio.create_task(w.run(functools.partial(int, lease)))
        for w, lease in zip(workers, leases, strict=True)
    ]
    try:

        async def done() -> bool:
            return await urm.count() == 0

        await wait_until(done, timeout_s=30)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for lease in leases:
            await cluster.meta.store.revoke_lease(lease)
    assert overlaps == []
    assert set(healed_by) == marked
    for ledger_id, payloads in ledgers:
        await verify_every_replica(bk, ledger_id, PASSWORD, payloads, absent=[victim])
