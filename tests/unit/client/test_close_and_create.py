"""Seed 000 "Closing a ledger as a writer": the three outcomes of a lost close CAS; create/open errors."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import pytest
from structlog.testing import capture_logs

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    CasResultUnknown,
    LedgerClosed,
    LedgerCreateUnknown,
    LedgerFenced,
    MetadataConflict,
    MetadataUnavailable,
    NoSuchLedger,
    NotEnoughBookies,
    RandomPlacement,
    Unauthorized,
)
from bookkeeper_aio.client.add_pipeline import HandleState
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.errors import BKInternalError
from bookkeeper_aio.protocol import messages as m
from metadata import ledger_metadata as serde
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from metadata.memory import MemoryStore
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.client.conftest import FAST, ROOT, make_client


async def _ledger_with_three_entries(bk: BookKeeper):  # type: ignore[no-untyped-def]
    lh = await bk.create_ledger(3, 2, 2)
    for i in range(3):
        await lh.append(b"%d" % i)
    return lh


async def test_close__cas_lost_to_recovery_in_progress_is_an_error(
    bk: BookKeeper, ledgers: LedgerManager
) -> None:
    lh = await _ledger_with_three_entries(bk)
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.in_recovery(), current.version)
    with pytest.raises(LedgerFenced):
        await lh.close()
    assert (await ledgers.read(lh.id)).metadata.state is LedgerState.IN_RECOVERY


async def test_close__cas_lost_to_close_at_same_last_entry_succeeds(
    bk: BookKeeper, ledgers: LedgerManager
) -> None:
    lh = await _ledger_with_three_entries(bk)
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.closed(2, lh.length), current.version)
    await lh.close()
    assert (await ledgers.read(lh.id)).metadata.last_entry_id == 2


async def test_close__cas_lost_to_close_at_other_last_entry_is_an_error(
    bk: BookKeeper, ledgers: LedgerManager
) -> None:
    lh = await _ledger_with_three_entries(bk)
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.closed(1, 2), current.version)
    with pytest.raises(MetadataConflict):
        await lh.close()


async def test_close__cas_lost_to_harmless_change_retries(bk: BookKeeper, ledgers: LedgerManager) -> None:
    lh = await _ledger_with_three_entries(bk)
    current = await ledgers.read(lh.id)
    await ledgers.write(current.metadata.with_custom_metadata({"k": b"v"}), current.version)
    await lh.close()
    stored = (await ledgers.read(lh.id)).metadata
    assert stored.state is LedgerState.CLOSED
    assert stored.last_entry_id == 2


@pytest.mark.parametrize(("e", "qw", "qa"), [(2, 3, 2), (3, 2, 3), (3, 0, 0), (0, 0, 0)])
async def test_create__bad_quorums_fail_before_metadata_is_written(
    bk: BookKeeper, ledgers: LedgerManager, e: int, qw: int, qa: int
) -> None:
    with pytest.raises(BKInterfaceError, match="ensemble >= write_quorum >= ack_quorum"):
        await bk.create_ledger(e, qw, qa)
    assert (await ledgers.list_page()).ledger_ids == ()


async def test_create__bad_digest_is_an_interface_error(bk: BookKeeper) -> None:
    with pytest.raises(BKInterfaceError):
        await bk.create_ledger(3, 2, 2, digest="md5")


async def test_create__not_enough_bookies(ledgers: LedgerManager, cluster: FakeCluster) -> None:
    bk = make_client(ledgers, StaticDirectory(cluster.ids[:2]))
    with pytest.raises(NotEnoughBookies):
        await bk.create_ledger(3, 2, 2)
    assert (await ledgers.list_page()).ledger_ids == ()
    await bk.close()


async def test_open__wrong_password_is_unauthorized(bk: BookKeeper) -> None:
    lh = await bk.create_ledger(3, 2, 2, password=b"right")
    await lh.append(b"a")
    await lh.close()
    with pytest.raises(Unauthorized):
        await bk.open_ledger(lh.id, password=b"wrong")


async def test_open__missing_ledger_with_and_without_recovery(bk: BookKeeper) -> None:
    with pytest.raises(NoSuchLedger):
        await bk.open_ledger(12345)
    with pytest.raises(NoSuchLedger):
        await bk.open_ledger(12345, recovery=True)


async def test_read__beyond_lac_is_an_interface_error(bk: BookKeeper) -> None:
    lh = await bk.create_ledger(3, 2, 2)
    await lh.append(b"a")
    await lh.close()
    rh = await bk.open_ledger(lh.id)
    with pytest.raises(BKInterfaceError):
        rh.read(0, 1)


async def test_an_ensemble_change_that_crashes_fails_the_adds_instead_of_stranding_them(
    ledgers: LedgerManager, cluster: FakeCluster, directory: StaticDirectory
) -> None:
    """A bug in the change (here a placement policy's) used to leave the add waiting forever, and
    close() with it: the handle fails, its add with it (seed 001: close waits for adds to complete
    or fail)."""

    class BuggyPlacement(RandomPlacement):
        def replace_bookie(self, *args: Any, **kwargs: Any) -> Any:
            raise KeyError("placement bug")

    bk = BookKeeper(ledgers, directory, config=FAST, placement=BuggyPlacement(random.Random(3)))
    lh = await bk.create_ledger(3, 3, 3)
    try:
        await lh.append(b"a")
        await cluster.by_id(lh.metadata.current_ensemble[0]).kill()
        add = await lh.append_async(b"b")
        with pytest.raises(BKInternalError, match="failed unexpectedly"):
            await asyncio.wait_for(add, 5)
        assert lh.state is HandleState.FAILED
    finally:
        lh.abort()
        await bk.close()


async def test_abort_during_close_gives_the_close_caller_ledger_closed_not_a_cancel(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 3, 2)
    await lh.append(b"a")
    for bookie_id in cluster.ids:
        cluster.by_id(bookie_id).pause()
    add = await lh.append_async(b"b")  # outstanding: the close waits for it
    closer = asyncio.ensure_future(lh.close())
    await asyncio.sleep(0.05)
    lh.abort()
    with pytest.raises(LedgerClosed, match="aborted"):
        await closer
    assert not closer.cancelled()
    with pytest.raises(LedgerClosed):
        await add
    for bookie_id in cluster.ids:
        cluster.by_id(bookie_id).resume()


async def test_a_late_failure_of_an_acknowledged_entry_starts_no_change_during_close(
    ledgers: LedgerManager, directory: StaticDirectory, cluster: FakeCluster
) -> None:
    """Qw 3 > Qa 2: one bookie never answers; its adds time out after the entries were acked,
    while the close's CAS is slow. No ensemble change may start then (it raced the close's CAS,
    and outlived close())."""
    slow_cas = 0.5

    class SlowStore(MemoryStore):
        async def compare_and_set(self, *args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(slow_cas)
            return await super().compare_and_set(*args, **kwargs)

    ledgers = LedgerManager(SlowStore(), ROOT, rng=random.Random(1))
    bk = make_client(ledgers, directory, dataclasses.replace(FAST, add_timeout_s=0.3))
    try:
        slow_cas = 0.0
        lh = await bk.create_ledger(3, 3, 2)
        silent = cluster.by_id(lh.metadata.current_ensemble[2])
        silent.script = lambda r: Reply.drop() if isinstance(r, m.AddEntryRequest) else None
        for _ in range(5):
            await lh.append(b"x")
        events: list[str] = []
        lh.set_event_listener(lambda event, _: events.append(event))
        slow_cas = 0.5  # the adds to the silent bookie time out during the close's CAS
        await lh.close()
        await asyncio.sleep(0.2)
        assert "ensemble_change.started" not in events
        md = (await ledgers.read(lh.id)).metadata
        assert (md.state, md.last_entry_id, len(md.ensembles)) == (LedgerState.CLOSED, 4, 1)
    finally:
        await bk.close()


class _UnreadableLedgers(MemoryStore):
    """Reads of ledger keys fail (``MetadataUnavailable``) the next ``failing`` times (-1: until
    set back to 0)."""

    failing = 0

    async def get(self, key: str) -> Any:
        if "/ledgers/" in key and self.failing:
            self.failing -= 1 if self.failing > 0 else 0
            raise MetadataUnavailable("injected: read-back failed")
        return await super().get(key)


async def _ledger_ids(store: MemoryStore) -> list[int]:
    return [i async for i in LedgerManager(store, ROOT).iter_ledger_ids()]


async def test_create_with_a_lost_answer_reads_back_again_while_metadata_is_unavailable(
    directory: StaticDirectory,
) -> None:
    """The create applied, its answer was lost and the first read-backs fail: the create reads
    back again within its budget and returns the ledger it made (no second, orphaned ledger)."""
    store = _UnreadableLedgers()
    bk = make_client(LedgerManager(store, ROOT), directory)
    try:
        await bk.create_ledger(3, 2, 2)  # claims the id block
        store.lose_next_write_result(applied=True)
        store.failing = 2
        lh = await bk.create_ledger(3, 2, 2)
        assert await _ledger_ids(store) == [lh.id - 1, lh.id]
        await lh.append(b"x")
    finally:
        await bk.close()


@pytest.mark.parametrize("touched", [False, True])
async def test_create_whose_outcome_stays_unknown_names_the_ledger_and_discards_it(
    directory: StaticDirectory, touched: bool
) -> None:
    """Metadata stays unreadable past ``metadata_timeout_s``: create_ledger raises
    LedgerCreateUnknown naming the ledger it may have made; once metadata answers, the client
    deletes that ledger, unless it changed meanwhile (someone recovered it: in use)."""
    store = _UnreadableLedgers()
    manager = LedgerManager(store, ROOT)
    bk = make_client(manager, directory, dataclasses.replace(FAST, metadata_timeout_s=0.3))
    try:
        first = (await bk.create_ledger(3, 2, 2)).id  # claims the id block
        store.lose_next_write_result(applied=True)
        store.failing = -1
        with capture_logs() as logs:
            with pytest.raises(LedgerCreateUnknown) as info:
                await bk.create_ledger(3, 2, 2)
            assert isinstance(info.value, CasResultUnknown)
            ledger_id = info.value.ledger_id
            assert await _ledger_ids(store) == [first, ledger_id]  # the create applied
            if touched:
                kv = (await store.list(manager.keys.ledgers_prefix)).items[-1]
                md = serde.decode(kv.value, key=kv.key, ledger_id=ledger_id)
                await store.compare_and_set(kv.key, serde.encode(md.in_recovery()), kv.version)
            store.failing = 0
            for _ in range(100):
                if any(e["event"] == "ledger.create_unknown_resolved" for e in logs):
                    break
                await asyncio.sleep(0.02)
        resolved = [e for e in logs if e["event"] == "ledger.create_unknown_resolved"]
        assert [(e["ledger_id"], e["deleted"]) for e in resolved] == [(ledger_id, not touched)]
        assert await _ledger_ids(store) == ([first, ledger_id] if touched else [first])
    finally:
        await bk.close()
