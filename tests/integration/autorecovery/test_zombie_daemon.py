"""A real ``bkaio autorecovery run`` process stopped (SIGSTOP) between its copy and its CAS, for
longer than its lease, while another worker heals the ledger and the fragment changes back (ABA):
once continued it commits nothing (LockLost, in its log and metrics), and afterwards, holding a new
lease, it heals the ledger properly. Slow: bookie processes with registration, a daemon process."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.common import failpoints
from metadata.underreplication import UnderReplicationManager
from tests.integration.autorecovery.conftest import verify_every_replica
from tests.integration.autorecovery.test_acceptance import CONFIG, PASSWORD, SelfCluster, _closed, sc
from tests.unit.autorecovery.waiting import wait_until

__all__ = ["sc"]

pytestmark = [pytest.mark.etcd, pytest.mark.slow]


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


async def test_a_daemon_stopped_past_its_lease_commits_nothing(
    sc: SelfCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    await sc.start_bookies(4)
    urm = UnderReplicationManager(sc.meta.store, sc.root)
    async with BookKeeper.connect(sc.url, config=CONFIG) as bk:
        written = await _closed(bk, 1, 200, size=512)
        (ledger_id,) = written
        original = (await bk.context.ledgers.read(ledger_id)).metadata
        missing = original.ensembles[0][1][-1]  # live: a mark for it is healed like a decommission
        # its first ledger CAS stops the daemon (after the fragment's copy, before its commit)
        monkeypatch.setenv(failpoints.ENV_VAR, f"{failpoints.CAS_BEFORE}=count:1:stop")
        await sc.start_daemon("zombie", "--workers", "1", "--lease-ttl", "2", "--lost-bookie-delay", "3600")
        monkeypatch.delenv(failpoints.ENV_VAR)
        pid = sc.daemons["zombie"].pid
        await urm.mark(ledger_id, [missing], reason="operator")
        await wait_until(lambda: _stopped(pid), timeout_s=30)
        holder = await urm.lock_holder(ledger_id)
        assert holder is not None
        assert holder.owner.startswith("zombie")

        async def lock_gone() -> bool:
            return await urm.lock_holder(ledger_id) is None

        await wait_until(lock_gone, timeout_s=15)  # its lease expired while it was stopped

        # another worker heals the ledger meanwhile, under its own lock
        config = AutorecoveryConfig(passwords=(PASSWORD,))
        lease = await sc.meta.store.grant_lease(30)
        try:
            lock = await urm.acquire(ledger_id, "healthy", lease)
            assert lock is not None
            mark = await urm.get(ledger_id)
            assert mark is not None
            result = await ReplicationWorker(bk, urm, config, worker_id="healthy").heal(mark, lock)
            assert result.resolved
        finally:
            await sc.meta.store.revoke_lease(lease)
        healed = await bk.context.ledgers.read(ledger_id)
        assert missing not in healed.metadata.ensembles[0][1]
        # the fragment changes back (ABA) and the bookie is marked again; workers take no new
        # ledger (the zombie's heal in flight is not new: it goes on when continued)
        back = dataclasses.replace(healed.metadata, ensembles=original.ensembles)
        await bk.context.ledgers.write(back, healed.version)
        await urm.mark(ledger_id, [missing], reason="operator")
        await urm.set_enabled(False)
        before = await bk.context.ledgers.read(ledger_id)

        os.kill(pid, signal.SIGCONT)
        log = sc.base / "zombie.log"
        await wait_until(lambda: "autorecovery.lock_lost" in log.read_text(), timeout_s=30)
        assert await bk.context.ledgers.read(ledger_id) == before, "the zombie committed"
        left = await urm.get(ledger_id)
        assert left is not None
        assert left.missing == (missing,)

        # alive again, with a new lease: it heals the ledger properly once allowed
        await urm.set_enabled(True)

        async def healed_again() -> bool:
            return await urm.get(ledger_id) is None

        await wait_until(healed_again, timeout_s=30)
        await verify_every_replica(bk, ledger_id, PASSWORD, written[ledger_id], absent=[missing])

        async def published() -> bool:  # every status_interval_s
            return (await urm.statuses()).get("zombie", {}).get("ledgers_healed") == 1

        await wait_until(published, timeout_s=15)
        assert (await urm.statuses())["zombie"]["locks_lost"] == 1
