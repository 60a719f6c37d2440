"""A replication worker paused past its lease (a zombie) commits nothing, on both metadata drivers.

The ABA it must not fall for: the zombie copied a fragment to a replacement, then stopped before
its CAS. Its lock expired with its lease; another worker healed the ledger (its own replacement),
and the fragment then changed back to what the zombie saw (an operator's edit, a restored backup),
with the bookie marked missing again. Comparing the fragment alone, the zombie's CAS would look
fine on a re-read and publish a replacement whose copy may have been collected since. Its CAS and
its mark update are guarded by its lock's version in the same transaction: refused, LockLost.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.autorecovery import worker as worker_module
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.errors import LockLost
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from metadata.store import MetadataStore
from metadata.underreplication import UnderReplicationManager
from tests.integration.metadata.conftest import root, store

__all__ = ["root", "store"]

ORIGINAL = ("a", "b", "c")


async def _gone(urm: UnderReplicationManager, lock: Any) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while await urm.holds(lock):
        assert loop.time() < deadline, "the zombie's lock outlived its lease"
        await asyncio.sleep(0.1)


async def test_a_worker_paused_past_its_lease_commits_nothing(
    store: MetadataStore, root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledgers = LedgerManager(store, root)
    urm = UnderReplicationManager(store, root)
    bk = BookKeeper(ledgers, StaticDirectory(["a", "b", "c", "d", "e", "f"]))
    paused, resume = asyncio.Event(), asyncio.Event()
    copies: list[tuple[str, ...]] = []

    async def copy_fragment(ctx: Any, fragment: Any, *args: Any, **kwargs: Any) -> None:
        copies.append(fragment.new)
        if len(copies) == 1:  # the zombie: stops between its copy and its CAS
            paused.set()
            await resume.wait()

    monkeypatch.setattr(worker_module, "copy_fragment", copy_fragment)
    config = AutorecoveryConfig(passwords=(b"pw",))
    try:
        created = await ledgers.create(ORIGINAL, write_quorum=3, ack_quorum=2)
        closed = await ledgers.write(created.metadata.closed(9, 100), created.version)
        ledger_id = closed.ledger_id
        zombie_lease = await store.grant_lease(2)  # never kept alive: the pause outlasts it
        zombie_lock = await urm.acquire(ledger_id, "zombie", zombie_lease)
        assert zombie_lock is not None
        zombie = ReplicationWorker(bk, urm, config, worker_id="zombie")
        mark = await urm.mark(ledger_id, ["c"], reason="lost")
        zombie_heal = asyncio.create_task(zombie.heal(mark, zombie_lock))
        await asyncio.wait_for(paused.wait(), 10)
        stale = copies[0]
        await _gone(urm, zombie_lock)

        # another worker heals it meanwhile, under a lock of its own
        lease = await store.grant_lease(30)
        try:
            lock = await urm.acquire(ledger_id, "healthy", lease)
            assert lock is not None
            result = await ReplicationWorker(bk, urm, config, worker_id="healthy").heal(mark, lock)
            assert result.resolved
            await urm.unlock(ledger_id, lease)
        finally:
            await store.revoke_lease(lease)
        healed = await ledgers.read(ledger_id)
        assert healed.metadata.ensembles[0][1] != ORIGINAL

        # ... and the fragment changes back (A -> B -> A), the bookie marked missing again
        back = dataclasses.replace(healed.metadata, ensembles=((0, ORIGINAL),))
        await ledgers.write(back, healed.version)
        await urm.mark(ledger_id, ["c"], reason="operator")
        before = await ledgers.read(ledger_id)

        resume.set()
        with pytest.raises(LockLost, match="lock was gone"):
            await asyncio.wait_for(zombie_heal, 10)
        after = await ledgers.read(ledger_id)
        assert after == before, f"the zombie committed its stale replacement {stale}"
        left = await urm.get(ledger_id)
        assert left is not None
        assert left.missing == ("c",)  # the zombie resolved nothing either
        assert zombie.metrics.locks_lost == 1
    finally:
        resume.set()
        await bk.close()
