"""The replication primitive re-replicates the *last* fragment of a closed ledger in place (the
fragment of a closed ledger's last ensemble is as fixed as any other; only a new fragment needs an
open ledger). It raised InvalidMetadata ("cannot change the ensemble of a closed ledger") before."""

from __future__ import annotations

import random

from bookkeeper_aio import ClientConfig, RandomPlacement
from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.context import ClientContext, StaticDirectory
from bookkeeper_aio.client.ensemble_change import BookieReplacer, Replacement
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from metadata.memory import MemoryStore


async def test_replace__last_fragment_of_a_closed_ledger_in_place() -> None:
    config = ClientConfig(metadata_timeout_s=2.0)
    store = MemoryStore()
    ctx = ClientContext(
        config=config,
        pool=BookiePool(config),
        ledgers=LedgerManager(store, "/t", rng=random.Random(1)),
        directory=StaticDirectory(["a", "b", "c", "d", "e"]),
        placement=RandomPlacement(random.Random(3)),
    )
    created = await ctx.ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
    md = created.metadata.with_ensemble_change(10, ("a", "c", "d")).closed(20, 2000)
    stored = await ctx.ledgers.write(md, created.version)
    copied: list[Replacement] = []

    async def copy(replacement: Replacement) -> None:
        copied.append(replacement)

    change = await BookieReplacer(ctx, created.ledger_id).replace(
        stored, 10, {"d"}, accept=lambda md: None, copy=copy, attempts_max=4
    )
    assert copied == [change]
    assert change.stored is not None
    after = change.stored.metadata
    new = change.ensemble
    assert new[:2] == ("a", "c")
    assert new[2] in {"b", "e"}  # any writable bookie outside the fragment, never d again
    assert after.ensembles == ((0, ("a", "b", "c")), (10, new))
    assert after.state is LedgerState.CLOSED
    assert after.last_entry_id == 20
    assert [(r.first_entry, r.bookie, r.replacement) for r in after.replaced_bookies] == [(10, "d", new[2])]
