"""The auditor at the metadata seam (MemoryStore, bookie registrations without bookie processes):
the lost-bookie delay, a bookie back in time, marks with the missing bookies, one leader."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

from bookkeeper_aio import ClientConfig, RandomPlacement
from bookkeeper_aio.autorecovery.auditor import Auditor, mark_ledgers_on, mark_replaced
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.context import ClientContext, StaticDirectory
from metadata.bookies import BookieInfo, BookieRegistration
from metadata.cluster import init_cluster
from metadata.ledger_manager import LedgerManager, VersionedLedger
from metadata.memory import MemoryStore
from metadata.underreplication import UnderReplicationManager
from tests.unit.autorecovery.waiting import wait_until

ROOT = "/bookkeeper/unit"


def _ctx(store: MemoryStore) -> ClientContext:
    config = ClientConfig(metadata_timeout_s=2.0)
    return ClientContext(
        config=config,
        pool=BookiePool(config),
        ledgers=LedgerManager(store, ROOT, rng=random.Random(1)),
        directory=StaticDirectory([]),
        placement=RandomPlacement(random.Random(2)),
    )


async def _register(
    store: MemoryStore, bookie_id: str, port: int, instance: str | None = None
) -> BookieRegistration:
    """``bookie_id`` registered; with ``instance``, its data dir's instance id."""
    attributes = {} if instance is None else {"instance_id": instance}
    info = BookieInfo(bookie_id, "127.0.0.1", port, attributes=attributes)
    registration = BookieRegistration(store, ROOT, info, ttl_s=5)
    await registration.start()
    return registration


async def test_a_bookie_gone_past_the_delay_marks_every_ledger_on_it() -> None:
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    regs = {b: await _register(store, b, 4000 + i) for i, b in enumerate(["b0", "b1", "b2", "b3"])}
    on_b1 = [(await ctx.ledgers.create(("b0", "b1", "b2"), write_quorum=2, ack_quorum=2)).ledger_id]
    created = await ctx.ledgers.create(("b0", "b2", "b3"), write_quorum=2, ack_quorum=2)
    # b1 in a later fragment only
    await ctx.ledgers.write(created.metadata.with_ensemble_change(5, ("b0", "b1", "b3")), created.version)
    on_b1.append(created.ledger_id)
    not_on_b1 = (await ctx.ledgers.create(("b0", "b2", "b3"), write_quorum=2, ack_quorum=2)).ledger_id
    auditor = Auditor(ctx, urm, AutorecoveryConfig(lost_bookie_recovery_delay_s=0.3), candidate_id="a1")
    try:
        assert await auditor.audit_once() == []
        await regs["b1"].close()  # gone (its lease revoked)
        assert await auditor.audit_once() == []  # within the delay
        assert "b1" in auditor.missing
        await asyncio.sleep(0.35)
        assert await auditor.audit_once() == sorted(on_b1)
        for ledger_id in on_b1:
            mark = await urm.get(ledger_id)
            assert mark is not None
            assert mark.missing == ("b1",)
            assert mark.reasons == ("lost",)
        assert await urm.get(not_on_b1) is None
        assert await auditor.audit_once() == []  # once per absence
        assert auditor.metrics.ledgers_marked == 2
    finally:
        for registration in regs.values():
            await registration.close()
        await ctx.pool.close()


async def test_a_bookie_back_within_the_delay_marks_nothing() -> None:
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    reg = await _register(store, "b0", 4100)
    await ctx.ledgers.create(("b0",), write_quorum=1, ack_quorum=1)
    auditor = Auditor(ctx, urm, AutorecoveryConfig(lost_bookie_recovery_delay_s=0.3), candidate_id="a1")
    try:
        await auditor.audit_once()
        await reg.close()
        await auditor.audit_once()
        await asyncio.sleep(0.1)
        reg = await _register(store, "b0", 4100)  # a restart
        await asyncio.sleep(0.25)
        assert await auditor.audit_once() == []
        assert auditor.missing == {}
        assert await urm.count() == 0
    finally:
        await reg.close()
        await ctx.pool.close()


async def test_mark_ledgers_on_reports_progress_and_marks_only_the_listed_bookies() -> None:
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    ids = [(await ctx.ledgers.create(("x", "y"), write_quorum=2, ack_quorum=2)).ledger_id for _ in range(5)]
    seen: list[tuple[int, int]] = []
    marked = await mark_ledgers_on(
        ctx.ledgers, urm, {"y", "z"}, reason="operator", progress=lambda s, m: seen.append((s, m))
    )
    assert marked == ids
    assert seen[-1] == (5, 5)
    for ledger_id in ids:
        mark = await urm.get(ledger_id)
        assert mark is not None
        assert mark.missing == ("y",)
    await ctx.pool.close()


async def test_exactly_one_auditor_leads_and_another_takes_over() -> None:
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    config = AutorecoveryConfig(lease_ttl_s=2, audit_interval_s=0.05, check_interval_s=0)
    auditors = [Auditor(ctx, urm, config, candidate_id=f"a{i}") for i in range(3)]
    tasks = [asyncio.create_task(a.run()) for a in auditors]
    try:
        await wait_until(lambda: any(a.leading.is_set() for a in auditors))
        await asyncio.sleep(0.3)
        leaders = [a for a in auditors if a.leading.is_set()]
        assert len(leaders) == 1
        assert await store.get(urm.keys.auditor) is not None
        first = leaders[0]
        index = auditors.index(first)
        tasks[index].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tasks[index]
        await wait_until(lambda: any(a.leading.is_set() for a in auditors if a is not first))
        await asyncio.sleep(0.3)
        assert sum(a.leading.is_set() for a in auditors if a is not first) == 1
        assert not first.leading.is_set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await ctx.pool.close()


async def test_the_leading_auditor_follows_the_registration_watch() -> None:
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    regs = {b: await _register(store, b, 4200 + i) for i, b in enumerate(["b0", "b1", "b2"])}
    ledger_id = (await ctx.ledgers.create(("b0", "b1", "b2"), write_quorum=2, ack_quorum=2)).ledger_id
    config = AutorecoveryConfig(lost_bookie_recovery_delay_s=0.5, audit_interval_s=60, check_interval_s=0)
    auditor = Auditor(ctx, urm, config, candidate_id="a1")
    task = asyncio.create_task(auditor.run())
    try:
        await wait_until(lambda: auditor.leading.is_set())
        await asyncio.sleep(0.2)
        await regs["b2"].close()
        # the round interval is 60 s: only the watch can make the auditor notice, then the delay's timer
        await wait_until(lambda: "b2" in auditor.missing, timeout_s=5)
        assert await urm.get(ledger_id) is None  # within the delay

        async def marked() -> bool:
            return await urm.get(ledger_id) is not None

        await wait_until(marked, timeout_s=3)
        mark = await urm.get(ledger_id)
        assert mark is not None
        assert mark.missing == ("b2",)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for registration in regs.values():
            await registration.close()
        await ctx.pool.close()


async def test_an_undecodable_ledger_does_not_stop_the_marking_of_the_others() -> None:
    store = MemoryStore()
    await init_cluster(store, "/c")
    ledgers = LedgerManager(store, "/c")
    good = [
        (await ledgers.create(("b1", "b2"), write_quorum=2, ack_quorum=2)).metadata.ledger_id
        for _ in range(40)
    ]
    await store.put(ledgers.keys.ledger(0), b"\x00garbage")  # one corrupt record, listed first
    urm = UnderReplicationManager(store, "/c")
    marked = await mark_ledgers_on(ledgers, urm, {"b1"}, reason="lost")
    assert marked == sorted(good)
    assert len([mark async for mark in urm.iter_marks()]) == len(good)


async def test_a_bookie_back_with_another_data_dir_is_marked_at_once() -> None:
    """Formatted (or a new disk), the bookie comes back within the delay under its id: what its old
    data dir held is gone all the same."""
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    reg = await _register(store, "b0", 4200, "disk-1")
    on_b0 = (await ctx.ledgers.create(("b0",), write_quorum=1, ack_quorum=1)).ledger_id
    auditor = Auditor(ctx, urm, AutorecoveryConfig(lost_bookie_recovery_delay_s=30), candidate_id="a1")
    try:
        assert await auditor.audit_once() == []
        await reg.close()
        reg = await _register(store, "b0", 4200, "disk-1")  # a plain restart: nothing to mark
        assert await auditor.audit_once() == []
        await reg.close()
        reg = await _register(store, "b0", 4200, "disk-2")  # back at once, but with an empty data dir
        assert await auditor.audit_once() == [on_b0]
        mark = await urm.get(on_b0)
        assert mark is not None
        assert mark.missing == ("b0",)
        assert mark.reasons == ("replaced",)
        assert await auditor.audit_once() == []  # once
    finally:
        await reg.close()
        await ctx.pool.close()


async def test_a_new_auditor_tells_a_bookie_replaced_while_none_watched() -> None:
    """The auditor that saw the old data dir dies; the bookie comes back formatted before another
    leads (or the daemons restart): the new auditor reads the last instance seen from metadata."""
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    reg = await _register(store, "b0", 4200, "disk-1")
    on_b0 = (await ctx.ledgers.create(("b0",), write_quorum=1, ack_quorum=1)).ledger_id
    config = AutorecoveryConfig(lost_bookie_recovery_delay_s=30)
    try:
        assert await Auditor(ctx, urm, config, candidate_id="a1").audit_once() == []  # sees disk-1
        await reg.close()
        reg = await _register(store, "b0", 4200, "disk-2")  # formatted while no auditor watched
        fresh = Auditor(ctx, urm, config, candidate_id="a2")
        assert await fresh.audit_once() == [on_b0]
        mark = await urm.get(on_b0)
        assert mark is not None
        assert mark.reasons == ("replaced",)
        assert await fresh.audit_once() == []  # once
        assert await Auditor(ctx, urm, config, candidate_id="a3").audit_once() == []  # recorded
        seen = await urm.seen_instance("b0")
        assert seen is not None
        assert seen.instance == "disk-2"
    finally:
        await reg.close()
        await ctx.pool.close()


async def _replaced_world(
    store: MemoryStore, ctx: ClientContext, urm: UnderReplicationManager
) -> tuple[dict[str, int], list[BookieRegistration]]:
    """b0 registered with disk-1 (recorded by an auditor), then back with disk-2 while no auditor
    led, and ledgers created or changed on either side of that registration."""
    regs = [await _register(store, "b0", 4200, "disk-1")]
    regs += [await _register(store, b, 4201 + i) for i, b in enumerate(["b1", "b2", "b3"])]
    ledgers = ctx.ledgers
    ids: dict[str, int] = {}
    for name, ensemble in (("held", ("b0", "b1", "b2")), ("moved_on", ("b1", "b2", "b3"))):
        ids[name] = (await ledgers.create(ensemble, write_quorum=2, ack_quorum=2)).ledger_id
    writer_left = await ledgers.create(("b0", "b1", "b2"), write_quorum=2, ack_quorum=2)
    ids["writer_left"] = writer_left.ledger_id
    copied_onto = await ledgers.create(("b1", "b2", "b3"), write_quorum=2, ack_quorum=2)
    copied_onto = await ledgers.write(copied_onto.metadata.closed(4, 100), copied_onto.version)
    ids["copied_onto"] = copied_onto.ledger_id
    healed_away = await ledgers.create(("b0", "b1", "b2"), write_quorum=2, ack_quorum=2)
    ids["healed_away"] = healed_away.ledger_id
    assert await Auditor(ctx, urm, AutorecoveryConfig(), candidate_id="a1").audit_once() == []
    await regs[0].close()
    regs[0] = await _register(store, "b0", 4200, "disk-2")  # formatted, back, writable at once
    # after it: a new ledger on it, an old one whose writer moved onto it, one whose writer left it
    ids["fresh"] = (await ledgers.create(("b0", "b1", "b2"), write_quorum=2, ack_quorum=2)).ledger_id
    moved = await ledgers.read(ids["moved_on"])
    await ledgers.write(moved.metadata.with_ensemble_change(5, ("b1", "b2", "b0")), moved.version)
    await ledgers.write(writer_left.metadata.with_ensemble_change(5, ("b3", "b1", "b2")), writer_left.version)
    # a worker's CAS listing b0 in an old fragment: it copied there before, maybe to the old disk
    await ledgers.write(
        dataclasses.replace(copied_onto.metadata, ensembles=((0, ("b1", "b2", "b0")),)), copied_onto.version
    )
    # b0 healed out of the old fragment (a copy elsewhere), then taken in by a new one
    await ledgers.write(
        dataclasses.replace(
            healed_away.metadata, ensembles=((0, ("b3", "b1", "b2")), (5, ("b1", "b2", "b0")))
        ),
        healed_away.version,
    )
    return ids, regs


async def test_a_replaced_bookie_marks_only_what_its_old_data_dir_may_have_held() -> None:
    """Only the ledgers that listed the bookie before its new data dir registered lost copies; a
    ledger placed on the new one (created, or an ensemble change, after that) is not marked, or a
    worker would fence its live writer after the grace (every copy it has is on the new disk)."""
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    ids, regs = await _replaced_world(store, ctx, urm)
    try:
        marked = await Auditor(ctx, urm, AutorecoveryConfig(), candidate_id="a2").audit_once()
        # the one whose writer left b0 after its return keeps b0 in its first fragment: marked
        assert marked == sorted([ids["held"], ids["writer_left"], ids["copied_onto"]])
        for name in ("held", "writer_left", "copied_onto"):
            mark = await urm.get(ids[name])
            assert mark is not None
            assert (mark.missing, mark.reasons) == (("b0",), ("replaced",))
        for name in ("fresh", "moved_on", "healed_away"):
            assert await urm.get(ids[name]) is None
    finally:
        for registration in regs:
            await registration.close()
        await ctx.pool.close()


async def test_a_replaced_bookie_marks_when_the_history_before_its_registration_is_gone() -> None:
    """The metadata before the registration compacted away: a ledger changed since may have listed
    the bookie then, so it is marked (safe); a ledger created since needs no history."""
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    ids, regs = await _replaced_world(store, ctx, urm)
    store.compact()
    try:
        marked = await Auditor(ctx, urm, AutorecoveryConfig(), candidate_id="a2").audit_once()
        assert marked == sorted(
            ids[n] for n in ("held", "writer_left", "moved_on", "copied_onto", "healed_away")
        )
        assert await urm.get(ids["fresh"]) is None
    finally:
        for registration in regs:
            await registration.close()
        await ctx.pool.close()


async def test_replaced_marks_every_ledger_listing_a_bookie_whose_registration_is_unknown() -> None:
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    first = (await ctx.ledgers.create(("b0", "b1"), write_quorum=2, ack_quorum=2)).ledger_id
    registered = await store.current_revision() + 1  # as if it registered next
    later = (await ctx.ledgers.create(("b0", "b1"), write_quorum=2, ack_quorum=2)).ledger_id
    assert await mark_replaced(ctx.ledgers, urm, {"b0": registered}) == [first]
    assert await mark_replaced(ctx.ledgers, urm, {"b1": None}) == [first, later]
    await ctx.pool.close()


async def test_replaced_marks_a_ledger_whose_recovery_listed_the_bookie_after_its_registration() -> None:
    """Recovery's write-back writes found entries to its replacement *before* its closing CAS adds
    the fragment naming it: a ledger IN_RECOVERY just before the new registration may have such
    copies on the old data dir, even in a fragment that did not exist then. A ledger whose recovery
    started after the registration wrote to the new data dir only: not marked."""
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    lm = ctx.ledgers

    async def in_recovery() -> VersionedLedger:
        created = await lm.create(("b1", "b2", "b3"), write_quorum=2, ack_quorum=2)
        changed = created.metadata.with_ensemble_change(3, ("b1", "b2", "b4"))
        opened = await lm.write(changed, created.version)
        return await lm.write(opened.metadata.in_recovery(), opened.version)

    async def close_onto_b0(versioned: VersionedLedger, first: int) -> None:
        # the close CAS of a recovery whose write-back replaced b1 by b0 from entry `first` on
        closed = versioned.metadata.with_ensemble_change(first, ("b0", "b2", "b4")).closed(9, 100)
        await lm.write(closed, versioned.version)

    recovering_then = await in_recovery()
    in_place_then = await in_recovery()
    open_then = await lm.create(("b1", "b2", "b3"), write_quorum=2, ack_quorum=2)
    registered = await store.current_revision() + 1  # b0's new data dir registers now
    await store.create(f"{ROOT}/registration-of-b0", b"x")
    assert await store.current_revision() == registered
    await close_onto_b0(recovering_then, 5)  # a fragment that did not exist at the registration
    await close_onto_b0(in_place_then, 3)  # the last fragment replaced in place
    # recovery of a ledger still open at the registration: it starts (and writes) only after it
    started = await lm.write(open_then.metadata.in_recovery(), open_then.version)
    await close_onto_b0(started, 5)
    marked = await mark_replaced(lm, urm, {"b0": registered})
    assert marked == sorted([recovering_then.ledger_id, in_place_then.ledger_id])
    for ledger_id in marked:
        mark = await urm.get(ledger_id)
        assert mark is not None
        assert (mark.missing, mark.reasons) == (("b0",), ("replaced",))
    assert await urm.get(open_then.ledger_id) is None
    await ctx.pool.close()


async def test_a_bookie_with_an_undecodable_registration_is_not_taken_for_lost() -> None:
    # A live bookie whose registration this auditor cannot read (a newer format during a rolling
    # upgrade) holds its key under a live lease: re-replicating its ledgers away would be wrong.
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    reg = await _register(store, "b0", 4200)
    newer = await store.grant_lease(5)
    await store.put(f"{ROOT}/bookies/writable/b1", b"\xc1 a newer format", lease_id=newer)
    on_b1 = (await ctx.ledgers.create(("b0", "b1"), write_quorum=2, ack_quorum=2)).ledger_id
    auditor = Auditor(ctx, urm, AutorecoveryConfig(lost_bookie_recovery_delay_s=0.1), candidate_id="a1")
    try:
        assert await auditor.audit_once() == []
        await asyncio.sleep(0.15)
        assert await auditor.audit_once() == []
        assert "b1" not in auditor.missing
        assert await urm.get(on_b1) is None
        await store.revoke_lease(newer)  # now it is gone: lost after the delay as usual
        assert await auditor.audit_once() == []
        await asyncio.sleep(0.15)
        assert await auditor.audit_once() == [on_b1]
    finally:
        await reg.close()
        await ctx.pool.close()


async def test_an_unforeseen_error_in_the_lead_does_not_end_the_candidacy() -> None:
    """Whatever ends a lead (a bug included) is logged; the auditor resigns and campaigns again
    (else the daemon would never audit again, unseen)."""
    store = MemoryStore()
    ctx = _ctx(store)
    urm = UnderReplicationManager(store, ROOT)
    config = AutorecoveryConfig(lease_ttl_s=2, audit_interval_s=0.05, check_interval_s=0)
    auditor = Auditor(ctx, urm, config, candidate_id="a0")
    leads = 0
    lead = auditor._lead

    async def crash_once() -> None:
        nonlocal leads
        leads += 1
        if leads == 1:
            raise KeyError("a bug")
        await lead()

    auditor._lead = crash_once  # type: ignore[method-assign]
    task = asyncio.create_task(auditor.run())
    try:
        await wait_until(lambda: leads >= 2 and auditor.leading.is_set())
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await ctx.pool.close()
