"""Under-replication marks, replication locks and the switch: the same contract on both drivers."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from metadata.errors import CasResultUnknown, GuardFailed, InvalidMetadata, MetadataFormatError
from metadata.memory import MemoryStore
from metadata.store import MetadataStore
from metadata.underreplication import UnderReplicated, UnderReplicationManager


async def test_mark_merges_bookies_and_reasons_and_keeps_the_first_time(
    store: MetadataStore, root: str
) -> None:
    urm = UnderReplicationManager(store, root)
    first = await urm.mark(7, ["b2"], reason="lost")
    assert first.missing == ("b2",)
    assert first.reasons == ("lost",)
    again = await urm.mark(7, ["b1", "b2"], reason="check")
    assert again.missing == ("b1", "b2")
    assert again.reasons == ("check", "lost")
    assert again.marked_ms == first.marked_ms
    assert again.version > first.version
    stored = await urm.get(7)
    assert stored == again
    same = await urm.mark(7, ["b1"], reason="check")  # nothing new: no write
    assert same.version == again.version
    # a reason the mark has, new for this bookie: written (each bookie keeps its own reasons)
    assert (await urm.mark(7, ["b1"], reason="lost")).reasons_of("b1") == ("check", "lost")


async def test_concurrent_marks_never_lose_a_bookie(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    bookies = [f"b{i}" for i in range(12)]
    await asyncio.gather(*(urm.mark(3, [b], reason="lost") for b in bookies))
    stored = await urm.get(3)
    assert stored is not None
    assert stored.missing == tuple(sorted(bookies))


async def test_resolve_removes_only_the_healed_bookies(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    await urm.mark(5, ["a", "b"], reason="lost")
    left = await urm.resolve(5, ["a"])
    assert left is not None
    assert left.missing == ("b",)
    assert (await urm.get(5)) == left
    assert await urm.resolve(5, ["b", "zzz"]) is None
    assert await urm.get(5) is None
    assert await urm.resolve(5, ["b"]) is None  # resolving twice is harmless


async def test_unmark_drops_a_bookie_marked_for_that_reason_alone(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    await urm.mark(1, ["b1", "b2"], reason="decommission")
    await urm.mark(1, ["b2"], reason="lost")
    left = await urm.unmark(1, "b2", "decommission")  # also lost: stays
    assert left is not None
    assert left.missing == ("b1", "b2")
    left = await urm.unmark(1, "b1", "decommission")
    assert left is not None
    assert (left.missing, left.reasons_of("b2")) == (("b2",), ("decommission", "lost"))
    await urm.mark(2, ["b1"], reason="decommission")
    assert await urm.unmark(2, "b1", "decommission") is None
    assert await urm.get(2) is None
    assert await urm.unmark(3, "b1", "decommission") is None  # not marked: nothing to do


async def test_list_pages_in_ledger_order_and_counts(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    ids = [900, 3, 10_000_000_000, 42, 7]
    for ledger_id in ids:
        await urm.mark(ledger_id, ["x"], reason="check")
    first, more = await urm.list_page(limit=2)
    assert [m.ledger_id for m in first] == [3, 7]
    assert more
    every = [m.ledger_id async for m in urm.iter_marks(page_size=2)]
    assert every == sorted(ids)
    assert await urm.count() == len(ids)


async def test_bad_input_is_a_typed_error(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    with pytest.raises(InvalidMetadata):
        await urm.mark(1, [], reason="lost")
    with pytest.raises(InvalidMetadata):
        await urm.mark(1, ["a/b"], reason="lost")
    with pytest.raises(InvalidMetadata):
        await urm.mark(1, ["a"], reason="because")
    with pytest.raises(InvalidMetadata):
        await urm.mark(-1, ["a"], reason="lost")
    await store.put(urm.keys.underreplicated(9), b"\x93garbage")
    with pytest.raises(MetadataFormatError):
        await urm.get(9)
    newer = msgpack.packb({"format_version": 99, "missing": ["a"], "marked_ms": 1, "reasons": []})
    await store.put(urm.keys.underreplicated(10), newer)
    with pytest.raises(MetadataFormatError):
        await urm.get(10)


async def test_one_lock_holder_released_only_by_its_lease(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    lease_a, lease_b = await store.grant_lease(5), await store.grant_lease(5)
    try:
        results = await asyncio.gather(urm.try_lock(11, "w-a", lease_a), urm.try_lock(11, "w-b", lease_b))
        assert sorted(results) == [False, True]
        holder = await urm.lock_holder(11)
        assert holder is not None
        winner, loser = (lease_a, lease_b) if holder.lease_id == lease_a else (lease_b, lease_a)
        await urm.unlock(11, loser)  # not the holder: nothing happens
        assert (await urm.lock_holder(11)) == holder
        assert [lock.ledger_id for lock in await urm.locks()] == [11]
        await urm.unlock(11, winner)
        assert await urm.lock_holder(11) is None
        assert await urm.try_lock(11, "w-b", loser)
    finally:
        await store.revoke_lease(lease_a)
        await store.revoke_lease(lease_b)


async def test_a_lock_whose_release_failed_is_taken_up_again_by_its_owner(
    store: MetadataStore, root: str
) -> None:
    """A release lost to a metadata outage leaves the lock under a live lease: its owner takes it
    up again (same holding), nobody else can, and it is released normally afterwards."""
    urm = UnderReplicationManager(store, root)
    lease = await store.grant_lease(5)
    try:
        lock = await urm.acquire(14, "w-a", lease)
        assert lock is not None
        assert await urm.acquire(14, "w-b", lease) is None  # another worker of the daemon
        again = await urm.acquire(14, "w-a", lease)  # its unlock never reached the store
        assert again == lock
        assert await urm.holds(again)
        await urm.unlock(14, lease)
        assert await urm.lock_holder(14) is None
    finally:
        await store.revoke_lease(lease)


async def test_a_dead_workers_lock_goes_with_its_lease(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    lease = await store.grant_lease(2)
    assert await urm.try_lock(12, "w-dead", lease)
    await store.revoke_lease(lease)  # what expiry does when the worker is killed
    other = await store.grant_lease(5)
    try:
        assert await urm.try_lock(12, "w-next", other)
        holder = await urm.lock_holder(12)
        assert holder is not None
        assert holder.owner == "w-next"
    finally:
        await store.revoke_lease(other)


async def test_a_lock_guards_its_holders_writes_until_its_lease_goes(store: MetadataStore, root: str) -> None:
    """The lock's version identifies one holding: the holder's mark updates (and its ledger CASes,
    through the same guard) apply while it holds the lock, never after its lease went, even once
    another worker took the lock again."""
    urm = UnderReplicationManager(store, root)
    lease = await store.grant_lease(2)
    lock = await urm.acquire(13, "w-zombie", lease)
    assert lock is not None
    assert (lock.owner, lock.lease_id) == ("w-zombie", lease)
    assert await urm.holds(lock)
    assert await urm.lock_holder(13) == lock
    assert await urm.acquire(13, "w-other", lease) is None
    await urm.mark(13, ["a", "b"], reason="lost")
    left = await urm.resolve(13, ["a"], lock=lock)
    assert left is not None
    assert left.missing == ("b",)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while await urm.holds(lock):  # paused past the TTL: no keepalive
        assert loop.time() < deadline, "the lock outlived its lease"
        await asyncio.sleep(0.1)
    with pytest.raises(GuardFailed):
        await urm.resolve(13, ["b"], lock=lock)
    other = await store.grant_lease(5)
    try:
        again = await urm.acquire(13, "w-next", other)
        assert again is not None
        assert again.version != lock.version
        assert not await urm.holds(lock)
        with pytest.raises(GuardFailed):
            await urm.resolve(13, ["b"], lock=lock)
        assert (await urm.get(13)) == left  # the zombie changed nothing
        assert await urm.resolve(13, ["b"], lock=again) is None
    finally:
        await store.revoke_lease(other)


async def test_switch_decommissioning_and_statuses(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    assert await urm.is_enabled()
    await urm.set_enabled(False)
    await urm.set_enabled(False)
    assert not await urm.is_enabled()
    await urm.set_enabled(True)
    await urm.set_enabled(True)
    assert await urm.is_enabled()
    await urm.start_decommission("bk-1")
    assert await urm.decommissioning() == {"bk-1"}
    await urm.end_decommission("bk-1")
    await urm.end_decommission("bk-1")
    assert await urm.decommissioning() == set()
    lease = await store.grant_lease(5)
    await urm.publish_status("daemon-1", lease, {"bytes_copied": 10})
    assert (await urm.statuses())["daemon-1"]["bytes_copied"] == 10
    await store.revoke_lease(lease)
    assert await urm.statuses() == {}


async def test_a_lost_answer_on_mark_is_resolved_by_reading_back(root: str) -> None:
    store = MemoryStore()
    urm = UnderReplicationManager(store, root)
    original = store.create
    calls = 0

    async def create_then_lose_the_answer(key: str, value: bytes, *, lease_id: int = 0) -> int:
        nonlocal calls
        calls += 1
        await original(key, value, lease_id=lease_id)
        raise CasResultUnknown(key, "answer lost")

    store.create = create_then_lose_the_answer  # type: ignore[method-assign]
    stored = await urm.mark(4, ["a"], reason="lost")
    assert calls == 1
    assert isinstance(stored, UnderReplicated)
    assert stored.missing == ("a",)
    assert (await urm.get(4)) == stored


async def test_each_bookie_keeps_the_time_it_was_first_marked(root: str) -> None:
    clock = iter(range(1000, 100_000, 1000))
    urm = UnderReplicationManager(MemoryStore(), root, now_ms=lambda: next(clock))
    first = await urm.mark(8, ["a"], reason="check")
    later = await urm.mark(8, ["a", "b"], reason="lost")
    assert later.since_ms("a") == first.marked_ms
    assert later.since_ms("b") > first.marked_ms
    assert later.marked_ms == first.marked_ms
    left = await urm.resolve(8, ["a"])
    assert left is not None
    assert left.since == (("b", later.since_ms("b")),)
    assert (await urm.get(8)) == left
    legacy = msgpack.packb({"format_version": 1, "missing": ["c"], "marked_ms": 5, "reasons": ["lost"]})
    await urm.store.put(urm.keys.underreplicated(9), legacy)
    old = await urm.get(9)
    assert old is not None
    assert old.since_ms("c") == 5


async def test_a_foreign_key_among_the_marks_is_skipped_not_a_stop(store: MetadataStore, root: str) -> None:
    """A key under the marks' prefix that is no ledger id (hand-written, another tool's) is no mark:
    it must not stop the listing (every worker pass, the bookie GC's scan, the daemon's count)."""
    urm = UnderReplicationManager(store, root)
    for ledger_id in (5, 7, 9):
        await urm.mark(ledger_id, ["b"], reason="lost")
    prefix = urm.keys.underreplicated_prefix
    # between marks (7 short, "00...08x" after 7's key) and past the last one
    for tail in ("7", "0000000000000000008x", "zzz", "0000000000000000006/sub"):
        await store.put(prefix + tail, b"hand-written")
    skipped: list[int] = []
    for page_size in (1, 2, 1000):  # a page may end on a foreign key: the next goes on after it
        listed = [
            m.ledger_id
            async for m in urm.iter_marks(page_size=page_size, on_undecodable=lambda i, _: skipped.append(i))
        ]
        assert listed == [5, 7, 9]
    assert skipped == []
    assert [m.ledger_id async for m in urm.iter_marks(page_size=1)] == [5, 7, 9]
    assert await urm.count() == 3
    marks, _ = await urm.list_page(limit=1000)
    assert [m.ledger_id for m in marks] == [5, 7, 9]


async def test_each_bookie_keeps_its_own_reasons(store: MetadataStore, root: str) -> None:
    """Why each bookie was marked (a ``replaced`` bookie's copies are gone though it is registered:
    its writer's fragment is not exempt as a restarted one's is), merged by CAS, dropped on resolve."""
    urm = UnderReplicationManager(store, root)
    await urm.mark(4, ["a", "b"], reason="lost")
    mark = await urm.mark(4, ["c"], reason="replaced")
    assert mark.reasons == ("lost", "replaced")
    assert (mark.reasons_of("a"), mark.reasons_of("c")) == (("lost",), ("replaced",))
    # a reason the mark already has, for a bookie that lacked it: still written
    mark = await urm.mark(4, ["b"], reason="replaced")
    assert mark.reasons_of("b") == ("lost", "replaced")
    assert mark.reasons_of("a") == ("lost",)
    assert await urm.get(4) == mark
    left = await urm.resolve(4, ["b"])
    assert left is not None
    assert left.bookie_reasons == (("a", ("lost",)), ("c", ("replaced",)))
    assert await urm.get(4) == left
    # a mark written before per-bookie reasons: every bookie's are the mark's
    old = msgpack.packb(
        {"format_version": 1, "missing": ["x", "y"], "marked_ms": 1, "reasons": ["lost", "replaced"]}
    )
    await store.put(urm.keys.underreplicated(6), old)
    legacy = await urm.get(6)
    assert legacy is not None
    assert legacy.reasons_of("x") == ("lost", "replaced")
    merged = await urm.mark(6, ["z"], reason="lost")
    assert (merged.reasons_of("x"), merged.reasons_of("z")) == (("lost", "replaced"), ("lost",))
    await store.put(
        urm.keys.underreplicated(8), msgpack.packb({**msgpack.unpackb(old), "bookie_reasons": [1]})
    )
    with pytest.raises(MetadataFormatError, match="bookie_reasons"):
        await urm.get(8)


async def test_restamp_sets_the_found_bookies_since_under_the_lock(store: MetadataStore, root: str) -> None:
    now = [1_000]
    urm = UnderReplicationManager(store, root, now_ms=lambda: now[0])
    await urm.mark(8, ["a", "b"], reason="lost")
    now[0] = 5_000
    stamped = await urm.restamp(8, ["b", "not-marked"])
    assert stamped is not None
    assert (stamped.since_ms("a"), stamped.since_ms("b")) == (1_000, 5_000)
    assert await urm.get(8) == stamped
    assert (await urm.restamp(8, ["b"])).version == stamped.version  # type: ignore[union-attr]
    assert await urm.restamp(99, ["a"]) is None
    lease = await store.grant_lease(5)
    lock = await urm.acquire(8, "w", lease)
    assert lock is not None
    await store.revoke_lease(lease)  # the lock goes with its lease: the restamp is refused
    now[0] = 9_000
    with pytest.raises(GuardFailed):
        await urm.restamp(8, ["a"], lock=lock)
    assert await urm.get(8) == stamped


async def test_instances_are_recorded_by_cas(store: MetadataStore, root: str) -> None:
    urm = UnderReplicationManager(store, root)
    assert await urm.seen_instance("b0") is None
    assert await urm.record_instance("b0", "disk-1", None)
    first = await urm.seen_instance("b0")
    assert first is not None
    assert first.instance == "disk-1"
    assert not await urm.record_instance("b0", "disk-x", None)  # recorded meanwhile
    assert await urm.record_instance("b0", "disk-2", first)
    assert not await urm.record_instance("b0", "disk-3", first)  # stale: it changed since
    second = await urm.seen_instance("b0")
    assert second is not None
    assert second.instance == "disk-2"


async def test_forget_instance_deletes_only_the_decommissioned_instance(
    store: MetadataStore, root: str
) -> None:
    urm = UnderReplicationManager(store, root)
    assert await urm.forget_instance("b0", "disk-1")  # nothing recorded: nothing left
    assert await urm.record_instance("b0", "disk-1", None)
    assert await urm.forget_instance("b0", "disk-1")
    assert await urm.seen_instance("b0") is None
    # the bookie came back with a new data dir and an auditor recorded it before the old cookie's
    # decommission got there: the fresh record stays (it tells that bookie's next replacement)
    assert await urm.record_instance("b0", "disk-2", None)
    assert not await urm.forget_instance("b0", "disk-1")
    fresh = await urm.seen_instance("b0")
    assert fresh is not None
    assert fresh.instance == "disk-2"
    assert await urm.forget_instance("b0", None)  # no cookie left to name one: whatever is recorded
    assert await urm.seen_instance("b0") is None


async def test_forget_instance_keeps_a_record_rewritten_between_its_read_and_delete(
    store: MetadataStore, root: str
) -> None:
    """The delete is at the version read: a record an auditor rewrote in between stays."""
    urm = UnderReplicationManager(store, root)
    assert await urm.record_instance("b0", "disk-1", None)
    key = urm.keys.replication_instance("b0")
    real_get = store.get

    async def get_then_rewrite(wanted: str) -> object:
        current = await real_get(wanted)
        if wanted == key and current is not None:
            await store.compare_and_set(key, b"disk-1", current.version)  # same instance, new version
        return current

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "get", get_then_rewrite)
        assert not await urm.forget_instance("b0", "disk-1")
    assert await urm.seen_instance("b0") is not None
