"""Bookie GC, over-replicated ledgers: a closed ledger this bookie holds but metadata places only on
other bookies (re-replicated while it was away) is collected — and never one a worker may be
copying to it, one still open, or one metadata lists it in."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import metadata
from bookie.gc import GarbageCollector, GcConfig, MetadataCatalog, ReplicaState
from bookie.storage import NoLedger, Storage
from metadata.underreplication import UnderReplicationManager

from .test_gc import Clock, _Connection, filled
from .test_storage import config

ME = "bookie-1"
GONE = ReplicaState(closed=True, listed=False, marked=False)  # what collection needs


class Replicas:
    """A twin of the metadata's answers: a state per ledger (None: no metadata), the lock."""

    def __init__(self, states: dict[int, ReplicaState | None]) -> None:
        self.states = states
        self.held_by_workers: set[int] = set()
        self.locked: list[int] = []
        self.on_lock: dict[int, ReplicaState | None] = {}
        """A state a ledger takes once its lock is held (what changed since the first read)."""
        self.reads = 0

    async def replica_state(self, ledger_id: int, bookie_id: str) -> ReplicaState | None:
        assert bookie_id == ME
        self.reads += 1
        return self.states.get(ledger_id)

    @contextlib.asynccontextmanager
    async def replication_lock(self, ledger_id: int, owner: str) -> AsyncIterator[bool]:
        assert owner == f"bookie-gc:{ME}"
        free = ledger_id not in self.held_by_workers
        if free:
            self.locked.append(ledger_id)
            if ledger_id in self.on_lock:
                self.states[ledger_id] = self.on_lock[ledger_id]
        yield free


def _gc(storage: Storage, replicas: Replicas, clock: Clock, interval: float = 100.0) -> GarbageCollector:
    gc_config = GcConfig(deleted_ledger_grace_s=30.0, over_replicated_interval_s=interval)
    return GarbageCollector(storage, gc_config, None, clock, replicas=replicas, bookie_id=ME)


async def test_collects_only_closed_unlisted_unmarked_ledgers_seen_twice(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 7))
    replicas = Replicas(
        {
            1: ReplicaState(closed=True, listed=True, marked=False),  # its copy is needed
            2: GONE,
            3: ReplicaState(closed=False, listed=False, marked=False),  # open: its ensemble may change
            4: ReplicaState(closed=True, listed=False, marked=True),  # a worker may copy it here
            5: None,  # no metadata: the deleted-ledger step judges it, not this one
            6: GONE,
        }
    )
    clock = Clock()
    gc = _gc(storage, replicas, clock)

    first = await gc.run_once()
    assert first.replicas_checked == 6
    assert (first.over_replicated_waiting, first.over_replicated_collected) == (2, 0)
    replicas.states[6] = ReplicaState(closed=True, listed=True, marked=False)  # healed back onto us

    clock.now += 50.0  # the grace is over but the next check is not due yet: nothing read
    assert (await gc.run_once()).replicas_checked == 0

    clock.now += 50.0
    third = await gc.run_once()
    assert (third.replicas_checked, third.over_replicated_collected, third.ledgers_collected) == (6, 1, 1)
    assert third.error is None
    assert replicas.locked == [2]
    assert sorted(storage.ledgers) == [1, 3, 4, 5, 6]
    with pytest.raises(NoLedger):
        await storage.read_entry(2, 0)
    storage.abort()  # a crash right after the pass: the collection was checkpointed
    reopened = await Storage.open(config(tmp_path))
    assert sorted(reopened.ledgers) == [1, 3, 4, 5, 6]
    await reopened.close()


async def test_the_state_is_read_again_under_the_lock(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 4))
    replicas = Replicas({1: GONE, 2: GONE, 3: GONE})
    clock = Clock()
    gc = _gc(storage, replicas, clock, interval=10.0)
    await gc.run_once()
    # between the checks a worker started healing 1 (its mark) and another listed us again for 2;
    # the lock of 3 is held by a worker: all three are kept, and judged again next time
    replicas.on_lock = {1: ReplicaState(True, False, True), 2: ReplicaState(True, True, False)}
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


async def test_a_metadata_error_fails_the_step_not_the_pass(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 3))

    class Down(Replicas):
        async def replica_state(self, ledger_id: int, bookie_id: str) -> ReplicaState | None:
            raise metadata.MetadataUnavailable("etcd is down")

    gc = _gc(storage, Down({}), Clock())
    report = await gc.run_once()
    assert report.error is not None
    assert "checking replicas: MetadataUnavailable" in report.error
    assert sorted(storage.ledgers) == [1, 2]
    await storage.close()


async def test_metadata_catalog_replica_state_and_lock_on_the_in_memory_store() -> None:
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test")
    catalog = MetadataCatalog("memory:///test", connect=lambda url: _Connection(store, "/test"))
    manager = metadata.LedgerManager(store, "/test")
    md = (await manager.create([ME, "b2"], write_quorum=2, ack_quorum=2)).metadata
    ledger_id = md.ledger_id
    assert await catalog.replica_state(ledger_id, ME) == ReplicaState(closed=False, listed=True, marked=False)
    assert await catalog.replica_state(ledger_id, "b3") == ReplicaState(False, listed=False, marked=False)
    assert await catalog.replica_state(ledger_id + 1000, ME) is None
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
