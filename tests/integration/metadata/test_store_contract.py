"""The MetadataStore contract, run against the memory and the etcd driver alike."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from metadata.errors import BadVersion, GuardFailed, LeaseExpired, NodeExists, NoNode, WatchCompacted
from metadata.etcd import EtcdStore
from metadata.memory import MemoryStore
from metadata.store import EventKind, Guard, MetadataStore, WatchEvent, list_all
from tests.integration.metadata.conftest import compact


async def test_create_then_get_returns_value_and_version(store: MetadataStore, root: str) -> None:
    version = await store.create(f"{root}/a", b"one")
    got = await store.get(f"{root}/a")
    assert got is not None
    assert (got.value, got.version, got.create_revision) == (b"one", version, version)
    assert await store.get(f"{root}/missing") is None


async def test_create_existing_key_raises_node_exists(store: MetadataStore, root: str) -> None:
    await store.create(f"{root}/a", b"one")
    with pytest.raises(NodeExists):
        await store.create(f"{root}/a", b"two")
    got = await store.get(f"{root}/a")
    assert got is not None
    assert got.value == b"one"


async def test_cas_applies_only_at_the_expected_version(store: MetadataStore, root: str) -> None:
    v1 = await store.create(f"{root}/a", b"one")
    v2 = await store.compare_and_set(f"{root}/a", b"two", v1)
    assert v2 > v1
    with pytest.raises(BadVersion) as info:
        await store.compare_and_set(f"{root}/a", b"stale", v1)
    assert (info.value.expected, info.value.actual) == (v1, v2)
    got = await store.get(f"{root}/a")
    assert got is not None
    assert (got.value, got.version) == (b"two", v2)


async def test_cas_on_missing_key_raises_no_node(store: MetadataStore, root: str) -> None:
    with pytest.raises(NoNode):
        await store.compare_and_set(f"{root}/nope", b"x", 1)
    # Version 0 is a missing key's mod_revision in etcd: still NoNode, and nothing written.
    with pytest.raises(NoNode):
        await store.compare_and_set(f"{root}/nope", b"x", 0)
    assert await store.get(f"{root}/nope") is None
    with pytest.raises(GuardFailed):  # a failed guard is named first, as for any version
        await store.compare_and_set(f"{root}/nope", b"x", 0, guards=(Guard(f"{root}/g", 7),))
    version = await store.create(f"{root}/there", b"x")
    with pytest.raises(BadVersion) as info:
        await store.compare_and_set(f"{root}/there", b"y", 0)
    assert (info.value.expected, info.value.actual) == (0, version)


async def test_revoking_a_lease_deletes_all_its_keys_in_one_revision(store: MetadataStore, root: str) -> None:
    lease = await store.grant_lease(5)
    for name in ("a", "b", "c"):
        await store.create(f"{root}/l/{name}", b"x", lease_id=lease)
    before = await store.current_revision()
    events: list[WatchEvent] = []
    watch = store.watch(f"{root}/l/", prefix=True, start_revision=before + 1)
    await store.revoke_lease(lease)
    assert await store.current_revision() == before + 1
    async for event in watch:
        events.append(event)
        if len(events) == 3:
            break
    await watch.aclose()
    assert [(e.kind, e.key, e.revision) for e in events] == [
        (EventKind.DELETE, f"{root}/l/{name}", before + 1) for name in ("a", "b", "c")
    ]
    assert (await store.list(f"{root}/l/", revision=before)).items != ()  # the history before holds them


async def test_a_listing_at_a_revision_gives_each_key_as_it_was_then(store: MetadataStore, root: str) -> None:
    """Value, version and create revision as of that revision (the auditor reads a ledger's
    metadata as it was before a bookie's new data dir registered: autorecovery, *replaced*)."""
    v1 = await store.create(f"{root}/r/a", b"one")
    v2 = await store.compare_and_set(f"{root}/r/a", b"two", v1)
    old = await store.create(f"{root}/r/b", b"first")
    await store.delete(f"{root}/r/b")
    new = await store.create(f"{root}/r/b", b"again")
    later = await store.create(f"{root}/r/c", b"later")

    async def at(revision: int) -> list[tuple[str, bytes, int, int]]:
        page = await store.list(f"{root}/r/", revision=revision)
        return [(kv.key.rsplit("/", 1)[1], kv.value, kv.version, kv.create_revision) for kv in page.items]

    assert await at(v1) == [("a", b"one", v1, v1)]
    assert await at(old) == [("a", b"two", v2, v1), ("b", b"first", old, old)]
    assert await at(new) == [("a", b"two", v2, v1), ("b", b"again", new, new)]
    assert await at(later - 1) == await at(new)
    exact = await store.list(f"{root}/r/a", limit=1, revision=v1)  # one key, as the ledger manager reads it
    assert [(kv.value, kv.version) for kv in exact.items] == [(b"one", v1)]


async def test_a_start_after_below_the_prefix_lists_from_the_prefix_itself(
    store: MetadataStore, root: str
) -> None:
    prefix = f"{root}/p"
    for key in (prefix, f"{prefix}/a", f"{prefix}x"):
        await store.put(key, b"v")
    revision = await store.current_revision()
    await store.put(f"{prefix}/b", b"later")
    for at, later in ((None, [f"{prefix}/b"]), (revision, [])):
        below = await store.list(prefix, start_after=f"{root}/", revision=at)
        assert [kv.key for kv in below.items] == [prefix, f"{prefix}/a", *later, f"{prefix}x"]
        equal = await store.list(prefix, start_after=prefix, revision=at)  # start_after excluded
        assert [kv.key for kv in equal.items] == [f"{prefix}/a", *later, f"{prefix}x"]


async def test_versions_increase_across_keys_and_never_repeat_after_recreate(
    store: MetadataStore, root: str
) -> None:
    v1 = await store.create(f"{root}/a", b"1")
    v2 = await store.create(f"{root}/b", b"2")
    await store.delete(f"{root}/a", v1)
    v3 = await store.create(f"{root}/a", b"3")
    assert v1 < v2 < v3
    with pytest.raises(BadVersion):
        await store.compare_and_set(f"{root}/a", b"x", v1)


async def test_delete_with_and_without_version(store: MetadataStore, root: str) -> None:
    v1 = await store.create(f"{root}/a", b"1")
    with pytest.raises(BadVersion):
        await store.delete(f"{root}/a", v1 + 1000)
    await store.delete(f"{root}/a", v1)
    assert await store.get(f"{root}/a") is None
    with pytest.raises(NoNode):
        await store.delete(f"{root}/a")
    await store.create(f"{root}/b", b"1")
    await store.delete(f"{root}/b")
    assert await store.get(f"{root}/b") is None


def _small_reply_store(store: MetadataStore) -> MetadataStore:
    """A store of ``store``'s kind (and etcd) whose listing replies stop at 1 MiB."""
    if isinstance(store, MemoryStore):
        return MemoryStore(list_reply_bytes_max=1024 * 1024)
    assert isinstance(store, EtcdStore)
    return EtcdStore(dataclasses.replace(store.config, reply_bytes_max=1024 * 1024))


async def test_list_takes_a_page_larger_than_grpc_default_limit(store: MetadataStore, root: str) -> None:
    """A page of large values (6 MiB: more than gRPC's default 4 MiB receive limit) comes back
    whole; a keys-only listing leaves the values out and keeps the versions."""
    value = b"v" * (512 * 1024)
    versions = [await store.put(f"{root}/big/{i:02d}", value) for i in range(12)]
    page = await store.list(f"{root}/big/", limit=1000)
    assert [kv.version for kv in page.items] == versions
    assert all(kv.value == value for kv in page.items)
    assert not page.more
    keys = await store.list(f"{root}/big/", limit=1000, keys_only=True)
    assert [(kv.key, kv.version, kv.value) for kv in keys.items] == [
        (kv.key, kv.version, b"") for kv in page.items
    ]


async def test_a_listing_too_large_for_one_reply_comes_in_short_pages(
    store: MetadataStore, root: str
) -> None:
    """Past the reply limit a page stops short (``more``), never fails: paging on lists every
    key, from one snapshot too; a keys-only listing of the same keys fits one page."""
    small = _small_reply_store(store)
    try:
        value = b"w" * (200 * 1024)
        for i in range(12):
            await small.put(f"{root}/big/{i:02d}", value)
        first = await small.list(f"{root}/big/", limit=1000)
        assert 1 <= len(first.items) < 12
        assert first.more
        everything, _ = await list_all(small, f"{root}/big/", page_size=1000)
        assert [kv.key for kv in everything] == [f"{root}/big/{i:02d}" for i in range(12)]
        assert all(kv.value == value for kv in everything)
        keys = await small.list(f"{root}/big/", limit=1000, keys_only=True)
        assert (len(keys.items), keys.more) == (12, False)
    finally:
        await small.close()


async def test_list_pages_in_key_order_within_prefix_only(store: MetadataStore, root: str) -> None:
    for i in (3, 1, 4, 0, 2):
        await store.put(f"{root}/l/{i:02d}", str(i).encode())
    await store.put(f"{root}/l0", b"neighbour")  # shares the textual prefix without the slash
    await store.put(f"{root}/k", b"before")
    first = await store.list(f"{root}/l/", limit=2)
    assert [kv.key for kv in first.items] == [f"{root}/l/00", f"{root}/l/01"]
    assert first.more
    second = await store.list(f"{root}/l/", start_after=first.items[-1].key, limit=2)
    third = await store.list(f"{root}/l/", start_after=second.items[-1].key, limit=2)
    assert [kv.key for kv in second.items] == [f"{root}/l/02", f"{root}/l/03"]
    assert [kv.value for kv in third.items] == [b"4"]
    assert not third.more
    everything, revision = await list_all(store, f"{root}/l/", page_size=2)
    assert len(everything) == 5
    assert revision >= max(kv.version for kv in everything)


async def _collect(events: list[WatchEvent], gen: object, count: int) -> None:
    async with contextlib.aclosing(gen) as stream:  # type: ignore[type-var]
        async for event in stream:
            events.append(event)
            if len(events) == count:
                return


async def test_watch_prefix_sees_puts_and_deletes_in_order(store: MetadataStore, root: str) -> None:
    start = await store.current_revision() + 1
    v = await store.create(f"{root}/w/a", b"1")
    await store.compare_and_set(f"{root}/w/a", b"2", v)
    await store.put(f"{root}/other", b"ignored")
    await store.delete(f"{root}/w/a")
    events: list[WatchEvent] = []
    await asyncio.wait_for(
        _collect(events, store.watch(f"{root}/w/", prefix=True, start_revision=start), 3), 5
    )
    assert [(e.kind, e.key, e.value) for e in events] == [
        (EventKind.PUT, f"{root}/w/a", b"1"),
        (EventKind.PUT, f"{root}/w/a", b"2"),
        (EventKind.DELETE, f"{root}/w/a", None),
    ]
    assert events[0].revision == v
    assert events[0].revision < events[1].revision < events[2].revision


async def test_watch_single_key_delivers_live_changes(store: MetadataStore, root: str) -> None:
    v = await store.create(f"{root}/k", b"0")
    events: list[WatchEvent] = []
    watcher = asyncio.create_task(_collect(events, store.watch(f"{root}/k", start_revision=v + 1), 2))
    await asyncio.sleep(0.2)
    await store.put(f"{root}/k2", b"not this one")
    v2 = await store.compare_and_set(f"{root}/k", b"1", v)
    await store.compare_and_set(f"{root}/k", b"2", v2)
    await asyncio.wait_for(watcher, 5)
    assert [e.value for e in events] == [b"1", b"2"]


async def test_lease_revoke_deletes_bound_keys_and_keepalive_then_fails(
    store: MetadataStore, root: str
) -> None:
    lease = await store.grant_lease(5)
    assert await store.keepalive(lease) == 5
    await store.create(f"{root}/eph", b"x", lease_id=lease)
    got = await store.get(f"{root}/eph")
    assert got is not None
    assert got.lease_id == lease
    await store.revoke_lease(lease)
    assert await store.get(f"{root}/eph") is None
    with pytest.raises(LeaseExpired):
        await store.keepalive(lease)
    await store.revoke_lease(lease)  # revoking again is not an error
    with pytest.raises(LeaseExpired):
        await store.create(f"{root}/eph2", b"x", lease_id=lease)


async def test_cas_keeps_the_lease_binding(store: MetadataStore, root: str) -> None:
    lease = await store.grant_lease(5)
    v = await store.create(f"{root}/eph", b"x", lease_id=lease)
    await store.compare_and_set(f"{root}/eph", b"y", v)
    got = await store.get(f"{root}/eph")
    assert got is not None
    assert got.lease_id == lease
    await store.revoke_lease(lease)
    assert await store.get(f"{root}/eph") is None


async def test_lease_expires_without_keepalive(store: MetadataStore, root: str) -> None:
    lease = await store.grant_lease(2)
    await store.create(f"{root}/eph", b"x", lease_id=lease)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while await store.get(f"{root}/eph") is not None:
        assert loop.time() < deadline, "leased key outlived its TTL by far"
        await asyncio.sleep(0.1)
    with pytest.raises(LeaseExpired):
        await store.keepalive(lease)


async def test_guarded_writes_apply_only_while_every_guard_holds(store: MetadataStore, root: str) -> None:
    """A guard is a key at a version, compared in the same atomic step as the write: the lock
    holder's CAS (autorecovery) commits only while its lock key is still the one it took."""
    lease = await store.grant_lease(5)
    lock = await store.create(f"{root}/lock", b"w1", lease_id=lease)
    other = await store.create(f"{root}/other", b"o")
    v1 = await store.create(f"{root}/a", b"one")
    guards = (Guard(f"{root}/lock", lock), Guard(f"{root}/other", other))
    v2 = await store.compare_and_set(f"{root}/a", b"two", v1, guards=guards)
    assert v2 > v1
    # a guard at another version: refused, nothing written, the key names it
    with pytest.raises(GuardFailed) as info:
        await store.compare_and_set(f"{root}/a", b"x", v2, guards=(Guard(f"{root}/lock", lock + 1),))
    assert (info.value.guard, info.value.expected, info.value.actual) == (f"{root}/lock", lock + 1, lock)
    # a failing guard wins over a stale version: the caller's authority is gone either way
    with pytest.raises(GuardFailed):
        await store.compare_and_set(f"{root}/a", b"x", v1, guards=(Guard(f"{root}/missing", 7),))
    with pytest.raises(BadVersion):  # the guards hold, the version does not
        await store.compare_and_set(f"{root}/a", b"x", v1, guards=guards)
    with pytest.raises(NoNode):
        await store.compare_and_set(f"{root}/none", b"x", v1, guards=guards)
    got = await store.get(f"{root}/a")
    assert got is not None
    assert (got.value, got.version) == (b"two", v2)
    # the lease goes (a pause past the TTL): its key is gone, so is every write it guarded
    await store.revoke_lease(lease)
    with pytest.raises(GuardFailed) as gone:
        await store.compare_and_set(f"{root}/a", b"x", v2, guards=guards)
    assert gone.value.actual is None
    with pytest.raises(GuardFailed):
        await store.delete(f"{root}/a", v2, guards=guards)
    with pytest.raises(GuardFailed):
        await store.delete(f"{root}/a", guards=guards)
    # taken again (by another holder): a new version, the old holder's guard still fails
    retaken = await store.create(f"{root}/lock", b"w2")
    assert retaken != lock
    with pytest.raises(GuardFailed):
        await store.compare_and_set(f"{root}/a", b"x", v2, guards=(Guard(f"{root}/lock", lock),))
    assert (await store.get(f"{root}/a")) == got
    fresh = (Guard(f"{root}/lock", retaken),)
    await store.delete(f"{root}/a", v2, guards=fresh)
    assert await store.get(f"{root}/a") is None
    with pytest.raises(NoNode):
        await store.delete(f"{root}/a", guards=fresh)


async def test_a_guard_at_version_zero_holds_while_its_key_is_absent(store: MetadataStore, root: str) -> None:
    # etcd compares a missing key's mod_revision as 0: Guard(k, 0) means "k does not exist"
    v1 = await store.create(f"{root}/a", b"one")
    absent = (Guard(f"{root}/absent", 0),)
    v2 = await store.compare_and_set(f"{root}/a", b"two", v1, guards=absent)
    with pytest.raises(BadVersion):  # the guard holds, the version does not: not a GuardFailed
        await store.compare_and_set(f"{root}/a", b"x", v1, guards=absent)
    await store.create(f"{root}/absent", b"now present")
    with pytest.raises(GuardFailed):
        await store.compare_and_set(f"{root}/a", b"x", v2, guards=absent)
    got = await store.get(f"{root}/a")
    assert got is not None
    assert (got.value, got.version) == (b"two", v2)


async def test_pages_read_at_the_first_page_revision_form_one_snapshot(
    store: MetadataStore, root: str
) -> None:
    for name in ("a", "b", "c"):
        await store.create(f"{root}/p/{name}", b"1")
    first = await store.list(f"{root}/p/", limit=1)
    await store.delete(f"{root}/p/b")
    await store.create(f"{root}/p/bb", b"2")
    await store.put(f"{root}/p/c", b"changed")
    rest = await store.list(f"{root}/p/", start_after=first.items[-1].key, limit=10, revision=first.revision)
    assert [kv.key.rsplit("/", 1)[1] for kv in rest.items] == ["b", "c"]
    assert [kv.value for kv in rest.items] == [b"1", b"1"]
    assert not rest.more
    paged = await store.list(f"{root}/p/", start_after=first.items[-1].key, limit=1, revision=first.revision)
    assert ([kv.key.rsplit("/", 1)[1] for kv in paged.items], paged.more) == (["b"], True)
    now = await store.list(f"{root}/p/", start_after=first.items[-1].key, limit=10)
    assert [kv.key.rsplit("/", 1)[1] for kv in now.items] == ["bb", "c"]
    await compact(store)
    with pytest.raises(WatchCompacted):  # that snapshot is gone now
        await store.list(f"{root}/p/", limit=10, revision=first.revision)
