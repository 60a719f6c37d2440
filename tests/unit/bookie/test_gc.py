"""Bookie GC, deleted ledgers: which local ledgers a pass collects (and which it must never), that
they leave the index at once and stay gone after a restart, and the admin ``/gc`` route."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import metadata
from bookie import gc as bookie_gc
from bookie.admin import AdminServer
from bookie.gc import GarbageCollector, GcConfig, GcReport, MetadataCatalog, MetadataUnusable, MetadataView
from bookie.ledger_state import WakeReason
from bookie.storage import NoLedger, Storage
from tests.harness.admin_http import get_json, http_get

from .test_mode import make_snapshot
from .test_storage import add, body, config


class Catalog:
    """A metadata twin: the ledger ids it lists, the id counter, or an error to raise."""

    def __init__(self, ids: set[int], counter: int = 1000) -> None:
        self.ids = ids
        self.counter = counter
        self.error: Exception | None = None
        self.views = 0

    async def view(self) -> MetadataView:
        self.views += 1
        if self.error is not None:
            raise self.error
        return MetadataView(self._pages(sorted(self.ids)), self.counter)

    @staticmethod
    async def _pages(ids: list[int]) -> AsyncIterator[list[int]]:
        for start in range(0, len(ids), 3):  # pages of 3: the collector must walk them all
            yield ids[start : start + 3]

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def filled(tmp_path: Path, ledgers: range) -> Storage:
    storage = await Storage.open(config(tmp_path))
    for ledger_id in ledgers:
        for entry_id in range(3):
            await add(storage, ledger_id, entry_id)
    return storage


async def test_collects_only_ledgers_missing_from_metadata_for_the_grace_period(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 7))
    catalog = Catalog({1, 2, 3}, counter=6)  # 6 is at the counter: never handed out
    clock = Clock()
    config_ = GcConfig(deleted_ledger_grace_s=30.0, future_ledger_grace_s=100.0)
    gc = GarbageCollector(storage, config_, catalog, clock)

    first = await gc.run_once()
    assert (first.ledgers_collected, first.ledgers_waiting_grace, first.ledgers_unallocated) == (0, 3, 1)
    assert sorted(storage.ledgers) == [1, 2, 3, 4, 5, 6]

    catalog.ids.add(4)  # ledger 4 shows up again (e.g. the first listing raced something): kept
    clock.now += 29.0
    second = await gc.run_once()
    assert (second.ledgers_collected, second.ledgers_waiting_grace) == (0, 2)

    clock.now += 1.0
    third = await gc.run_once()
    assert third.ledgers_collected == 1
    assert sorted(storage.ledgers) == [1, 2, 3, 4, 6]
    with pytest.raises(NoLedger):
        await storage.read_entry(5, 0)
    assert (await storage.read_entry(4, 2))[1] == body(4, 2, 1)

    catalog.ids.discard(4)  # 4 missing again: its grace starts over, it is not collected at once
    fourth = await gc.run_once()
    assert (fourth.ledgers_collected, fourth.ledgers_waiting_grace) == (0, 2)

    clock.now += 70.0  # 100 s since ledger 6 (at the counter) went missing: its longer grace is over
    fifth = await gc.run_once()
    assert (fifth.ledgers_collected, fifth.ledgers_unallocated) == (2, 1)
    assert sorted(storage.ledgers) == [1, 2, 3]
    await storage.close()


async def test_a_report_takes_its_times_from_the_wall_clock_seam(tmp_path: Path) -> None:
    """A pass's ``started_at`` / ``finished_at`` come from the collector's ``wall_clock`` (the
    bookie's clock seam), never ``time.time()``: a simulation's reports stay deterministic."""
    storage = await filled(tmp_path, range(1, 3))
    wall = iter([1_000.0, 1_002.5])
    catalog = Catalog({1, 2}, counter=3)
    gc = GarbageCollector(storage, GcConfig(), catalog, Clock(), wall_clock=lambda: next(wall))
    report = await gc.run_once()
    assert (report.started_at, report.finished_at) == (1_000.0, 1_002.5)
    await storage.close()


async def test_metadata_catalog_on_the_in_memory_store() -> None:
    """The etcd catalog's rules, on the metadata twin: no cluster or no id counter -> refuse (a
    pass then collects nothing); else every ledger id and the counter."""
    store = metadata.MemoryStore()
    with pytest.raises(MetadataUnusable, match="no cluster"):
        await memory_catalog(store).view()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    catalog = memory_catalog(store)  # (the one that found no cluster refuses for good)
    with pytest.raises(MetadataUnusable, match="no id counter"):
        await catalog.view()
    manager = metadata.LedgerManager(store, "/test", id_block_size=10)
    ids = [(await manager.create(["b0"], write_quorum=1, ack_quorum=1)).ledger_id for _ in range(3)]
    await manager.delete(ids[1])
    view = await catalog.view()
    assert view.id_counter == ids[0] + 10
    assert [i async for page in view.ledger_pages for i in page] == [ids[0], ids[2]]
    await catalog.close()


async def test_metadata_catalog_reads_the_keys_of_dense_ledgers_in_one_listing() -> None:
    """``key_infos`` (the key checks of a burst of new ledgers) says what ``key_info`` says of each
    id: an absent id (never created, deleted) does not exist, a closed ledger is not writable; an
    undecodable one is left out (read alone, it raises), and so are ids too spread out to list."""
    store = metadata.MemoryStore()
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    catalog = memory_catalog(store)
    manager = metadata.LedgerManager(store, "/test", id_block_size=100)

    async def create(salt: bytes) -> int:
        made = await manager.create(
            ["b0"],
            write_quorum=1,
            ack_quorum=1,
            password_hash=b"h" * 32,
            key_salt=salt,
            key_iterations=1 if salt else 0,
        )
        return made.ledger_id

    ids = [await create(b"s" * 16 if i % 2 else b"") for i in range(8)]
    await manager.delete(ids[2])
    closed = await manager.read(ids[3])
    await manager.write(closed.metadata.closed(last_entry_id=-1, length=0), closed.version)
    await store.put(manager.keys.ledger(ids[6]), b"not metadata")
    asked = [*ids, ids[-1] + 1]
    infos = await catalog.key_infos(asked)
    assert sorted(infos) == [lid for lid in asked if lid != ids[6]]
    for lid, info in infos.items():
        assert info == await catalog.key_info(lid)
    assert (infos[ids[2]].exists, infos[ids[-1] + 1].exists) == (False, False)
    assert (infos[ids[1]].check, infos[ids[0]].check) == (b"h" * 32, None)  # format 2, format 1
    assert not infos[ids[3]].writable
    with pytest.raises(metadata.MetadataFormatError):
        await catalog.key_info(ids[6])
    assert await catalog.key_infos([ids[0], ids[0] + 10 * bookie_gc.KEY_INFOS_SPAN_MAX]) == {}
    await catalog.close()


async def test_metadata_catalog_key_infos_leaves_out_what_a_short_page_did_not_list() -> None:
    """Large metadata makes the store stop a listing page short (``more``): the ids after its last
    key are left for one-by-one reads, never taken for ledgers that do not exist."""
    store = metadata.MemoryStore(list_reply_bytes_max=20_000)
    await metadata.init_cluster(store, "/test", instance_id=CLUSTER)
    catalog = memory_catalog(store)
    manager = metadata.LedgerManager(store, "/test", id_block_size=100)
    custom = {"app": b"x" * 6000}
    ids = [
        (await manager.create(["b0"], write_quorum=1, ack_quorum=1, custom_metadata=custom)).ledger_id
        for _ in range(8)
    ]
    infos = await catalog.key_infos(ids)
    assert infos, "the first page lists some"
    assert all(infos[lid].exists for lid in infos)
    assert len(infos) < len(ids)
    for lid in ids:
        assert (await catalog.key_info(lid)).exists
    await catalog.close()


class _Connection:
    def __init__(self, store: metadata.MetadataStore, root: str) -> None:
        self.store, self.root = store, root

    async def close(self) -> None:
        pass


CLUSTER = "cluster-1"
"""The cluster instance id the COOKIE of a :func:`memory_catalog`'s bookie names."""


def memory_catalog(store: metadata.MetadataStore, root: str = "/test") -> MetadataCatalog:
    """The etcd catalog over the metadata twin at ``root``, for a bookie of cluster :data:`CLUSTER`."""
    return MetadataCatalog(
        f"memory://{root}", connect=lambda url: _Connection(store, root), cluster_id=lambda: CLUSTER
    )


async def test_collected_ledgers_stay_gone_after_a_restart(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 5))
    gc = GarbageCollector(storage, GcConfig(deleted_ledger_grace_s=0.0), Catalog({1, 3}), Clock())
    report = await gc.run_once()
    assert report.ledgers_collected == 2
    storage.abort()  # a crash right after the pass: only what the pass made durable counts

    reopened = await Storage.open(config(tmp_path))
    assert sorted(reopened.ledgers) == [1, 3]
    for ledger_id in (1, 3):
        for entry_id in range(3):
            assert (await reopened.read_entry(ledger_id, entry_id))[1] == body(
                ledger_id, entry_id, entry_id - 1
            )
    await reopened.close()


async def test_a_listing_that_fails_collects_nothing(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 4))
    catalog = Catalog(set())
    catalog.error = ConnectionError("etcd is down")
    gc = GarbageCollector(storage, GcConfig(deleted_ledger_grace_s=0.0), catalog, Clock())
    report = await gc.run_once()
    assert report.error is not None
    assert report.error.startswith("listing metadata: ConnectionError: etcd is down")
    assert report.ledgers_collected == 0
    assert sorted(storage.ledgers) == [1, 2, 3]
    assert gc.status()["last"]["phase"] == "failed"
    await storage.close()


async def test_without_metadata_no_ledger_is_collected(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 3))
    gc = GarbageCollector(storage, GcConfig(deleted_ledger_grace_s=0.0), None, Clock())
    report = await gc.run_once()
    assert (report.ledgers_collected, report.ledgers_in_metadata, report.error) == (0, None, None)
    assert sorted(storage.ledgers) == [1, 2]
    await storage.close()


async def test_fenced_unknown_ledger_is_collected_after_the_grace(tmp_path: Path) -> None:
    """A fence of a ledger this bookie never held creates a ledger record; without metadata it
    is garbage once the grace period has passed."""
    storage = await filled(tmp_path, range(1, 2))
    fenced = asyncio.get_running_loop().create_future()
    storage.fence(7, None, fenced.set_result)
    assert await fenced is None
    clock = Clock()
    gc = GarbageCollector(storage, GcConfig(deleted_ledger_grace_s=10.0), Catalog({1}), clock)
    assert (await gc.run_once()).ledgers_collected == 0
    clock.now += 10.0
    assert (await gc.run_once()).ledgers_collected == 1
    assert sorted(storage.ledgers) == [1]
    await storage.close()


async def test_a_parked_long_poll_on_a_collected_ledger_is_answered(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 3))
    woken: list[WakeReason] = []
    state = storage.ledger(2)
    state.add_waiter(state.lac, 60.0, woken.append, asyncio.get_running_loop())
    gc = GarbageCollector(storage, GcConfig(deleted_ledger_grace_s=0.0), Catalog({1}), Clock())
    await gc.run_once()
    assert woken == [WakeReason.TIMEOUT]
    assert not state.waiters
    await storage.close()


async def passes(gc: GarbageCollector, count: int) -> None:
    """Wait (bounded) until ``gc`` finished ``count`` passes."""
    async with asyncio.timeout(10):
        while True:
            if gc.passes >= count:
                return
            await asyncio.sleep(0.01)


async def test_periodic_and_triggered_passes(tmp_path: Path) -> None:
    storage = await filled(tmp_path, range(1, 3))
    catalog = Catalog({1, 2})
    gc = GarbageCollector(storage, GcConfig(interval_s=0.0), catalog, Clock())  # on demand only
    gc.start()
    await asyncio.sleep(0.05)
    assert gc.passes == 0
    assert gc.trigger("test")
    await passes(gc, 1)
    await asyncio.sleep(0.05)
    assert gc.passes == 1
    assert gc.status()["last"]["trigger"] == "test"
    await gc.close()

    periodic = GarbageCollector(storage, GcConfig(interval_s=0.02), catalog, Clock())
    periodic.start()
    await passes(periodic, 2)  # no trigger: the interval alone starts them
    assert periodic.status()["last"]["trigger"] == "periodic"
    await periodic.close()
    await storage.close()


async def test_admin_gc_route() -> None:
    calls: list[bool] = []

    def gc(start: bool) -> dict[str, object]:
        calls.append(start)
        return {"started": start}

    server = AdminServer(lambda: make_snapshot(), "127.0.0.1", 0, gc=gc, token=b"tok")
    await server.start()
    assert server.address is not None
    host, port = server.address
    assert await get_json(host, port, "/gc") == (200, {"started": False})
    status, _, _ = await http_get(host, port, "/gc?start=1")  # a change by GET: refused
    assert status == 405
    status, _, _ = await http_get(host, port, "/gc", method="POST")  # no token
    assert status == 401
    status, _, _ = await http_get(host, port, "/gc", method="POST", token="tok")
    assert status == 200
    status, _, body_bytes = await http_get(host, port, "/gc?start=soon")
    assert (status, body_bytes) == (400, b"start must be 1 or 0\n")
    status, _, _ = await http_get(host, port, "/gc", method="DELETE")
    assert status == 405
    assert calls == [False, True]
    await server.close()


async def test_missing_walks_the_listing_pages_beside_the_local_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Local ids below, between and above the listed ones, empty pages, and a page spanning many
    local ids (the loop gets turns within it): exactly the local ids not listed."""
    monkeypatch.setattr(bookie_gc, "LOOP_SLICE", 7)
    rng = random.Random(5)
    for _ in range(50):
        listed = sorted(rng.sample(range(1, 400), rng.randrange(0, 120)))
        local = sorted(rng.sample(range(1, 450), rng.randrange(0, 200)))
        sizes = [rng.choice((0, 1, 3, 50, 1000)) for _ in range(len(listed) + 1)]

        async def pages(ids: list[int] = listed, sizes: list[int] = sizes) -> AsyncIterator[list[int]]:
            start = 0
            for size in sizes:
                yield ids[start : start + size]
                start += size
                if start >= len(ids):
                    return

        report = GcReport("test", 0.0)
        missing = await GarbageCollector._missing(local, pages(), report)
        assert missing == [i for i in local if i not in set(listed)]
        assert report.ledgers_in_metadata == len(listed)
