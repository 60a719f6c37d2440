"""The replication primitive (``BookieReplacer``), the close decision and ``AckSet``, at their
public seams with the in-memory metadata store: the writer's change at LAC+1 (new fragment, or the
last one replaced), re-deciding after a CAS conflict, a lost CAS answer that did land, the
IN_RECOVERY refusal, and re-replication of a middle fragment of a closed ledger with a copy step
(what an autorecovery worker does)."""

from __future__ import annotations

import random

import pytest

from bookkeeper_aio import ClientConfig, RandomPlacement
from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.context import ClientContext, StaticDirectory
from bookkeeper_aio.client.ensemble_change import BookieReplacer, Replacement
from bookkeeper_aio.client.ledger_close import close_decision
from bookkeeper_aio.client.quorum import AckSet
from bookkeeper_aio.errors import LedgerFenced, MetadataConflict, NotEnoughBookies
from metadata.ledger_manager import UNCHANGED, LedgerManager
from metadata.ledger_metadata import LedgerMetadata, LedgerState
from metadata.memory import MemoryStore

BOOKIES = ("a", "b", "c")


def _context(store: MemoryStore, writable: list[str]) -> ClientContext:
    config = ClientConfig(metadata_timeout_s=2.0)
    return ClientContext(
        config=config,
        pool=BookiePool(config),
        ledgers=LedgerManager(store, "/t", rng=random.Random(1)),
        directory=StaticDirectory(writable),
        placement=RandomPlacement(random.Random(7)),
    )


def _open(md: LedgerMetadata) -> None:
    if md.state is not LedgerState.OPEN:
        raise LedgerFenced("not open")


async def test_replace__new_fragment_at_first_entry_then_the_same_fragment_replaced() -> None:
    ctx = _context(MemoryStore(), ["a", "b", "c", "d", "e"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    replacer = BookieReplacer(ctx, created.ledger_id)
    first = await replacer.replace(created, 5, {"b"}, accept=_open, attempts_max=4)
    assert first.replaced == ("b",)
    assert first.ensemble[0] == "a"
    assert first.ensemble[2] == "c"
    assert first.ensemble[1] in {"d", "e"}
    assert first.stored is not None
    assert first.stored.metadata.ensembles == ((0, BOOKIES), (5, first.ensemble))
    second = await replacer.replace(first.stored, 5, {"c"}, accept=_open, attempts_max=4)
    assert second.stored is not None
    assert second.stored.metadata.ensembles == ((0, BOOKIES), (5, second.ensemble))  # replaced
    assert "b" not in second.ensemble  # ever failed: never chosen again
    assert "c" not in second.ensemble


async def test_replace__conflict_is_decided_again_on_the_fresh_metadata() -> None:
    ctx = _context(MemoryStore(), ["a", "b", "c", "d"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    await ctx.ledgers.write(created.metadata.with_custom_metadata({"k": b"v"}), created.version)
    change = await BookieReplacer(ctx, created.ledger_id).replace(
        created, 0, {"a"}, accept=_open, attempts_max=4
    )  # the stale copy loses the CAS; the re-read metadata is still OPEN: decided again
    assert change.stored is not None
    assert change.stored.metadata.custom_metadata == {"k": b"v"}
    assert change.stored.metadata.ensembles == ((0, ("d", "b", "c")),)


async def test_replace__in_recovery_after_a_conflict_is_refused() -> None:
    ctx = _context(MemoryStore(), ["a", "b", "c", "d"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    await ctx.ledgers.write(created.metadata.in_recovery(), created.version)
    with pytest.raises(LedgerFenced):
        await BookieReplacer(ctx, created.ledger_id).replace(created, 0, {"a"}, accept=_open, attempts_max=4)


async def test_replace__lost_answer_of_an_applied_cas_is_recognised_as_ours() -> None:
    store = MemoryStore()
    ctx = _context(store, ["a", "b", "c", "d"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    store.lose_next_write_result(applied=True)
    change = await BookieReplacer(ctx, created.ledger_id).replace(
        created, 3, {"c"}, accept=_open, attempts_max=4
    )
    assert change.stored is not None
    assert change.stored.metadata.ensembles == ((0, BOOKIES), (3, ("a", "b", "d")))  # once


async def test_replace__no_writable_bookie_left_raises_not_enough_bookies() -> None:
    ctx = _context(MemoryStore(), list(BOOKIES))
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    with pytest.raises(NotEnoughBookies):
        await BookieReplacer(ctx, created.ledger_id).replace(created, 0, {"a"}, accept=_open, attempts_max=4)


async def test_choose__gives_up_a_bookie_without_replacement_when_allowed() -> None:
    ctx = _context(MemoryStore(), ["a", "b", "c", "d"])
    replacer = BookieReplacer(ctx, 1)
    change = await replacer.choose(BOOKIES, {"a", "b"}, give_up=True)
    assert change.ensemble == ("d", "b", "c")
    assert change.replaced == ("a",)
    assert change.given_up == ("b",)
    assert change.stored is None


async def test_replace__re_replicates_a_middle_fragment_of_a_closed_ledger_after_the_copy() -> None:
    """The autorecovery shape: the fragment holding entries 0-9 lost bookie b; its entries are
    copied to the replacement, then the fragment (not a new one) is CASed; the ledger stays closed."""
    ctx = _context(MemoryStore(), ["a", "b", "c", "d", "e"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    md = created.metadata.with_ensemble_change(10, ("a", "c", "d")).closed(20, 2000)
    stored = await ctx.ledgers.write(md, created.version)
    copies: list[Replacement] = []

    async def copy(replacement: Replacement) -> None:
        copies.append(replacement)

    change = await BookieReplacer(ctx, created.ledger_id).replace(
        stored, 0, {"b"}, accept=lambda md: None, copy=copy, attempts_max=4
    )
    assert copies == [change]
    assert change.stored is not None
    after = change.stored.metadata
    assert after.ensembles == ((0, ("a", "e", "c")), (10, ("a", "c", "d")))
    assert after.state is LedgerState.CLOSED
    assert after.last_entry_id == 20


async def test_replace__fragment_changed_during_the_copy_is_refused() -> None:
    ctx = _context(MemoryStore(), ["a", "b", "c", "d", "e"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)

    async def copy(replacement: Replacement) -> None:  # someone else re-replicates meanwhile
        await ctx.ledgers.write(created.metadata.with_ensemble_change(0, ("a", "d", "c")), created.version)

    with pytest.raises(MetadataConflict):
        await BookieReplacer(ctx, created.ledger_id).replace(
            created, 0, {"b"}, accept=lambda md: None, copy=copy, attempts_max=4
        )


def test_close_decision__the_three_outcomes_of_seed_000() -> None:
    md = LedgerMetadata.new(1, BOOKIES, write_quorum=2, ack_quorum=2)
    assert close_decision(md, 4, 40) == md.closed(4, 40)
    assert close_decision(md.closed(4, 40), 4, 40) is UNCHANGED
    with pytest.raises(MetadataConflict):
        close_decision(md.closed(3, 30), 4, 40)
    with pytest.raises(LedgerFenced):
        close_decision(md.in_recovery(), 4, 40)


def test_ack_set__counts_positions_ignores_strangers_and_moves_with_the_write_set() -> None:
    acks = AckSet(("a", "b"))
    assert acks.ack("b") == 1
    assert acks.ack("b") == 1  # twice is once
    assert acks.ack("x") == -1  # not in the write set: does not count
    assert acks.ack("a") == 2
    assert acks.move_to(("d", "a")) == 1  # b replaced: its ack is dropped; a moves to position 1
    assert acks.acked == 0b10
    assert acks.has_acked("a")
    assert not acks.has_acked("b")
    assert acks.count == 1


async def test_replace__a_bookie_that_failed_before_is_taken_when_no_other_is_writable() -> None:
    """A rolling restart of E + 1 bookies: each restarted bookie registers again, and is the only
    spare for the next departure; taking it beats failing the ledger. Never one failing now."""
    ctx = _context(MemoryStore(), ["a", "b", "c", "d"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    replacer = BookieReplacer(ctx, created.ledger_id)
    first = await replacer.replace(created, 5, {"b"}, accept=_open, attempts_max=4)
    assert first.ensemble == ("a", "d", "c")  # the one that never failed
    assert first.stored is not None
    second = await replacer.replace(first.stored, 9, {"c"}, accept=_open, attempts_max=4)
    assert second.ensemble == ("a", "d", "b")  # b failed before and is writable again
    assert second.stored is not None
    with pytest.raises(NotEnoughBookies):  # a and d failing now: c can take a's place, none is left for d
        await replacer.replace(second.stored, 12, {"d", "a"}, accept=_open, attempts_max=4)


async def test_replacements_in_reconnect_backoff_are_waited_for_not_sent_to_at_once() -> None:
    """Two failed bookies must not replace each other in a loop that takes no time: the pool fails
    requests to a bookie in reconnect backoff at once, so a replacement chosen among them is only
    handed out once its backoff is over (the simulation found the loop in the writer, one metadata
    CAS per round, and in recovery's write-back)."""
    ctx = _context(MemoryStore(), ["a", "b", "c", "d"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    replacer = BookieReplacer(ctx, created.ledger_id)
    replacer.ever_failed.add("d")  # failed before: chosen only because nothing else is writable
    ctx.pool._note_failure("d")  # and its connection is in backoff
    assert ctx.pool.reconnect_delay_s("d") > 0
    change = await replacer.choose(BOOKIES, {"a"})
    assert change.ensemble == ("d", "b", "c")
    assert ctx.pool.reconnect_delay_s("d") == 0.0  # handed out only once a request to it can go

    ctx.pool._note_failure("d")
    stored = await replacer.replace(created, 0, {"a"}, accept=_open, attempts_max=4)
    assert stored.ensemble == ("d", "b", "c")
    assert ctx.pool.reconnect_delay_s("d") == 0.0


async def test_a_replacement_not_in_backoff_is_handed_out_at_once() -> None:
    ctx = _context(MemoryStore(), ["a", "b", "c", "d"])
    created = await ctx.ledgers.create(BOOKIES, write_quorum=2, ack_quorum=2)
    ctx.pool._note_failure("a")  # the failed bookie's backoff is no reason to wait
    ctx.pool._retry_at_s["a"] += 3600.0  # (long enough that the check below cannot race it)
    change = await BookieReplacer(ctx, created.ledger_id).choose(BOOKIES, {"a"})
    assert change.ensemble == ("d", "b", "c")
    assert ctx.pool.reconnect_delay_s("a") > 0  # returned while the failed bookie's backoff runs
