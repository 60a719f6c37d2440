"""Bookie GC, over-replicated ledgers: a closed ledger this bookie holds but metadata places only on
other bookies (re-replicated while it was away, or an orphan copy no metadata ever listed) is
collected — and never one a worker may be copying to it, one still open, or one metadata lists it
in."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

import metadata
from bookie.gc import REPLICATION_LOCK_TTL_S, GarbageCollector, GcConfig, ReplicaState
from bookie.storage import NoLedger, Storage
from metadata.ledger_metadata import ReplacedBookie
from metadata.underreplication import UnderReplicationManager

from .test_gc import CLUSTER, Clock, filled, memory_catalog
from .test_storage import config

ME = "bookie-1"
GONE = ReplicaState(closed=True, listed=False, marked=False, replaced=True)  # moved elsewhere
ORPHAN = ReplicaState(closed=True, listed=False, marked=False, replaced=False)  # never listed here


class Replicas:
    """A twin of the metadata's answers: a state per ledger (None: no metadata), the lock."""

    def __init__(self, states: dict[int, ReplicaState | None]) -> None:
        self.states = states
        self.held_by_workers: set[int] = set()
        self.inside: int | None = None
        """The ledger whose lock is held right now."""
        self.locked: list[int] = []
        self.on_lock: dict[int, ReplicaState | None] = {}
        """A state a ledger takes once its lock is held (what changed since the first read)."""
        self.reads = 0
        self.scans = 0
        self.scan_error: Exception | None = None

    async def replica_state(self, ledger_id: int, bookie_id: str) -> ReplicaState | None:
        assert bookie_id == ME
        self.reads += 1
        return self.states.get(ledger_id)

    async def replica_states(
        self, ledger_ids: Sequence[int], bookie_id: str
    ) -> AsyncIterator[list[tuple[int, ReplicaState]]]:
        assert bookie_id == ME
        assert list(ledger_ids) == sorted(ledger_ids)
        self.scans += 1
        if self.scan_error is not None:
            raise self.scan_error
        for ledger_id in ledger_ids:  # a page per ledger: the collector must gather them all
            state = self.states.get(ledger_id)
            if state is not None:  # (the real scan leaves out some that list this bookie)
                yield [(ledger_id, state)]

    @contextlib.asynccontextmanager
    async def replication_lock(self, ledger_id: int, owner: str) -> AsyncIterator[bool]:
        assert owner == f"bookie-gc:{ME}"
        free = ledger_id not in self.held_by_workers
        if free:
            self.locked.append(ledger_id)
            if ledger_id in self.on_lock:
                self.states[ledger_id] = self.on_lock[ledger_id]
            self.inside = ledger_id
        try:
            yield free
        finally:
            self.inside = None


def _gc(storage: Storage, replicas: Replicas, clock: Clock, interval: float = 100.0) -> GarbageCollector:
    gc_config = GcConfig(deleted_ledger_grace_s=30.0, over_replicated_interval_s=interval)
    gc = GarbageCollector(storage, gc_config, None, clock, replicas=replicas, bookie_id=ME)
    forget = storage.forget_ledger

    def forget_under_the_lock(ledger_id: int) -> bool:
        assert replicas.inside == ledger_id, "a ledger must be forgotten while its lock is held"
        return forget(ledger_id)

    storage.forget_ledger = forget_under_the_lock  # type: ignore[method-assign]
    return gc


async def test_collects_only_closed_unlisted_unmarked_ledgers_seen_twice(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 9))
    replicas = Replicas(
        {
            1: ReplicaState(closed=True, listed=True, marked=False, replaced=True),  # needed again
            2: GONE,
            3: ReplicaState(closed=False, listed=False, marked=False, replaced=True),  # open/recovering
            4: ReplicaState(closed=True, listed=False, marked=True, replaced=True),  # a worker may copy here
            5: None,  # no metadata: the deleted-ledger step judges it, not this one
            6: GONE,
            7: ORPHAN,  # a copy whose CAS never happened (a failed or retried heal)
            8: ReplicaState(closed=True, listed=True, marked=False, replaced=False),  # needed
        }
    )
    clock = Clock()
    gc = _gc(storage, replicas, clock)

    first = await gc.run_once()
    assert first.replicas_checked == 8
    assert (first.over_replicated_waiting, first.over_replicated_collected) == (3, 0)
    replicas.states[6] = ReplicaState(closed=True, listed=True, marked=False)  # healed back onto us

    clock.now += 50.0  # the grace is over but the next check is not due yet: nothing read
    assert (await gc.run_once()).replicas_checked == 0

    clock.now += 50.0
    third = await gc.run_once()
    assert (third.replicas_checked, third.over_replicated_collected, third.ledgers_collected) == (8, 2, 2)
    assert third.orphans_collected == 1
    assert third.error is None
    assert replicas.locked == [2, 7]
    assert sorted(storage.ledgers) == [1, 3, 4, 5, 6, 8]
    assert (gc.over_replicated_collected_total, gc.orphans_collected_total) == (2, 1)
    with pytest.raises(NoLedger):
        await storage.read_entry(2, 0)
    storage.abort()  # a crash right after the pass: the collection was checkpointed
    reopened = await Storage.open(config(tmp_path))
    assert sorted(reopened.ledgers) == [1, 3, 4, 5, 6, 8]
    await reopened.close()


async def test_the_state_is_read_again_under_the_lock(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 4))
    replicas = Replicas({1: GONE, 2: GONE, 3: GONE})
    clock = Clock()
    gc = _gc(storage, replicas, clock, interval=10.0)
    await gc.run_once()
    # between the checks a worker started healing 1 (its mark) and another listed us again for 2;
    # the lock of 3 is held by a worker: all three are kept, and judged again next time
    replicas.on_lock = {1: ReplicaState(True, False, True, True), 2: ReplicaState(True, True, False, True)}
    replicas.held_by_workers = {3}
    clock.now += 40.0
    kept = await gc.run_once()
    assert kept.over_replicated_collected == 0
    assert replicas.locked == [1, 2]
    assert sorted(storage.ledgers) == [1, 2, 3]
    replicas.on_lock = {}
    replicas.held_by_workers = set()
    replicas.states = {1: GONE, 2: GONE, 3: GONE}  # 1 and 2 start their grace again; 3 kept its
    clock.now += 40.0
    assert (await gc.run_once()).over_replicated_collected == 1
    clock.now += 40.0
    assert (await gc.run_once()).over_replicated_collected == 2
    assert not storage.ledgers
    await storage.close()


async def test_an_orphan_listed_here_after_the_first_look_is_kept(tmp_path: Path) -> None:
    """An orphan at the scan, but a heal listed this bookie in it before the lock was taken (its
    copy here is needed now): the read under the lock keeps it, and so does every later check."""
    storage = await filled(tmp_path, range(1, 3))
    replicas = Replicas({1: ORPHAN, 2: ORPHAN})
    clock = Clock()
    gc = _gc(storage, replicas, clock, interval=10.0)
    await gc.run_once()
    replicas.on_lock = {1: ReplicaState(closed=True, listed=True, marked=False)}
    clock.now += 40.0
    report = await gc.run_once()
    assert (report.over_replicated_collected, report.orphans_collected) == (1, 1)
    assert replicas.locked == [1, 2]
    assert sorted(storage.ledgers) == [1]
    clock.now += 40.0
    assert (await gc.run_once()).over_replicated_collected == 0
    assert sorted(storage.ledgers) == [1]
    await storage.close()


async def test_a_metadata_error_skips_that_ledger_and_the_check_comes_back_sooner(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 4))

    class Flaky(Replicas):
        async def replica_state(self, ledger_id: int, bookie_id: str) -> ReplicaState | None:
            if ledger_id == 2:
                raise metadata.MetadataUnavailable("etcd is down")
            return await super().replica_state(ledger_id, bookie_id)

    clock = Clock()
    gc = GarbageCollector(
        storage,
        GcConfig(deleted_ledger_grace_s=0.0, over_replicated_interval_s=86400.0),
        None,
        clock,
        replicas=Flaky({1: GONE, 2: GONE, 3: GONE}),
        bookie_id=ME,
    )
    report = await gc.run_once()
    assert report.error is None
    assert (report.replica_errors, report.over_replicated_collected) == (1, 2)
    assert sorted(storage.ledgers) == [2]
    clock.now += 600.0  # REPLICA_CHECK_RETRY_S, not a day
    again = await gc.run_once()  # the check ran again (ledger 2 still cannot be read under its lock)
    assert (again.replicas_checked, again.replica_errors) == (1, 1)
    await storage.close()


async def test_a_failed_scan_keeps_the_suspects_and_the_check_comes_back_sooner(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 4))
    replicas = Replicas({1: GONE, 2: GONE, 3: GONE})
    clock = Clock()
    gc = _gc(storage, replicas, clock, interval=86400.0)
    first = await gc.run_once()
    assert (first.replicas_checked, first.over_replicated_waiting) == (3, 3)
    replicas.scan_error = metadata.MetadataUnavailable("etcd is down")
    clock.now += 86400.0
    failed = await gc.run_once()
    assert failed.error is None
    assert (failed.replicas_checked, failed.replica_errors, failed.over_replicated_collected) == (0, 1, 0)
    replicas.scan_error = None
    clock.now += 600.0  # REPLICA_CHECK_RETRY_S: the grace they began in the first pass still counts
    again = await gc.run_once()
    assert (again.replicas_checked, again.over_replicated_collected) == (3, 3)
    assert not storage.ledgers
    await storage.close()


async def test_metadata_catalog_scans_in_pages_and_decodes_only_possible_replacements() -> None:
    """The scan of a bookie's ledgers: listings from the next ledger held (dense and sparse ids,
    past one page), the states of the held ledgers that record it replaced or list it nowhere
    (orphans, also on a bookie whose id contains this one's) only, marks included."""
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    catalog = memory_catalog(store)
    manager = metadata.LedgerManager(store, "/test")
    moved: set[int] = set()
    orphans: set[int] = set()
    for n in range(2600):
        # one in 11 placed elsewhere from the start (a copy here is an orphan): ME's id is inside
        # the first bookie's ("bookie-1" in "bookie-10")
        ensemble = [f"{ME}0", "b2"] if n % 11 == 5 else [ME, "b2"]
        created = await manager.create(ensemble, write_quorum=2, ack_quorum=2)
        md = created.metadata
        if n % 11 == 5:
            await manager.write(md.closed(-1, 0), created.version)
            orphans.add(md.ledger_id)
        elif md.ledger_id % 7 == 0:  # re-replicated away from ME and closed
            md = dataclasses.replace(
                md,
                state=metadata.LedgerState.CLOSED,
                last_entry_id=-1,
                ensembles=((0, ("b3", "b2")),),
                replaced_bookies=(ReplacedBookie(0, ME, "b3", 1),),
            )
            await manager.write(md, created.version)
            moved.add(md.ledger_id)
    ids = sorted(moved)
    urm = UnderReplicationManager(store, "/test")
    await urm.mark(ids[1], ["b2"], reason="lost")
    # held here: every ledger up to 1,500, then one in 97, and ids metadata never had
    held = sorted({*range(1, 1500), *range(1500, 2700, 97), 10_000, 10_001})
    states = {}
    pages = 0
    async for page in catalog.replica_states(held, ME):
        pages += 1
        states.update(page)
    assert set(states) == {i for i in moved | orphans if i in set(held)}
    assert all(state == GONE for i, state in states.items() if i != ids[1] and i in moved)
    assert all(state == ORPHAN for i, state in states.items() if i in orphans)
    assert len(orphans & set(held)) > 100
    assert states[ids[1]] == ReplicaState(True, False, True, True)  # marked: a worker may copy here
    assert 2 <= pages <= 15
    assert await catalog.replica_state(ids[0], ME) == states[ids[0]]  # the same judgement, one by one
    assert [s async for s in catalog.replica_states([], ME)] == []
    await catalog.close()


async def test_metadata_catalog_paces_its_scan() -> None:
    """`scan_ledgers_per_s` spreads the listings (a page of `METADATA_PAGE` each) over time: 3,000
    ledgers at 4,000 a second take three listings 250 ms apart, so the scan cannot end before 0.5 s
    however fast the machine (unpaced, the listings follow at once: tens of milliseconds). Only that
    lower bound is asserted: an upper bound on the unpaced run would fail on a loaded machine."""
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    manager = metadata.LedgerManager(store, "/test")
    held = [
        (await manager.create([ME, "b2"], write_quorum=2, ack_quorum=2)).metadata.ledger_id
        for _ in range(3000)
    ]
    loop = asyncio.get_running_loop()
    took = {}
    for pace in (0.0, 4_000.0):
        catalog = memory_catalog(store)
        catalog._scan_ledgers_per_s = pace
        started = loop.time()
        pages = [page async for page in catalog.replica_states(held, ME)]
        took[pace] = loop.time() - started
        assert pages == []  # every ledger lists this bookie
        await catalog.close()
    assert took[4_000.0] >= 0.5


async def test_a_lock_held_too_long_forgets_nothing(tmp_path: Path) -> None:
    """The lock's lease may run out while the check holds it (a stalled loop, slow etcd): past half
    its TTL nothing is forgotten, a worker could hold the lock by then."""
    storage = await filled(tmp_path, range(1, 2))

    class Slow(Replicas):
        @contextlib.asynccontextmanager
        async def replication_lock(self, ledger_id: int, owner: str) -> AsyncIterator[bool]:
            fake_time[0] += REPLICATION_LOCK_TTL_S  # the lease was granted, then the loop stalled
            yield True

    fake_time = [0.0]
    gc = GarbageCollector(
        storage,
        GcConfig(deleted_ledger_grace_s=0.0),
        None,
        Clock(),
        replicas=Slow({1: GONE}),
        bookie_id=ME,
    )
    real_time = gc._loop.time
    gc._loop = type("Loop", (), {"time": staticmethod(lambda: real_time() + fake_time[0])})()  # type: ignore[assignment]
    report = await gc.run_once()
    assert report.over_replicated_collected == 0
    assert sorted(storage.ledgers) == [1]
    await storage.close()


async def test_metadata_catalog_replica_state_and_lock_on_the_in_memory_store() -> None:
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    catalog = memory_catalog(store)
    manager = metadata.LedgerManager(store, "/test")
    created = await manager.create([ME, "b2"], write_quorum=2, ack_quorum=2)
    ledger_id = created.metadata.ledger_id
    assert await catalog.replica_state(ledger_id, ME) == ReplicaState(False, listed=True, marked=False)
    assert await catalog.replica_state(ledger_id, "b3") == ReplicaState(False, listed=False, marked=False)
    assert await catalog.replica_state(ledger_id + 1000, ME) is None
    # a second fragment without ME, recorded as its replacement: listed still (the first fragment)
    moved = created.metadata.with_ensemble_change(10, ["b3", "b2"])
    moved = moved.with_replaced_bookies([ReplacedBookie(10, ME, "b3", 1)])
    written = await manager.write(moved, created.version)
    assert await catalog.replica_state(ledger_id, ME) == ReplicaState(False, True, False, replaced=True)
    # re-replicated whole (every fragment) and closed: collectable
    healed = dataclasses.replace(
        written.metadata,
        state=metadata.LedgerState.CLOSED,
        last_entry_id=19,
        ensembles=((0, ("b3", "b2")), (10, ("b3", "b2"))),
    )
    await manager.write(healed, written.version)
    assert await catalog.replica_state(ledger_id, ME) == GONE
    urm = UnderReplicationManager(store, "/test")
    await urm.mark(ledger_id, ["b2"], reason="lost")
    assert (await catalog.replica_state(ledger_id, "b3")).marked  # type: ignore[union-attr]

    worker_lease = await store.grant_lease(10)
    async with catalog.replication_lock(ledger_id, "bookie-gc:b3") as locked:
        assert locked
        assert not await urm.try_lock(ledger_id, "worker-1", worker_lease)  # workers wait meanwhile
    assert await urm.try_lock(ledger_id, "worker-1", worker_lease)  # released with its lease
    async with catalog.replication_lock(ledger_id, "bookie-gc:b3") as locked:
        assert not locked  # the worker holds it now
    await catalog.close()
