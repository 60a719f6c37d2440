"""A replication worker survives what metadata and peers throw at it, and does not fence a writer
whose bookie came back (tests against the in-memory metadata twin)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgpack

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.context import StaticDirectory
from metadata.bookies import BookieInfo, BookieRegistration
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from metadata.memory import MemoryStore
from metadata.underreplication import UnderReplicationManager

ROOT = "/bookkeeper/resilience"


async def test_a_metadata_timeout_does_not_end_the_worker() -> None:
    """A ledger CAS slower than ``metadata_timeout_s`` (an etcd election) fails that heal with a
    TimeoutError; the worker retries it and heals the ledger once metadata is quick again."""
    store = MemoryStore()
    urm = UnderReplicationManager(store, ROOT)
    ledgers = LedgerManager(store, ROOT)
    bk = BookKeeper(
        ledgers, StaticDirectory(["a", "b", "c", "d"]), config=ClientConfig(metadata_timeout_s=0.05)
    )
    created = await ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
    await ledgers.update(created.ledger_id, lambda md: md.closed(-1, 0))  # closed and empty
    await urm.mark(created.ledger_id, ["b"], reason="lost")
    slow = True
    cas = store.compare_and_set

    async def slow_cas(*args: Any, **kwargs: Any) -> Any:
        if slow and "/ledgers/" in args[0]:
            await asyncio.sleep(0.3)
        return await cas(*args, **kwargs)

    store.compare_and_set = slow_cas  # type: ignore[method-assign]
    lease = await store.grant_lease(30)
    config = AutorecoveryConfig(worker_idle_poll_s=0.05, ledger_retry_s=0.05)
    worker = ReplicationWorker(bk, urm, config, worker_id="w0")
    task = asyncio.get_running_loop().create_task(worker.run(lambda: lease))
    try:
        for _ in range(100):
            if worker.metrics.heal_failures:
                break
            await asyncio.sleep(0.05)
        assert worker.metrics.heal_failures >= 1  # the timeout was met
        slow = False
        for _ in range(200):
            if await urm.get(created.ledger_id) is None:
                break
            await asyncio.sleep(0.05)
        assert not task.done()
        assert await urm.get(created.ledger_id) is None  # healed after all
        healed = await ledgers.read(created.ledger_id)
        assert "b" not in healed.metadata.ensembles[0][1]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await bk.close()


async def test_an_open_ledger_whose_bookie_is_back_is_not_fenced() -> None:
    """Past the grace, an idle writer's ledger is fenced only while a marked bookie of its last
    fragment is still not registered: one that came back (a restart longer than the lost-bookie
    delay) serves its writer, which must not be fenced for it."""
    store = MemoryStore()
    now = [1_000_000]
    urm = UnderReplicationManager(store, ROOT, now_ms=lambda: now[0])
    ledgers = LedgerManager(store, ROOT)
    bk = BookKeeper(ledgers, StaticDirectory(["a", "b", "c", "d"]))
    fenced: list[int] = []

    async def open_ledger(ledger_id: int, **_: Any) -> None:
        fenced.append(ledger_id)
        raise RuntimeError("fenced")

    bk.open_ledger = open_ledger  # type: ignore[method-assign,assignment]
    registrations = [
        BookieRegistration(store, ROOT, BookieInfo(name, "127.0.0.1", 4000 + i), stale_wait_s=0)
        for i, name in enumerate("abc")
    ]
    try:
        for registration in registrations:
            await registration.start()
        created = await ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
        await urm.mark(created.ledger_id, ["b"], reason="lost")
        config = AutorecoveryConfig(open_ledger_grace_s=30)
        worker = ReplicationWorker(bk, urm, config, worker_id="w", now_ms=lambda: now[0])
        mark = await urm.get(created.ledger_id)
        assert mark is not None
        assert (await worker.heal(mark)).wait_s == 30  # seen: the grace starts
        now[0] += 31_000  # the grace (30 s) is over
        result = await worker.heal(mark)
        assert not fenced
        assert not result.fenced
        assert result.left == ("b",)
        assert result.wait_s >= 30  # looked at again later
        assert (await ledgers.read(created.ledger_id)).metadata.state is LedgerState.OPEN
        await registrations[1].close()  # b is gone after all (or restarting)
        mark = await urm.get(created.ledger_id)  # found back: its grace started anew
        assert mark is not None
        assert not (await worker.heal(mark)).fenced  # a look in a restart fences nothing
        now[0] += 30_000  # unregistered for the lost-bookie delay: now the idle writer is fenced
        with contextlib.suppress(RuntimeError):
            await worker.heal(mark)
        assert fenced == [created.ledger_id]
    finally:
        for registration in registrations:
            await registration.close()
        await bk.close()


async def test_an_undecodable_mark_is_skipped_not_a_stop() -> None:
    """A mark a newer daemon wrote (or a damaged one) is passed to ``on_undecodable`` and skipped:
    the marks after it, on the same page and the next, are still listed and counted."""
    store = MemoryStore()
    urm = UnderReplicationManager(store, ROOT)
    for ledger_id in (5, 7, 9):
        await urm.mark(ledger_id, ["b"], reason="lost")
    await store.put(urm.keys.underreplicated(1), msgpack.packb({"format_version": 99, "missing": ["b"]}))
    await store.put(urm.keys.underreplicated(8), b"\xff not msgpack")
    skipped: list[int] = []
    listed = [
        m.ledger_id async for m in urm.iter_marks(page_size=2, on_undecodable=lambda i, _: skipped.append(i))
    ]
    assert listed == [5, 7, 9]
    assert skipped == [1, 8]
    assert await urm.count() == 5


async def _open_ledger_marked(
    store: MemoryStore, urm: UnderReplicationManager, ledgers: LedgerManager, marks: list[tuple[str, str]]
) -> tuple[int, list[BookieRegistration]]:
    """An open ledger on a, b, c (all registered), marked for each ``(bookie, reason)``."""
    registrations = [
        BookieRegistration(store, ROOT, BookieInfo(name, "127.0.0.1", 4000 + i), stale_wait_s=0)
        for i, name in enumerate("abc")
    ]
    for registration in registrations:
        await registration.start()
    created = await ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
    for bookie, reason in marks:
        await urm.mark(created.ledger_id, [bookie], reason=reason)
    return created.ledger_id, registrations


async def test_an_open_ledger_on_a_replaced_bookie_is_fenced_though_it_is_registered() -> None:
    """A bookie back with a wiped disk (marked ``replaced``) lost its copies of the writer's
    fragment: past the grace an abandoned writer's ledger is fenced and healed, not left at one
    copy fewer for good as a restarted bookie's would be. Per bookie: a restarted bookie in the
    same mark keeps its exemption."""
    store = MemoryStore()
    now = [1_000_000]
    urm = UnderReplicationManager(store, ROOT, now_ms=lambda: now[0])
    ledgers = LedgerManager(store, ROOT)
    bk = BookKeeper(ledgers, StaticDirectory(["a", "b", "c", "d"]))
    fenced: list[int] = []

    async def open_ledger(ledger_id: int, **_: Any) -> None:
        fenced.append(ledger_id)
        raise RuntimeError("fenced")

    bk.open_ledger = open_ledger  # type: ignore[method-assign,assignment]
    registrations: list[BookieRegistration] = []
    try:
        # b restarted (lost, back); "gone" (in no fragment) was replaced: b is still exempt
        restarted, registrations = await _open_ledger_marked(
            store, urm, ledgers, [("b", "lost"), ("gone", "replaced")]
        )
        worker = ReplicationWorker(
            bk, urm, AutorecoveryConfig(open_ledger_grace_s=30), worker_id="w", now_ms=lambda: now[0]
        )
        mark = await urm.get(restarted)
        assert mark is not None
        await worker.heal(mark)  # seen: the grace starts
        now[0] += 31_000  # the grace (30 s) is over
        result = await worker.heal(mark)
        assert not fenced
        assert result.left == ("b",)
        for registration in registrations:
            await registration.close()
        # b came back with another disk: fenced, though registered
        replaced, registrations = await _open_ledger_marked(store, urm, ledgers, [("b", "replaced")])
        mark = await urm.get(replaced)
        assert mark is not None
        await worker.heal(mark)
        now[0] += 31_000
        with contextlib.suppress(RuntimeError):
            await worker.heal(mark)
        assert fenced == [replaced]
        # and one marked lost first, replaced when it came back
        for registration in registrations:
            await registration.close()
        both, registrations = await _open_ledger_marked(
            store, urm, ledgers, [("c", "lost"), ("c", "replaced")]
        )
        mark = await urm.get(both)
        assert mark is not None
        await worker.heal(mark)
        now[0] += 31_000
        with contextlib.suppress(RuntimeError):
            await worker.heal(mark)
        assert fenced == [replaced, both]
    finally:
        for registration in registrations:
            await registration.close()
        await bk.close()


async def test_a_ledger_that_keeps_crashing_its_heal_backs_off_and_the_others_heal() -> None:
    """An error nobody foresaw (a bug) in one ledger's heal backs that ledger off like any failure:
    the marks after it are healed, the worker goes on; and the backoff of a ledger healed elsewhere
    is forgotten after a pass."""
    store = MemoryStore()
    urm = UnderReplicationManager(store, ROOT)
    ledgers = LedgerManager(store, ROOT)
    bk = BookKeeper(ledgers, StaticDirectory(["a", "b", "c", "d"]))
    ids = []
    for _ in range(2):
        created = await ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
        await ledgers.update(created.ledger_id, lambda md: md.closed(-1, 0))  # closed and empty
        await urm.mark(created.ledger_id, ["b"], reason="lost")
        ids.append(created.ledger_id)
    crashing, healthy = ids
    worker = ReplicationWorker(
        bk, urm, AutorecoveryConfig(worker_idle_poll_s=0.05, ledger_retry_s=60), worker_id="w0"
    )
    heal = worker.heal

    async def crash_first(mark: Any, lock: Any = None) -> Any:
        if mark.ledger_id == crashing:
            raise KeyError("a bug")
        return await heal(mark, lock)

    worker.heal = crash_first  # type: ignore[method-assign]
    lease = await store.grant_lease(30)
    task = asyncio.get_running_loop().create_task(worker.run(lambda: lease))
    try:
        for _ in range(200):
            if await urm.get(healthy) is None:
                break
            await asyncio.sleep(0.05)
        assert await urm.get(healthy) is None  # healed, though listed after the crashing one
        assert not task.done()
        assert worker.metrics.heal_failures >= 1
        assert crashing in worker._retry_at
        await urm.resolve(crashing, ["b"])  # healed elsewhere (an operator, another daemon)
        for _ in range(200):
            if crashing not in worker._retry_at:
                break
            await asyncio.sleep(0.05)
        assert crashing not in worker._retry_at
        assert crashing not in worker._failures
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await bk.close()
