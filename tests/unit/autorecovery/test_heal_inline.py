"""The inline heal of ``bkaio recover`` / ``bkaio decommission`` outlives what the daemon outlives:
a lease that expired (a metadata outage longer than its TTL: a new lease, as the daemon's) and a
heal that timed out on metadata (the ledger is tried again, and reported if it stays unhealed)."""

from __future__ import annotations

import asyncio
import types

import pytest

from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.copier import CopyStats
from bookkeeper_aio.autorecovery.errors import NoPasswordForLedger
from bookkeeper_aio.autorecovery.worker import HealResult, ReplicationWorker
from bookkeeper_aio.cli import autorecovery_commands
from bookkeeper_aio.errors import NotEnoughBookies
from metadata.memory import MemoryStore
from metadata.underreplication import ReplicationLock, UnderReplicated, UnderReplicationManager
from tests.unit.autorecovery.commands import heal_without_password

ROOT = "/bookkeeper/inline"
BOOKIE = "b3"


async def _recover_inline(
    urm: UnderReplicationManager,
    ledgers: list[int],
    timeout_s: float,
    config: AutorecoveryConfig | None = None,
) -> autorecovery_commands.HealOutcome:
    """``bkaio recover BOOKIE``'s inline heal of ``ledgers`` (each test patches the worker's ``heal``)."""
    return await autorecovery_commands._heal_inline(
        types.SimpleNamespace(context=None),  # type: ignore[arg-type]
        urm,
        config or AutorecoveryConfig(),
        ledgers,
        BOOKIE,
        timeout_s,
        "recover",
    )


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
    outcome = await _recover_inline(urm, [1, 2], 30.0, AutorecoveryConfig(lease_ttl_s=2))
    assert (outcome.healed, outcome.left, outcome.stuck) == (2, [], ())
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
    outcome = await _recover_inline(urm, [1, 2], 1.5)
    assert (outcome.healed, outcome.stuck) == (1, ())
    assert outcome.left == ["ledger 2: TimeoutError: metadata CAS attempt over metadata_timeout_s"]
    assert attempts.count(1) == 2
    assert await urm.get(1) is None
    assert await urm.lock_holder(2) is None  # released
    assert "Traceback" not in capsys.readouterr().err


async def test_every_ledger_failing_for_what_needs_the_operator_stops_it_early(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ledger without its password, another without a possible replacement: no retry helps,
    so it stops once that has lasted STUCK_S (not at the timeout) and says why; a ledger failing
    for a passing reason (a metadata timeout) is retried meanwhile until it heals."""
    urm = UnderReplicationManager(MemoryStore(), ROOT)
    for ledger_id in (1, 2, 3):
        await urm.mark(ledger_id, [BOOKIE], reason="operator")
    heal = _healed(urm)
    attempts: list[int] = []

    async def heal_failing(
        self: ReplicationWorker, mark: UnderReplicated, lock: ReplicationLock | None = None
    ) -> HealResult:
        attempts.append(mark.ledger_id)
        if mark.ledger_id == 1:
            raise NoPasswordForLedger(f"ledger {mark.ledger_id}: no password of the daemon's matches")
        if mark.ledger_id == 2:
            raise NotEnoughBookies(f"no writable bookie to replace {BOOKIE}")
        if attempts.count(3) <= 3:
            raise TimeoutError("metadata CAS attempt over metadata_timeout_s")
        return await heal(self, mark, lock)  # type: ignore[operator]

    monkeypatch.setattr(ReplicationWorker, "heal", heal_failing)
    monkeypatch.setattr(autorecovery_commands, "HEAL_RETRY_S", 0.05)
    monkeypatch.setattr(autorecovery_commands, "STUCK_S", 0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcome = await _recover_inline(urm, [1, 2, 3], 60.0)
    assert loop.time() - started < 10  # not the 60 s timeout
    assert attempts.count(3) == 4  # the passing failure: retried until it healed
    assert outcome.healed == 1
    assert outcome.stuck == (NoPasswordForLedger, NotEnoughBookies)
    assert [line.split(":")[0] for line in outcome.left] == ["ledger 1", "ledger 2"]
    assert "NoPasswordForLedger" in outcome.left[0]
    assert [mark.ledger_id for mark in [await urm.get(1), await urm.get(2)] if mark] == [1, 2]  # kept
    assert await urm.lock_holder(1) is None
    final = capsys.readouterr().err.strip().splitlines()[-1]
    assert final.startswith("heal ["), final
    assert "ledger 2: NotEnoughBookies" in final, final  # the latest problem, in the progress line


async def test_a_ledger_held_by_a_daemon_does_not_stop_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """One ledger needs the operator, the other is being healed by a daemon (that passes): it goes
    on until the timeout."""
    store = MemoryStore()
    urm = await _marked(store)
    lease = await store.grant_lease(30)
    assert await urm.acquire(2, "a-daemon", lease) is not None

    monkeypatch.setattr(ReplicationWorker, "heal", heal_without_password)
    monkeypatch.setattr(autorecovery_commands, "HEAL_RETRY_S", 0.05)
    monkeypatch.setattr(autorecovery_commands, "STUCK_S", 0.1)
    outcome = await _recover_inline(urm, [1, 2], 1.0)
    assert outcome.stuck == ()
    assert outcome.left == [
        "ledger 1: NoPasswordForLedger: ledger 1: no password of the daemon's matches",
        "ledger 2: being healed by a daemon",
    ]


async def test_a_daemon_taking_its_turn_at_a_stuck_ledger_does_not_keep_it_going(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon retries the same marks: when it holds the lock of a ledger whose last try here met
    a missing password, that ledger still needs the operator (a daemon meets the same problem)."""
    urm = await _marked(MemoryStore())
    acquire = urm.acquire
    tries: list[int] = []

    async def acquire_unless_a_daemon_holds_it(ledger_id: int, owner: str, lease_id: int) -> object:
        tries.append(ledger_id)
        if ledger_id == 1 and tries.count(1) > 1:
            return None  # a daemon's try at it, every round from now on
        return await acquire(ledger_id, owner, lease_id)

    monkeypatch.setattr(urm, "acquire", acquire_unless_a_daemon_holds_it)
    monkeypatch.setattr(ReplicationWorker, "heal", heal_without_password)
    monkeypatch.setattr(autorecovery_commands, "HEAL_RETRY_S", 0.05)
    monkeypatch.setattr(autorecovery_commands, "STUCK_S", 0.2)
    outcome = await _recover_inline(urm, [1, 2], 60.0)
    assert outcome.stuck == (NoPasswordForLedger,)
    assert outcome.left[0] == "ledger 1: NoPasswordForLedger: ledger 1: no password of the daemon's matches"
