"""The writer against a slow or contested metadata store (docs/replication.md §2, §3).

The store seam is a `MemoryStore` whose compare-and-set is slowed down, loses its answers, or
loses the race to a recovery: the writer must still change its ensemble within its per-attempt
budget, and a race lost to a recovery must say LedgerFenced however many attempts it took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Callable

import pytest

from bookkeeper_aio import BookKeeper, LedgerFenced
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from metadata import ledger_metadata as serde
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerMetadata, LedgerState
from metadata.memory import MemoryStore
from metadata.store import Guards
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.client.conftest import FAST, ROOT, make_client


class ContestedStore(MemoryStore):
    """A MemoryStore whose compare-and-set first runs ``before_cas`` (a delay, a rival's write)."""

    def __init__(self) -> None:
        super().__init__()
        self.cas_calls = 0
        self.before_cas: Callable[[int], object] | None = None

    async def compare_and_set(
        self, key: str, value: bytes, expected_version: int, *, guards: Guards = ()
    ) -> int:
        self.cas_calls += 1
        if self.before_cas is not None:
            hook = self.before_cas(self.cas_calls)
            if asyncio.iscoroutine(hook):
                await hook
        return await super().compare_and_set(key, value, expected_version, guards=guards)


@pytest.fixture
def store() -> ContestedStore:
    return ContestedStore()


@pytest.fixture
async def bk(store: ContestedStore, cluster: FakeCluster) -> AsyncIterator[BookKeeper]:
    ledgers = LedgerManager(store, ROOT, rng=random.Random(1))
    client = make_client(ledgers, StaticDirectory(cluster.ids), dataclasses.replace(FAST, add_timeout_s=5.0))
    yield client
    await client.close()


def _fail_adds_on(cluster: FakeCluster, bookie_id: str) -> None:
    cluster.by_id(bookie_id).script = lambda req: (
        Reply.error(StatusCode.EIO) if isinstance(req, m.AddEntryRequest) else None
    )


async def test_ensemble_change__slow_store_losing_answers_gets_a_budget_per_attempt(
    bk: BookKeeper, cluster: FakeCluster, store: ContestedStore
) -> None:
    """Each CAS takes 0.8 s and the first two lose their answer (not applied): every attempt fits
    in metadata_timeout_s (2 s), the three together do not. The change must succeed."""
    lh = await bk.create_ledger(3, 3, 2)
    await lh.append(b"first")
    victim = lh.metadata.current_ensemble[0]

    async def slow_and_lossy(call: int) -> None:
        await asyncio.sleep(0.8)
        if call <= 2:
            store.lose_next_write_result(applied=False)

    store.before_cas = slow_and_lossy
    _fail_adds_on(cluster, victim)
    assert await asyncio.wait_for(lh.append(b"second"), 15) == 1
    assert store.cas_calls == 3
    assert victim not in lh.metadata.current_ensemble
    assert lh.ensemble_changes == 1


async def test_ensemble_change__race_lost_to_recovery_on_the_last_attempt_says_fenced(
    bk: BookKeeper, cluster: FakeCluster, store: ContestedStore
) -> None:
    """Every ensemble-change CAS loses; right before the last one a recovery marks the ledger
    IN_RECOVERY. The writer's re-read sees it: LedgerFenced, not "lost the race too often"."""
    lh = await bk.create_ledger(3, 3, 2)
    await lh.append(b"first")
    attempts = bk.context.config.ensemble_change_attempts_max
    ledgers = LedgerManager(store, ROOT)
    ledger_key = ledgers.keys.ledger(lh.id)

    async def rival_cas(metadata: LedgerMetadata, version: int) -> None:
        await MemoryStore.compare_and_set(store, ledger_key, serde.encode(metadata), version)

    async def rival(call: int) -> None:
        current = await ledgers.read(lh.id)
        if call == attempts:
            await rival_cas(current.metadata.in_recovery(), current.version)
        else:  # a rival write that changes nothing but the version: the CAS loses (BadVersion)
            await rival_cas(current.metadata, current.version)

    store.before_cas = rival
    _fail_adds_on(cluster, lh.metadata.current_ensemble[0])
    with pytest.raises(LedgerFenced):
        await asyncio.wait_for(lh.append(b"second"), 15)
    assert store.cas_calls == attempts
    assert (await ledgers.read(lh.id)).metadata.state is LedgerState.IN_RECOVERY
