"""The daemon on real bookies and etcd: a kill -9'd bookie's ledgers are healed within the delay
plus a bounded time (in process); the ``bkaio`` commands drive and report it (subprocesses)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.daemon import AutorecoveryDaemon
from metadata.cluster import connect as metadata_connect
from metadata.underreplication import UnderReplicationManager
from tests.integration.autorecovery.conftest import Cluster, verify_every_replica
from tests.unit.autorecovery.waiting import wait_until

pytestmark = pytest.mark.etcd

PASSWORD = b"pw"
FAST = AutorecoveryConfig(
    lost_bookie_recovery_delay_s=1.0,
    open_ledger_grace_s=1.0,
    audit_interval_s=0.2,
    check_interval_s=0,
    worker_idle_poll_s=0.2,
    ledger_retry_s=0.5,
    lease_ttl_s=3,
    status_interval_s=0.3,
    passwords=(PASSWORD,),
)


async def _ledgers(bk: BookKeeper, count: int, entries: int) -> dict[int, list[bytes]]:
    written: dict[int, list[bytes]] = {}
    for _ in range(count):
        handle = await bk.create_ledger(3, 2, 2, password=PASSWORD)
        payloads = [f"{handle.id}:{i}".encode() * 4 for i in range(entries)]
        for payload in payloads:
            await handle.append(payload)
        await handle.close()
        written[handle.id] = payloads
    return written


async def _a_bookie_they_name(bk: BookKeeper, ledger_ids: object) -> str:
    """A bookie the first of ``ledger_ids`` is written to: with 4 bookies each E = 3 ledger leaves
    one out, so a fixed id could be in none of a few ledgers (nothing to heal)."""
    md = (await bk.context.ledgers.read(min(ledger_ids))).metadata  # type: ignore[call-overload]
    return md.ensembles[0][1][0]


async def _references(bk: BookKeeper, ledger_ids: object, bookie_id: str) -> bool:
    for ledger_id in ledger_ids:  # type: ignore[attr-defined]
        md = (await bk.context.ledgers.read(ledger_id)).metadata
        if any(bookie_id in ensemble for _, ensemble in md.ensembles):
            return True
    return False


async def test_daemon_heals_a_killed_bookie(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(4)
    written = await _ledgers(bk, 6, 15)
    meta = metadata_connect(cluster.url)
    daemon = AutorecoveryDaemon(meta, FAST, daemon_id="d-test")
    try:
        async with daemon:
            await wait_until(lambda: daemon.metrics.is_auditor)
            victim = "b1"
            assert await _references(bk, written, victim)
            loop = asyncio.get_running_loop()
            killed_at = loop.time()
            await cluster.kill(victim)
            await wait_until(lambda: daemon.metrics.ledgers_marked > 0, timeout_s=15)
            urm = UnderReplicationManager(meta.store, meta.root)

            async def healed() -> bool:
                return await urm.count() == 0 and not await _references(bk, written, victim)

            await wait_until(healed, timeout_s=30)
            took = loop.time() - killed_at
            assert took >= FAST.lost_bookie_recovery_delay_s
            assert took < FAST.lost_bookie_recovery_delay_s + 20
            await wait_until(lambda: daemon.metrics.ledgers_healed == daemon.metrics.ledgers_marked)
            assert daemon.metrics.bytes_copied > 0
            statuses = await urm.statuses()
            assert "d-test" in statuses
        for ledger_id, payloads in written.items():
            await verify_every_replica(bk, ledger_id, PASSWORD, payloads, absent=[victim])
    finally:
        await meta.close()


def _bkaio(url: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bookkeeper_aio.cli.main", *args, "--metadata", url],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


async def test_commands_drive_and_report_a_daemon_process(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(4)
    written = await _ledgers(bk, 4, 10)
    disabled = await asyncio.to_thread(_bkaio, cluster.url, "autorecovery", "disable", "--json")
    assert disabled.returncode == 0, disabled.stderr
    assert json.loads(disabled.stdout) == {"enabled": False}
    log_path = cluster.base / "autorecovery.log"
    with log_path.open("w") as log_file:
        daemon = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bookkeeper_aio.cli.main", "--log-level", "info", "autorecovery", "run",
            "--metadata", cluster.url, "--id", "d-proc", "--lost-bookie-delay", "0.5",
            "--audit-interval", "0.2", "--password", "pw", "--open-ledger-grace", "1",
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
        )  # fmt: skip
    try:
        assert daemon.stdout is not None
        ready = (await asyncio.wait_for(daemon.stdout.readline(), 30)).decode()
        assert ready.startswith("READY autorecovery d-proc"), (ready, log_path.read_text()[-2000:])
        victim = await _a_bookie_they_name(bk, written)
        await cluster.kill(victim)
        urm = UnderReplicationManager(cluster.meta.store, cluster.root)

        async def marked() -> bool:
            return await urm.count() > 0

        await wait_until(marked, timeout_s=15)
        listing = await asyncio.to_thread(
            _bkaio, cluster.url, "autorecovery", "list-underreplicated", "--json"
        )
        rows = json.loads(listing.stdout)["ledgers"]
        assert rows
        assert all(row["missing"] == victim for row in rows)
        only = await asyncio.to_thread(
            _bkaio, cluster.url, "autorecovery", "list-underreplicated", "--bookie", victim, "--json"
        )
        assert [r["ledger_id"] for r in json.loads(only.stdout)["ledgers"]] == [r["ledger_id"] for r in rows]
        bystander = "b1" if victim == "b0" else "b0"  # alive: none of its ledgers is marked
        other = await asyncio.to_thread(
            _bkaio, cluster.url, "autorecovery", "list-underreplicated", "--bookie", bystander, "--json"
        )
        assert json.loads(other.stdout)["ledgers"] == []
        await asyncio.sleep(1.0)
        assert await urm.count() == len(rows)  # disabled: nothing healed
        enabled = await asyncio.to_thread(_bkaio, cluster.url, "autorecovery", "enable", "--json")
        assert json.loads(enabled.stdout) == {"enabled": True}

        async def none_left() -> bool:
            return await urm.count() == 0

        await wait_until(none_left, timeout_s=30)
        status = await asyncio.to_thread(_bkaio, cluster.url, "autorecovery", "status", "--json")
        assert status.returncode == 0, status.stderr
        summary = json.loads(status.stdout)
        assert summary["enabled"] is True
        assert summary["auditor"] == "d-proc"
        assert summary["under_replicated_ledgers"] == 0
        table = await asyncio.to_thread(_bkaio, cluster.url, "autorecovery", "status")
        assert table.returncode == 0, table.stderr
        assert "auditor                   d-proc" in table.stdout
        assert "DAEMON" in table.stdout
        assert "d-proc" in table.stdout.split("DAEMON", 1)[1]

        async def reported() -> bool:
            found = (await urm.statuses()).get("d-proc", {})
            return bool(found.get("ledgers_healed", 0) == len(rows) and found.get("bytes_copied", 0) > 0)

        await wait_until(reported, timeout_s=10)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(daemon.wait(), 20)
        except TimeoutError:
            daemon.kill()
            await daemon.wait()
            raise
    assert code == 0
    for ledger_id, payloads in written.items():
        await verify_every_replica(bk, ledger_id, PASSWORD, payloads, absent=[victim])


async def test_recover_command_heals_a_bookie_without_a_daemon(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(4)
    written = await _ledgers(bk, 3, 12)
    victim = await _a_bookie_they_name(bk, written)
    await cluster.kill(victim)
    result = await asyncio.to_thread(_bkaio, cluster.url, "recover", victim, "--password", "pw", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    on_victim = summary["ledgers"]
    assert summary["healed"] == on_victim
    assert summary["left"] == []
    assert "scan [" in result.stderr  # the progress bars
    assert f"heal [##############################] {on_victim}/{on_victim}" in result.stderr
    for ledger_id, payloads in written.items():
        await verify_every_replica(bk, ledger_id, PASSWORD, payloads, absent=[victim])
    bad = await asyncio.to_thread(_bkaio, cluster.url, "recover", "no/such", "--json")
    assert bad.returncode == 1
    assert "bad bookie id" in bad.stderr
