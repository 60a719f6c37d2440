"""LedgerManager and IdGenerator against both drivers: create, CAS loop, delete, list, watch."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import msgpack
import pytest

from metadata import ledger_metadata as serde
from metadata.errors import (
    BadVersion,
    CasResultUnknown,
    MetadataError,
    MetadataFormatError,
    NodeExists,
    NoSuchLedger,
    WatchCompacted,
)
from metadata.idgen import IdGenerator, raise_counter, read_counter
from metadata.ledger_manager import UNCHANGED, LedgerIdPage, LedgerManager, VersionedLedger
from metadata.ledger_metadata import LedgerMetadata, LedgerState, ReplacedBookie
from metadata.memory import MemoryStore
from metadata.store import KeyValue, MetadataStore
from tests.integration.metadata.conftest import WatchCounter, compact

BOOKIES = ("127.0.0.1:3181", "127.0.0.1:3182", "127.0.0.1:3183")


async def create(manager: LedgerManager) -> VersionedLedger:
    return await manager.create(BOOKIES, write_quorum=2, ack_quorum=2, password_hash=b"\x01" * 32)


async def test_create_assigns_distinct_ids_and_read_returns_it(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    first, second = await create(manager), await create(manager)
    assert first.ledger_id != second.ledger_id
    read = await manager.read(first.ledger_id)
    assert read == first
    assert read.metadata.state is LedgerState.OPEN
    assert read.metadata.ctime_ms > 0


async def test_read_missing_ledger_raises_no_such_ledger(store: MetadataStore, root: str) -> None:
    with pytest.raises(NoSuchLedger) as info:
        await LedgerManager(store, root).read(123)
    assert info.value.ledger_id == 123


async def test_create_metadata_with_existing_id_raises_node_exists(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    with pytest.raises(NodeExists):
        await manager.create_metadata(created.metadata)


async def test_create_never_overwrites_a_ledger_holding_the_id_the_counter_went_back_to(
    store: MetadataStore, root: str
) -> None:
    """A restored snapshot moves the counter back: the next ids the counter hands out may be held
    by ledgers created after the snapshot. Create moves on to a fresh id above them instead of
    raising a raw NodeExists (or overwriting)."""
    manager = LedgerManager(store, root, id_block_size=10)
    first = await create(manager)
    squatted = [first.ledger_id + 1, first.ledger_id + 2]  # held already, the counter does not know
    others = {
        i: dataclasses.replace(first.metadata, ledger_id=i, password_hash=b"\x02" * 32) for i in squatted
    }
    for md in others.values():
        await manager.create_metadata(md)
    created = await create(manager)
    assert created.ledger_id > max(squatted)
    for ledger_id, md in others.items():
        assert (await manager.read(ledger_id)).metadata == md  # untouched
    assert (await manager.read(created.ledger_id)).metadata.password_hash == b"\x01" * 32
    # A fresh manager (another client) claims its block above the counter: unaffected.
    assert (await create(LedgerManager(store, root))).ledger_id > created.ledger_id


async def test_an_update_keeps_the_fields_a_newer_writer_added(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    key = manager.keys.ledger(created.ledger_id)
    stored = await store.get(key)
    assert stored is not None
    body = msgpack.unpackb(stored.value.removeprefix(serde.MAGIC))
    await store.compare_and_set(
        key, serde.MAGIC + msgpack.packb({**body, "future_field": [1, "x"]}), stored.version
    )  # a newer client's write, same format_version
    await manager.update(created.ledger_id, lambda md: md.closed(-1, 0))
    after = await store.get(key)
    assert after is not None
    written = msgpack.unpackb(after.value.removeprefix(serde.MAGIC))
    assert written["future_field"] == [1, "x"]
    assert written["state"] == "CLOSED"


async def test_raise_counter_moves_the_id_counter_up_never_down(store: MetadataStore, root: str) -> None:
    key = f"{root}/idgen"
    assert await read_counter(store, key) == 1
    assert await raise_counter(store, key, 500) == (1, 500)  # a missing counter is created
    assert await raise_counter(store, key, 200) == (500, 500)  # never down
    manager = LedgerManager(store, root)
    assert (await create(manager)).ledger_id == 500
    assert await read_counter(store, key) == 1500  # the block [500, 1500) claimed
    assert await raise_counter(store, key, 10_000) == (1500, 10_000)
    assert (await create(LedgerManager(store, root))).ledger_id == 10_000
    with pytest.raises(MetadataError, match="ids are"):
        await raise_counter(store, key, 0)


async def test_update_applies_transform_and_rereads_on_conflict(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    # Someone else changes the ledger behind our back: our single CAS must fail...
    await manager.write(created.metadata.with_custom_metadata({"other": b"1"}), created.version)
    with pytest.raises(BadVersion):
        await manager.write(created.metadata.in_recovery(), created.version)
    # ...while the loop re-reads and re-evaluates on the fresh metadata.
    seen: list[LedgerMetadata] = []

    def mark_recovering(current: LedgerMetadata) -> LedgerMetadata:
        seen.append(current)
        return current.in_recovery()

    updated = await manager.update(created.ledger_id, mark_recovering)
    assert updated.metadata.state is LedgerState.IN_RECOVERY
    assert updated.metadata.custom_metadata["other"] == b"1"
    assert updated == await manager.read(created.ledger_id)


async def test_update_stops_on_unchanged_and_propagates_transform_errors(
    store: MetadataStore, root: str
) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    closed = await manager.update(created.ledger_id, lambda md: md.closed(-1, 0))

    def close_again(current: LedgerMetadata) -> LedgerMetadata:
        return current.closed(5, 10)

    def close_idempotent(current: LedgerMetadata) -> LedgerMetadata | object:
        return UNCHANGED if current.is_closed and current.last_entry_id == -1 else current.closed(-1, 0)

    assert await manager.update(created.ledger_id, close_idempotent) == closed  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="illegal transition CLOSED -> CLOSED"):
        await manager.update(created.ledger_id, close_again)
    assert (await manager.read(created.ledger_id)).version == closed.version


async def test_concurrent_cas_increments_lose_nothing(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    tasks, per_task = 20, 3

    def increment(current: LedgerMetadata) -> LedgerMetadata:
        value = int(current.custom_metadata.get("count", b"0"))
        return current.with_custom_metadata({"count": str(value + 1).encode()})

    async def worker() -> None:
        for _ in range(per_task):
            await manager.update(created.ledger_id, increment)

    async with asyncio.TaskGroup() as group:
        for _ in range(tasks):
            group.create_task(worker())
    final = await manager.read(created.ledger_id)
    assert int(final.metadata.custom_metadata["count"]) == tasks * per_task


async def test_delete_with_version_then_gone(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    with pytest.raises(BadVersion):
        await manager.delete(created.ledger_id, created.version + 999)
    await manager.delete(created.ledger_id, created.version)
    assert not await manager.exists(created.ledger_id)
    with pytest.raises(NoSuchLedger):
        await manager.delete(created.ledger_id)


async def test_list_pages_through_all_ledgers_in_id_order(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    ids = [(await create(manager)).ledger_id for _ in range(7)]
    page = await manager.list_page(limit=3)
    assert page.ledger_ids == tuple(sorted(ids)[:3])
    assert page.more
    assert [i async for i in manager.iter_ledger_ids(page_size=3)] == sorted(ids)


async def test_ledgers_with_the_largest_custom_metadata_list_and_read_in_pages(
    store: MetadataStore, root: str
) -> None:
    """Ten ledgers at the custom metadata limit (64 x 8 KiB each: a 5 MiB page, past gRPC's default
    4 MiB reply limit) list in one page of ids and read in one page of metadata."""
    manager = LedgerManager(store, root)
    custom = {f"k{i:02d}": bytes([i]) * serde.CUSTOM_METADATA_VALUE_BYTES_MAX for i in range(64)}
    created = [
        await manager.create(BOOKIES, write_quorum=2, ack_quorum=2, custom_metadata=custom) for _ in range(10)
    ]
    ids = tuple(sorted(v.ledger_id for v in created))
    assert await manager.list_page(limit=1000) == LedgerIdPage(ids, False)
    page = await manager.read_page(limit=1000)
    assert (page.ledger_ids, page.more) == (ids, False)
    assert {i: v.metadata for i, v in page.ledgers.items()} == {v.ledger_id: v.metadata for v in created}


async def test_read_page_lists_ledgers_with_their_metadata(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    created = [await create(manager) for _ in range(5)]
    ids = sorted(v.ledger_id for v in created)
    page = await manager.read_page(start_after=ids[0], limit=3)
    assert (page.ledger_ids, page.more) == (tuple(ids[1:4]), True)
    assert {i: v.metadata for i, v in page.ledgers.items()} == {
        v.ledger_id: v.metadata for v in created if v.ledger_id in ids[1:4]
    }
    assert page.ledgers[ids[1]].version == (await manager.read(ids[1])).version
    # a scan for the copies one bookie may not need decodes only ledgers that may not list it
    moved = created[2].metadata.with_ensemble_change(0, ["b9", *created[2].metadata.ensembles[0][1][1:]])
    bookie = created[2].metadata.ensembles[0][1][0]
    await manager.write(moved.with_replaced_bookies([ReplacedBookie(0, bookie, "b9", 1)]), created[2].version)
    page = await manager.read_page(limit=10, not_holding=bookie)
    assert page.ledger_ids == tuple(ids)
    assert not page.more
    assert list(page.ledgers) == [created[2].ledger_id]
    page = await manager.read_page(limit=10, not_holding="b9")  # listed nowhere (but in the history)
    assert list(page.ledgers) == ids


async def test_read_at_gives_the_metadata_as_it_was_at_a_revision(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    before = await store.current_revision()
    changed = await manager.write(
        created.metadata.with_ensemble_change(3, (BOOKIES[0], BOOKIES[1], "127.0.0.1:3184")), created.version
    )
    assert await manager.read_at(created.ledger_id, before) == created  # from the store's history
    assert await manager.read_at(created.ledger_id, changed.version) == changed
    assert await manager.read_at(created.ledger_id, created.version - 1) is None  # not created yet
    unchanged = await create(manager)
    assert await manager.read_at(unchanged.ledger_id, unchanged.version) == unchanged
    await compact(store)
    with pytest.raises(WatchCompacted):  # that history is gone
        await manager.read_at(created.ledger_id, before)
    # what needs no history is still known: unchanged since, or created after
    assert await manager.read_at(unchanged.ledger_id, await store.current_revision()) == unchanged
    assert await manager.read_at(unchanged.ledger_id, unchanged.version - 1) is None
    await manager.delete(unchanged.ledger_id)
    with pytest.raises(NoSuchLedger):
        await manager.read_at(unchanged.ledger_id, unchanged.version)


async def test_garbage_in_a_ledger_key_gives_a_decode_error_naming_the_ledger(
    store: MetadataStore, root: str
) -> None:
    manager = LedgerManager(store, root)
    await store.put(manager.keys.ledger(4242), b"this is not ledger metadata")
    with pytest.raises(MetadataFormatError) as info:
        await manager.read(4242)
    assert "ledger 4242" in str(info.value)
    assert info.value.key == manager.keys.ledger(4242)


async def test_watch_yields_current_then_changes_then_none_on_delete(store: MetadataStore, root: str) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    seen: list[VersionedLedger | None] = []

    async def follow() -> None:
        async with contextlib.aclosing(manager.watch(created.ledger_id)) as updates:
            async for update in updates:
                seen.append(update)

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    recovering = await manager.update(created.ledger_id, lambda md: md.in_recovery())
    closed = await manager.update(created.ledger_id, lambda md: md.closed(3, 300))
    await manager.delete(created.ledger_id, closed.version)
    await asyncio.wait_for(follower, 5)
    assert seen == [created, recovering, closed, None]


async def test_id_generator_is_unique_across_generators_sharing_a_counter(
    store: MetadataStore, root: str
) -> None:
    generators = [IdGenerator(store, f"{root}/idgen", block_size=7) for _ in range(3)]
    ids: list[int] = []

    async def draw(generator: IdGenerator) -> None:
        for _ in range(30):
            ids.append(await generator.next_id())

    async with asyncio.TaskGroup() as group:
        for generator in generators:
            group.create_task(draw(generator))
            group.create_task(draw(generator))
    assert len(ids) == 180
    assert len(set(ids)) == 180
    assert min(ids) >= 1


async def test_id_generator_after_skips_its_block_and_stays_unique(store: MetadataStore, root: str) -> None:
    """``next_id(after)``: a block at or below ``after`` is dropped, and ids stay unique: another
    generator's block above it is never handed out twice."""
    old = IdGenerator(store, f"{root}/idgen", block_size=10)
    new = IdGenerator(store, f"{root}/idgen", block_size=10)
    assert await old.next_id() == 1  # old holds [1, 11)
    high = await new.next_id()  # new holds [11, 21)
    assert high == 11
    assert await old.next_id(after=high) == 21  # its own block is below: claims [21, 31)
    assert await new.next_id(after=5) == 12  # its block is above: no claim
    assert await new.next_id(after=1000) == 1001  # beyond the counter: the claim starts after it
    assert await old.next_id() == 22


async def test_id_counter_garbage_is_a_format_error(store: MetadataStore, root: str) -> None:
    await store.put(f"{root}/idgen", b"\x00garbage")
    with pytest.raises(MetadataFormatError, match="idgen"):
        await IdGenerator(store, f"{root}/idgen").next_id()


# ---- memory-only: injected lost results -----------------------------------------------------------


async def test_unknown_id_block_is_never_used() -> None:
    store = MemoryStore()
    generator = IdGenerator(store, "/r/idgen", block_size=10)
    assert await generator.next_id() == 1
    other = IdGenerator(store, "/r/idgen", block_size=10)
    store.lose_next_write_result(applied=True)  # the claim of [11, 21) applies but its answer is lost
    assert await other.next_id() == 21
    assert (await store.get("/r/idgen")).value == b"31"  # type: ignore[union-attr]


@pytest.mark.parametrize("applied", [True, False])
async def test_create_with_lost_result_is_resolved_by_reading_back(applied: bool) -> None:
    store = MemoryStore()
    manager = LedgerManager(store, "/r")
    await create(manager)  # claim the first id block before injecting
    store.lose_next_write_result(applied=applied)
    created = await create(manager)
    assert await manager.read(created.ledger_id) == created


async def test_update_with_lost_cas_result_raises_cas_result_unknown() -> None:
    from metadata.errors import CasResultUnknown

    store = MemoryStore()
    manager = LedgerManager(store, "/r")
    created = await create(manager)
    store.lose_next_write_result(applied=True)
    with pytest.raises(CasResultUnknown):
        await manager.update(created.ledger_id, lambda md: md.in_recovery())
    assert (await manager.read(created.ledger_id)).metadata.state is LedgerState.IN_RECOVERY


async def test_watch_of_a_ledger_last_written_before_a_compaction_waits_quietly(
    store: MetadataStore, root: str
) -> None:
    manager = LedgerManager(store, root)
    created = await create(manager)
    for i in range(3):
        await store.put(f"{root}/other/{i}", b"x")  # the ledger's version is now below the compaction
    await compact(store)
    watches = WatchCounter(store)
    updates = manager.watch(created.ledger_id)
    async with contextlib.aclosing(updates):
        assert await anext(updates) == created
        pending = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(0.5)
        assert not pending.done()
        assert watches.starts <= 2  # one refused (compacted), one from the current revision: no spin
        closed = await manager.update(created.ledger_id, lambda md: md.closed(-1, 0))
        assert await asyncio.wait_for(pending, 5) == closed


async def test_create_whose_lost_answer_applies_after_the_read_back_returns_the_ledger(
    store: MetadataStore, root: str
) -> None:
    manager = LedgerManager(store, root)
    real_create, real_get = store.create, store.get
    late: list[tuple[str, bytes]] = []

    async def lossy_create(key: str, value: bytes, *, lease_id: int = 0) -> int:
        if "/ledgers/" in key and not late:
            late.append((key, value))
            raise CasResultUnknown(key, "injected: answer lost, proposal still in flight")
        return await real_create(key, value, lease_id=lease_id)

    async def late_get(key: str) -> KeyValue | None:
        found = await real_get(key)
        if late and key == late[0][0] and found is None:
            await real_create(*late[0])  # the lost create applies just after the read-back
        return found

    store.create, store.get = lossy_create, late_get  # type: ignore[method-assign]
    try:
        created = await create(manager)
    finally:
        store.create, store.get = real_create, real_get  # type: ignore[method-assign]
    assert await manager.read(created.ledger_id) == created
    assert [i async for i in manager.iter_ledger_ids()] == [created.ledger_id]
    with pytest.raises(NodeExists):  # a genuine second create of the same id still fails
        await manager.create_metadata(created.metadata)
