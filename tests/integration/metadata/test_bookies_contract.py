"""Bookie registration, discovery, cookies and election against both drivers."""

from __future__ import annotations

import asyncio
import contextlib

import msgpack
import pytest

from metadata.bookies import (
    BookieInfo,
    BookieRegistration,
    BookieSet,
    BookieState,
    Cookie,
    list_bookies,
    read_cookie,
    watch_bookies,
    write_cookie,
)
from metadata.election import Election
from metadata.errors import BadVersion, CasResultUnknown, MetadataUnavailable, NodeExists
from metadata.keys import ClusterKeys
from metadata.store import Guards, KeyValue, MetadataStore
from tests.integration.metadata.conftest import WatchCounter, compact


def info(n: int) -> BookieInfo:
    return BookieInfo(f"127.0.0.1:{3180 + n}", "127.0.0.1", 3180 + n, attributes={"disk_free_bytes": "100"})


async def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_register_list_switch_state_and_deregister(store: MetadataStore, root: str) -> None:
    registration = BookieRegistration(store, root, info(1), ttl_s=5)
    await registration.start()
    try:
        listed = await list_bookies(store, root)
        assert set(listed.writable) == {"127.0.0.1:3181"}
        assert listed.writable["127.0.0.1:3181"] == info(1)
        assert not listed.readonly
        await registration.set_state(BookieState.READONLY)
        listed = await list_bookies(store, root)
        assert not listed.writable
        assert listed.readonly["127.0.0.1:3181"].state is BookieState.READONLY
    finally:
        await registration.close()
    assert await list_bookies(store, root) == BookieSet({}, {}, (await list_bookies(store, root)).revision)


async def test_second_live_registration_of_same_id_is_refused(store: MetadataStore, root: str) -> None:
    first = BookieRegistration(store, root, info(1), ttl_s=2)
    await first.start()
    try:
        second = BookieRegistration(store, root, info(1), ttl_s=2, stale_wait_s=0.5)
        with pytest.raises(NodeExists):
            await second.start()  # waits for the key to go, but the first keeps it alive
    finally:
        await first.close()


async def test_reregisters_after_lease_loss(store: MetadataStore, root: str) -> None:
    registration = BookieRegistration(store, root, info(2), ttl_s=2)
    await registration.start()
    try:
        lost_lease = registration.lease_id
        await store.revoke_lease(lost_lease)  # as if etcd had expired it while we were paused
        assert "127.0.0.1:3182" not in (await list_bookies(store, root)).writable

        async def back() -> bool:
            return "127.0.0.1:3182" in (await list_bookies(store, root)).writable

        await wait_for(back)
        assert registration.registrations == 2
        assert registration.lease_id != lost_lease
    finally:
        await registration.close()


async def test_an_unexpected_keepalive_error_is_logged_and_the_registration_lives_on(
    store: MetadataStore, root: str
) -> None:
    """The store promises only MetadataError; a stray error (a driver bug) must not end the
    keepalive task while the bookie runs: the lease would expire and the bookie vanish."""
    registration = BookieRegistration(store, root, info(4), ttl_s=2)
    await registration.start()
    real_keepalive = store.keepalive
    failures = 3

    async def flaky(lease_id: int) -> int:
        nonlocal failures
        if failures:
            failures -= 1
            raise TimeoutError  # what the etcd driver once let through on a failed re-login
        return await real_keepalive(lease_id)

    store.keepalive = flaky  # type: ignore[method-assign]

    async def registered() -> bool:
        return "127.0.0.1:3184" in (await list_bookies(store, root)).writable

    try:
        await asyncio.sleep(4.5)  # two TTLs: without keepalives the lease would have expired
        assert failures == 0
        assert registration.failure is None
        await wait_for(registered)  # kept alive (or, on a slow machine, registered again)
    finally:
        store.keepalive = real_keepalive  # type: ignore[method-assign]
        await registration.close()


async def test_watch_bookies_sees_joins_state_changes_and_leaves(store: MetadataStore, root: str) -> None:
    snapshots: list[BookieSet] = []
    done = asyncio.Event()

    async def follow() -> None:
        async with contextlib.aclosing(watch_bookies(store, root)) as updates:
            async for snapshot in updates:
                snapshots.append(snapshot)
                if len(snapshots) > 1 and not snapshot.writable and not snapshot.readonly:
                    done.set()
                    return

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    registration = BookieRegistration(store, root, info(3), ttl_s=5)
    await registration.start()
    await registration.set_state(BookieState.READONLY)
    await registration.close()
    await asyncio.wait_for(follower, 5)
    assert set(snapshots[0].writable) == set()
    assert any("127.0.0.1:3183" in s.writable for s in snapshots)
    assert any("127.0.0.1:3183" in s.readonly for s in snapshots)
    assert done.is_set()


async def test_watch_bookies_lists_again_after_a_compaction_and_marks_that_set_listed(
    store: MetadataStore, root: str
) -> None:
    """A bookie that came and went while the watch was behind a compaction goes unseen: the set
    listed again says so (``listed``), so a follower can tell a gap from a change."""
    async with contextlib.aclosing(watch_bookies(store, root)) as updates:
        first = await asyncio.wait_for(anext(updates), 5)
        assert first.listed
        assert not first.registered
        came_and_went = BookieRegistration(store, root, info(5), ttl_s=5)
        await came_and_went.start()  # the generator waits at its yield: no watch runs yet
        await came_and_went.close()
        await compact(store)  # the watch from the first listing's revision is gone
        again = await asyncio.wait_for(anext(updates), 5)
        assert again.listed
        assert not again.registered
        joined = BookieRegistration(store, root, info(6), ttl_s=5)
        await joined.start()
        try:
            change = await asyncio.wait_for(anext(updates), 5)
            assert not change.listed
            assert change.registered == {"127.0.0.1:3186"}
        finally:
            await joined.close()


async def test_an_undecodable_registration_is_skipped_but_counted_as_registered(
    store: MetadataStore, root: str
) -> None:
    good = BookieRegistration(store, root, BookieInfo("good", "127.0.0.1", 3181), ttl_s=5)
    await good.start()
    try:
        await store.put(ClusterKeys(root).bookie("writable", "garbage"), b"\xc1\xc1")
        newer = msgpack.packb({"format_version": 2, "bookie_id": "newer", "host": "h", "port": 1})
        await store.put(ClusterKeys(root).bookie("readonly", "newer"), newer)
        found = await list_bookies(store, root)
        assert set(found.writable) == {"good"}
        assert not found.readonly
        assert found.undecodable == {"garbage", "newer"}
        assert found.registered == {"good", "garbage", "newer"}
        updates = watch_bookies(store, root)
        async with contextlib.aclosing(updates):
            assert (await anext(updates)).undecodable == {"garbage", "newer"}
            await store.delete(ClusterKeys(root).bookie("writable", "garbage"))
            after = await anext(updates)
            assert after.undecodable == {"newer"}
            assert set(after.writable) == {"good"}
    finally:
        await good.close()


async def test_cookie_create_cas_and_read(store: MetadataStore, root: str) -> None:
    cookie = Cookie("127.0.0.1:3181", "inst-1", ("/data/journal",), ("/data/ledgers",))
    version = await write_cookie(store, root, cookie, None)
    with pytest.raises(NodeExists):
        await write_cookie(store, root, cookie, None)
    assert await read_cookie(store, root, cookie.bookie_id) == (cookie, version)
    moved = Cookie(cookie.bookie_id, "inst-1", ("/data2/journal",), ("/data/ledgers",))
    new_version = await write_cookie(store, root, moved, version)
    with pytest.raises(BadVersion):
        await write_cookie(store, root, cookie, version)
    assert await read_cookie(store, root, cookie.bookie_id) == (moved, new_version)
    assert await read_cookie(store, root, "other") is None


async def test_election_one_leader_then_handover_on_resign(store: MetadataStore, root: str) -> None:
    key = ClusterKeys(root).auditor
    first, second = Election(store, key, "auditor-a", ttl_s=3), Election(store, key, "auditor-b", ttl_s=3)
    observed: list[str | None] = []

    async def observe() -> None:
        async with contextlib.aclosing(first.observe()) as leaders:
            async for leader in leaders:
                observed.append(leader)
                if leader == "auditor-b":
                    return

    observer = asyncio.create_task(observe())
    await first.campaign()
    assert first.is_leader
    assert await second.leader() == "auditor-a"
    waiting = asyncio.create_task(second.campaign())
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await first.resign()
    await asyncio.wait_for(waiting, 5)
    assert second.is_leader
    assert await first.leader() == "auditor-b"
    await asyncio.wait_for(observer, 5)
    assert observed[-1] == "auditor-b"
    assert "auditor-a" in observed
    await second.close()
    assert await first.leader() is None


async def test_election_leader_learns_it_lost_the_lease(store: MetadataStore, root: str) -> None:
    election = Election(store, ClusterKeys(root).auditor, "auditor-a", ttl_s=3)
    await election.campaign()
    await store.revoke_lease(election._lease_id)  # test-only peek: simulate expiry
    await asyncio.wait_for(election.lost.wait(), 5)
    assert not election.is_leader
    await election.close()


async def test_election_standby_waits_quietly_behind_a_leader_key_older_than_a_compaction(
    store: MetadataStore, root: str
) -> None:
    key = ClusterKeys(root).auditor
    leader, standby = Election(store, key, "auditor-a", ttl_s=10), Election(store, key, "auditor-b", ttl_s=10)
    await leader.campaign()
    for i in range(3):
        await store.put(f"{root}/other/{i}", b"x")  # the leader's key is now below the compaction
    await compact(store)
    watches = WatchCounter(store)
    waiting = asyncio.create_task(standby.campaign())
    try:
        await asyncio.sleep(0.5)
        assert not waiting.done()
        assert watches.starts <= 1  # one watch from the current revision, not one per refused watch
        await leader.resign()
        await asyncio.wait_for(waiting, 5)
        assert standby.is_leader
    finally:
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await standby.close()
        await leader.close()


async def test_a_half_done_state_change_never_leaves_the_bookie_in_both_states(
    store: MetadataStore, root: str
) -> None:
    registration = BookieRegistration(store, root, BookieInfo("b1", "127.0.0.1", 3181), ttl_s=3)
    await registration.start()
    real_delete = store.delete
    failures = [MetadataUnavailable("injected: the store failed between the two steps")]

    async def flaky_delete(key: str, expected_version: int | None = None, *, guards: Guards = ()) -> None:
        if failures:
            raise failures.pop()
        await real_delete(key, expected_version, guards=guards)

    store.delete = flaky_delete  # type: ignore[method-assign]
    try:
        with pytest.raises(MetadataUnavailable):
            await registration.set_state(BookieState.READONLY)
        await registration.set_state(BookieState.READONLY)  # the caller's retry finishes the move
        found = await list_bookies(store, root)
        assert (set(found.writable), set(found.readonly)) == (set(), {"b1"})

        failures.append(MetadataUnavailable("injected again"))
        with pytest.raises(MetadataUnavailable):
            await registration.set_state(BookieState.WRITABLE)
        # no retry this time: the keepalive task (every ttl / 3) removes the stray key itself
        for _ in range(40):
            found = await list_bookies(store, root)
            if not found.readonly:
                break
            await asyncio.sleep(0.1)
        assert (set(found.writable), set(found.readonly)) == ({"b1"}, set())
    finally:
        store.delete = real_delete  # type: ignore[method-assign]
        await registration.close()


async def test_election_leader_knows_it_lost_before_another_is_elected(
    store: MetadataStore, root: str
) -> None:
    # The leader's keepalives stop getting through (each hangs, then fails, like a call to a stuck
    # etcd member); its lease then expires in the store and the standby wins. The old leader must
    # have stopped (`lost`) before that, not a failed call or a TTL later.
    key = ClusterKeys(root).auditor
    leader, standby = Election(store, key, "auditor-a", ttl_s=3), Election(store, key, "auditor-b", ttl_s=3)
    await leader.campaign()
    cut_off = leader._lease_id  # test-only peek: whose keepalives to fail
    real_keepalive = store.keepalive

    async def keepalive(lease_id: int) -> int:
        if lease_id == cut_off:
            await asyncio.sleep(2.5)
            raise MetadataUnavailable("injected: no answer within the budget")
        return await real_keepalive(lease_id)

    store.keepalive = keepalive  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    lost_at: list[float] = []

    async def note_lost() -> None:
        await leader.lost.wait()
        lost_at.append(loop.time())

    watcher = asyncio.create_task(note_lost())
    try:
        await asyncio.wait_for(standby.campaign(), 15)
        won_at = loop.time()
        assert lost_at, "the old leader still thinks it leads while another was elected"
        assert lost_at[0] < won_at
        assert not leader.is_leader
    finally:
        watcher.cancel()
        store.keepalive = real_keepalive  # type: ignore[method-assign]
        await standby.close()
        await leader.close()


async def test_election_candidate_takes_its_own_key_after_a_lost_create_answer(
    store: MetadataStore, root: str
) -> None:
    # The create's answer is lost and it applies only after the candidate read the key back (the
    # proposal was still in flight): the next create meets the candidate's own key, bound to its
    # own lease, which it keeps alive. It must take it, not wait for it to go away.
    key = ClusterKeys(root).auditor
    election = Election(store, key, "auditor-a", ttl_s=3)
    real_create, real_get = store.create, store.get
    late: list[tuple[str, bytes, int]] = []

    async def create(k: str, value: bytes, *, lease_id: int = 0) -> int:
        if k == key and not late:
            late.append((k, value, lease_id))
            raise CasResultUnknown(k, "injected: answer lost, proposal still in flight")
        return await real_create(k, value, lease_id=lease_id)

    async def get(k: str) -> KeyValue | None:
        found = await real_get(k)
        if k == key and late and found is None:
            await real_create(*late[0][:2], lease_id=late[0][2])  # applies just after the read-back
        return found

    store.create, store.get = create, get  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(election.campaign(), 5)
        assert election.is_leader
        assert await election.leader() == "auditor-a"
    finally:
        store.create, store.get = real_create, real_get  # type: ignore[method-assign]
        await election.close()
