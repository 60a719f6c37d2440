"""Recovery of a ledger whose last entry is corrupt on disk, on real bookie processes.

docs/protocol.md §7.2: a bookie whose last entry fails its record check still answers a fence as
fenced (EOK, no body, ``unreadable``), so it counts toward coverage; the recovering client never
takes that copy as absent. Two such bookies of three used to leave the ledger unfenceable for good
(each answered EIO); now the ledger closes at its last entry when a good copy exists, and when no
replica can give one the open fails with an error naming the entry, leaving it IN_RECOVERY.

The damage is done to the journal bytes of the running bookies (their reads go through the page
cache, so they see it at once), exactly where the entry's payload lies.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper, LedgerFenced, LedgerHandle, LedgerRecoveryError
from metadata.ledger_metadata import LedgerState
from tests.integration.recovery.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd
PASSWORD = b"pw"
ENTRIES = 10


def _payload(i: int) -> bytes:
    return b"corrupt-last-%04d-" % i + b"y" * 48


def _rot(data_dir: Path, payload: bytes) -> int:
    """Flip one byte in the middle of every stored copy of ``payload`` under ``data_dir``."""
    flipped = 0
    for path in sorted(p for p in data_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        at = data.find(payload)
        while at >= 0:
            middle = at + len(payload) // 2
            with path.open("r+b") as f:
                f.seek(middle)
                f.write(bytes([data[middle] ^ 0x5A]))
            flipped += 1
            at = data.find(payload, at + 1)
    return flipped


def _holds(data_dir: Path, payload: bytes) -> bool:
    return any(payload in p.read_bytes() for p in data_dir.rglob("*") if p.is_file())


async def _stored(data_dir: Path, payload: bytes) -> None:
    """Wait until the bookie's files hold ``payload`` (Qa = 2 of 3: the third copy lands just after
    the ack)."""
    for _ in range(200):
        if _holds(data_dir, payload):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{data_dir.name} never stored the entry")


async def _written(cluster: Cluster, bk: BookKeeper) -> LedgerHandle:
    """E = Qw = 3, Qa = 2, entries 0..9 on every bookie, the writer still open."""
    await cluster.start(3)
    lh = await bk.create_ledger(3, 3, 2, password=PASSWORD)
    for i in range(ENTRIES):
        await lh.append(_payload(i))
    for proc in cluster.procs:
        await _stored(proc.data_dir, _payload(ENTRIES - 1))
    return lh


async def test_recovery__two_corrupt_last_entries_fence_and_close_at_the_good_copy(
    cluster: Cluster, bk: BookKeeper
) -> None:
    lh = await _written(cluster, bk)
    last = ENTRIES - 1
    for bookie_id in ("b0", "b1"):
        assert _rot(cluster.proc(bookie_id).data_dir, _payload(last)) >= 1, bookie_id
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        rh = await other.open_ledger(lh.id, password=PASSWORD, recovery=True)
        assert rh.metadata.state is LedgerState.CLOSED
        assert rh.last_add_confirmed == last
        assert [e.payload async for e in rh.read()] == [_payload(i) for i in range(ENTRIES)]
    for bookie_id in ("b0", "b1"):  # their fence answers were the unreadable-last-entry ones
        assert "processor.fenced_last_entry_unreadable" in cluster.proc(bookie_id).log_tail(200)
    with pytest.raises(LedgerFenced):
        await lh.append(b"after the fence")


async def test_recovery__no_good_copy_of_an_acked_last_entry_fails_never_closes_short(
    cluster: Cluster, bk: BookKeeper
) -> None:
    """Entry 9 was acknowledged, and every replica's copy is damaged: fencing succeeds (the writer
    is stopped), but recovery must not close the ledger at 8; the open fails, naming the entry."""
    lh = await _written(cluster, bk)
    last = ENTRIES - 1
    for proc in cluster.procs:
        assert _rot(proc.data_dir, _payload(last)) >= 1, proc.bookie_id
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        with pytest.raises(LedgerRecoveryError, match=rf"entry {last}: .*could not give an intact copy"):
            await other.open_ledger(lh.id, password=PASSWORD, recovery=True)
        rh = await other.open_ledger(lh.id, password=PASSWORD)  # no recovery: what metadata says
        assert rh.metadata.state is LedgerState.IN_RECOVERY
    with pytest.raises(LedgerFenced):
        await lh.append(b"after the fence")
