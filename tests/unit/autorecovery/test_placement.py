"""Replacements come from writable bookies only: read-only ones and those being decommissioned are
never chosen (the daemon's directory, then the placement policy through the replication primitive)."""

from __future__ import annotations

import random

from bookkeeper_aio import ClientConfig, RandomPlacement
from bookkeeper_aio.autorecovery.daemon import ReplacementDirectory
from bookkeeper_aio.client.bookie_client import BookiePool
from bookkeeper_aio.client.bookkeeper import RegistryDirectory
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.ensemble_change import BookieReplacer
from metadata.bookies import BookieInfo, BookieRegistration, BookieState
from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore
from metadata.underreplication import UnderReplicationManager

ROOT = "/bookkeeper/placement"


async def test_only_writable_bookies_not_leaving_replace() -> None:
    store = MemoryStore()
    registrations = []
    for i, name in enumerate(["a", "b", "c", "ro", "leaving", "ok"]):
        registration = BookieRegistration(store, ROOT, BookieInfo(name, "127.0.0.1", 5000 + i), ttl_s=5)
        await registration.start()
        registrations.append(registration)
    await registrations[3].set_state(BookieState.READONLY)
    urm = UnderReplicationManager(store, ROOT)
    await urm.start_decommission("leaving")
    directory = ReplacementDirectory(RegistryDirectory(store, ROOT), urm)
    config = ClientConfig(metadata_timeout_s=2.0)
    ctx = ClientContext(
        config=config,
        pool=BookiePool(config),
        ledgers=LedgerManager(store, ROOT),
        directory=directory,
        placement=RandomPlacement(random.Random(5)),
    )
    try:
        assert sorted(await directory.writable_bookies()) == ["a", "b", "c", "ok"]
        created = await ctx.ledgers.create(("a", "b", "c"), write_quorum=2, ack_quorum=2)
        stored = await ctx.ledgers.write(created.metadata.closed(-1, 0), created.version)
        for _ in range(5):  # whatever the random choice, only "ok" qualifies
            change = await BookieReplacer(ctx, created.ledger_id).choose(
                stored.metadata.ensembles[0][1], {"b"}
            )
            assert change.ensemble == ("a", "ok", "c")
    finally:
        for registration in registrations:
            await registration.close()
        await ctx.pool.close()
