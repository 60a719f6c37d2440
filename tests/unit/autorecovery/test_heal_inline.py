"""The inline heal of ``bkaio recover`` / ``bkaio decommission`` outlives what the daemon outlives:
a lease that expired (a metadata outage longer than its TTL: a new lease, as the daemon's) and a
heal that timed out on metadata (the ledger is tried again, and reported if it stays unhealed)."""

from __future__ import annotations

import types

import pytest

from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.copier import CopyStats
from bookkeeper_aio.autorecovery.worker import HealResult, ReplicationWorker
from bookkeeper_aio.cli import autorecovery_commands
from metadata.memory import MemoryStore
from metadata.underreplication import ReplicationLock, UnderReplicated, UnderReplicationManager

ROOT = "/bookkeeper/inline"
BOOKIE = "b3"


async def _marked(store: MemoryStore) -> UnderReplicationManager:
    urm = UnderReplicationManager(store, ROOT)
    for ledger_id in (1, 2):
        await urm.mark(ledger_id, [BOOKIE], reason="operator")
    return urm


def _healed(urm: UnderReplicationManager) -> object:
    async def heal(
        self: ReplicationWorker, mark: UnderReplicated, lock: ReplicationLock | None = None
    ) -> HealResult:
        await urm.resolve(mark.ledger_id, [BOOKIE], lock=lock)
        return HealResult(mark.ledger_id, (BOOKIE,), (), 1, CopyStats(), resolved=True)

    return heal


async def test_a_lease_that_expired_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    urm = await _marked(store)
    heal = _healed(urm)
    granted: list[int] = []
    grant = store.grant_lease

    async def grant_lease(ttl_s: int) -> int:
        granted.append(await grant(ttl_s))
        return granted[-1]

    async def heal_outliving_the_lease(
        self: ReplicationWorker, mark: UnderReplicated, lock: ReplicationLock | None = None
    ) -> HealResult:
        if len(granted) == 1:
            await store.revoke_lease(granted[0])  # as if it expired during an outage
        return await heal(self, mark, lock)  # type: ignore[operator]

    monkeypatch.setattr(store, "grant_lease", grant_lease)
    monkeypatch.setattr(ReplicationWorker, "heal", heal_outliving_the_lease)
    bk = types.SimpleNamespace(context=None)
    healed, left = await autorecovery_commands._heal_inline(
        bk,  # type: ignore[arg-type]
        urm,
        AutorecoveryConfig(lease_ttl_s=2),
        [1, 2],
        BOOKIE,
        30.0,
        "recover",
    )
    assert (healed, left) == (2, [])
    assert len(granted) == 2  # a new lease for the ledger after the expiry
    assert await urm.get(2) is None


async def test_a_heal_timing_out_is_retried_and_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    urm = await _marked(MemoryStore())
    heal = _healed(urm)
    attempts: list[int] = []

    async def heal_timing_out(
        self: ReplicationWorker, mark: UnderReplicated, lock: ReplicationLock | None = None
    ) -> HealResult:
        attempts.append(mark.ledger_id)
        if mark.ledger_id == 2 or attempts.count(1) == 1:  # ledger 1 once, ledger 2 for ever
            raise TimeoutError("metadata CAS attempt over metadata_timeout_s")
        return await heal(self, mark, lock)  # type: ignore[operator]

    monkeypatch.setattr(ReplicationWorker, "heal", heal_timing_out)
    bk = types.SimpleNamespace(context=None)
    healed, left = await autorecovery_commands._heal_inline(
        bk,  # type: ignore[arg-type]
        urm,
        AutorecoveryConfig(),
        [1, 2],
        BOOKIE,
        1.5,
        "recover",
    )
    assert healed == 1
    assert left == ["ledger 2: TimeoutError: metadata CAS attempt over metadata_timeout_s"]
    assert attempts.count(1) == 2
    assert await urm.get(1) is None
    assert await urm.lock_holder(2) is None  # released
    assert "Traceback" not in capsys.readouterr().err
