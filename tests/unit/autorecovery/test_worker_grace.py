"""The open-ledger grace period counts from when the writer's bookie was first marked, not from the
ledger's first mark (an older mark for another bookie must not make the fence come early)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import HealResult, ReplicationWorker
from bookkeeper_aio.client.context import StaticDirectory
from metadata.bookies import BookieInfo, BookieRegistration, BookieSet
from metadata.etcd import EtcdConfig, EtcdStore
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from metadata.memory import MemoryStore
from metadata.store import MetadataStore
from metadata.underreplication import UnderReplicationManager
from tests.harness.etcd import EtcdCluster

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


class _Fenced(Exception):
    """The worker fenced the writer's ledger (the test's stand-in for open_ledger(recovery=True))."""


async def _register(store: MetadataStore, bookie_id: str, port: int, root: str = ROOT) -> BookieRegistration:
    registration = BookieRegistration(store, root, BookieInfo(bookie_id, "127.0.0.1", port), ttl_s=5)
    await registration.start()
    return registration


class _World:
    """Bookies a-d registered, a worker on a clock the test advances, and an ``open_ledger`` that
    records the fence the worker asks for and raises `_Fenced` (no real recovery)."""

    def __init__(self, store: MetadataStore, root: str) -> None:
        self.store, self.root = store, root
        self.now = 1_000_000
        self.local = 0.0
        self.urm = UnderReplicationManager(store, root, now_ms=lambda: self.now)
        self.ledgers = LedgerManager(store, root)
        self.registrations: dict[str, BookieRegistration] = {}
        self.bk = BookKeeper(self.ledgers, StaticDirectory(list("abcd")))
        self.fenced: list[int] = []
        self.bk.open_ledger = self._open_ledger  # type: ignore[method-assign]
        config = AutorecoveryConfig(
            open_ledger_grace_s=30, lost_bookie_recovery_delay_s=30, worker_idle_poll_s=1
        )
        self.worker = ReplicationWorker(
            self.bk, self.urm, config, worker_id="w", now_ms=lambda: self.now, monotonic_s=lambda: self.local
        )

    async def _open_ledger(self, ledger_id: int, *, password: bytes = b"", recovery: bool = False) -> None:
        self.fenced.append(ledger_id)
        raise _Fenced

    async def start(self) -> _World:
        for i, bookie in enumerate("abcd"):
            self.registrations[bookie] = await _register(self.store, bookie, 4000 + i, self.root)
        return self

    def advance(self, seconds: int) -> None:
        self.now += seconds * 1000
        self.local += seconds

    async def look(self, ledger_id: int) -> HealResult:
        mark = await self.urm.get(ledger_id)
        assert mark is not None
        return await self.worker.heal(mark)

    async def close(self) -> None:
        await self.bk.close()
        for registration in self.registrations.values():
            await registration.close()


async def test_a_restart_of_a_marked_bookie_that_is_back_does_not_fence_its_idle_writer() -> None:
    """b was lost once (marked) and came back with its disk: its idle writer goes on. A graceful
    restart of b deregisters it at once; a look during it must not fence the writer's ledger: only
    an absence that outlasts the lost-bookie delay at every look of the worker does, and only a
    grace after b was last found back."""
    store = MemoryStore()
    world = await _World(store, ROOT).start()
    urm, registrations, fenced, advance = world.urm, world.registrations, world.fenced, world.advance

    try:
        created = await world.ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
        look = functools.partial(world.look, created.ledger_id)
        await urm.mark(created.ledger_id, ["b"], reason="lost")
        assert (await look()).wait_s == 30  # the worker sees the mark: the grace runs
        advance(40)
        back = await look()  # b is back: its writer keeps it, and the grace starts anew
        assert (back.fenced, back.left, back.wait_s) == (False, ("b",), 30)
        restamped = await urm.get(created.ledger_id)
        assert restamped is not None
        assert restamped.since_ms("b") == world.now
        await registrations["b"].close()  # a rolling restart of b
        advance(30)
        during = await look()  # the worker's next look falls in the restart
        assert not during.fenced
        assert during.wait_s == 30  # looked at again when the delay would be over
        registrations["b"] = await _register(store, "b", 4001)  # b is back within seconds
        advance(2)
        lease = await store.grant_lease(10)
        await world.worker._one_pass(lambda: lease, asyncio.get_running_loop())  # a pass sees b back
        await registrations["b"].close()  # and restarts again, just before the next look
        advance(28)
        assert not (await look()).fenced  # two short absences are no long one
        assert fenced == []
        advance(30)  # b stayed away for the delay at every look: lost, and the writer is fenced
        with pytest.raises(_Fenced):
            await look()
        assert fenced == [created.ledger_id]
    finally:
        await world.close()


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
async def any_store(request: pytest.FixtureRequest) -> AsyncIterator[MetadataStore]:
    if request.param == "memory":
        driver: MetadataStore = MemoryStore()
    else:
        server: EtcdCluster = request.getfixturevalue("etcd_server")
        driver = EtcdStore(EtcdConfig(server.endpoints))
    try:
        yield driver
    finally:
        await driver.close()


async def test_a_bookie_back_between_two_looks_is_not_gone(any_store: MetadataStore) -> None:
    """b is unregistered at each look of the worker, but registered in between (a restart, and
    another one just before the next look): the running worker's registration watch sees it back,
    so two short absences are no long one and its idle writer is not fenced. Without the watch the
    worker, which only looks, took b for away the whole time."""
    store = any_store
    world = await _World(store, f"/bookkeeper/between-{uuid.uuid4().hex[:8]}").start()
    urm, registrations, fenced, advance = world.urm, world.registrations, world.fenced, world.advance
    await urm.set_enabled(False)  # the worker's own passes take nothing: the test looks itself
    running = asyncio.create_task(world.worker.run(lambda: 0))

    async def settle() -> None:
        """Until the watch delivered the registration change (a few loop turns in memory)."""
        for _ in range(20):
            await asyncio.sleep(0)
        if not isinstance(store, MemoryStore):
            await asyncio.sleep(0.5)

    try:
        created = await world.ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
        look = functools.partial(world.look, created.ledger_id)
        await urm.mark(created.ledger_id, ["b"], reason="lost")
        assert (await look()).wait_s == 30  # the grace runs
        advance(40)
        await registrations["b"].close()  # a restart of b
        away = await look()  # the grace is over, b unregistered: its absence is timed from here
        assert (away.fenced, away.wait_s) == (False, 30)
        registrations["b"] = await _register(store, "b", 4001, world.root)  # back between two looks
        await settle()
        await registrations["b"].close()  # and restarting again just before the next look
        await settle()
        advance(30)
        assert not (await look()).fenced  # away at both looks, but not in between
        assert fenced == []
        advance(30)  # this time b stayed away for the delay: lost, and the writer is fenced
        with pytest.raises(_Fenced):
            await look()
        assert fenced == [created.ledger_id]
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await world.close()


async def test_a_compacted_registration_watch_starts_every_timed_absence_anew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`watch_bookies` lists again after a compaction: a bookie that came back in the gap went
    unseen, so the absences being timed start anew (a fence later, never sooner), as after a
    failed watch. Before, only a failed watch did so."""
    store = MemoryStore()
    urm = UnderReplicationManager(store, ROOT)
    bk = BookKeeper(LedgerManager(store, ROOT), StaticDirectory(["a"]))
    worker = ReplicationWorker(bk, urm, AutorecoveryConfig(), worker_id="w")
    step = asyncio.Event()

    async def watch(*_args: object) -> AsyncIterator[BookieSet]:
        yield BookieSet({}, {}, 1, listed=True)  # the first listing: b is away
        await step.wait()
        yield BookieSet({}, {}, 9, listed=True)  # listed again after a compaction: b still away

    monkeypatch.setattr("bookkeeper_aio.autorecovery.worker.watch_bookies", watch)
    worker._absent_since["b"] = 5.0
    following = asyncio.create_task(worker._follow_registrations())
    try:
        for _ in range(5):
            await asyncio.sleep(0)
        assert worker._absent_since == {"b": 5.0}  # the first listing is no gap
        step.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert worker._absent_since == {}
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await bk.close()
