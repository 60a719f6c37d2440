"""Over-replicated ledgers with real bookie processes, a real etcd and a real replication worker: a
bookie that comes back after its ledgers were re-replicated elsewhere drops its stale copies of the
closed ones (reads answer ENOLEDGER), keeps every ledger metadata still places on it, and the
client reads every entry from the ledgers' current replicas."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.protocol.codes import StatusCode
from metadata.underreplication import UnderReplicationManager
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

from .test_gc import init_cluster, payload, run_gc, statuses

pytestmark = pytest.mark.etcd

PASSWORD = b"over"


async def test_a_returning_bookie_drops_the_copies_that_were_re_replicated_elsewhere(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/gco-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    gc_args = [
        *("--metadata", url, "--admin-port", "0", "--gc-interval-s", "0"),
        *("--gc-deleted-ledger-grace-s", "0", "--gc-over-replicated-interval-s", "0.1"),
    ]
    procs = [BookieProcess(tmp_path / f"b{i}", f"b{i}", extra_args=gc_args) for i in range(4)]
    try:
        for proc in procs:
            proc.start()
        config = ClientConfig(add_timeout_s=5.0, read_timeout_s=5.0)
        async with BookKeeper.connect(url, config=config) as bk:

            async def write(ensemble: int, write_quorum: int) -> tuple[int, list[bytes]]:
                handle = await bk.create_ledger(ensemble, write_quorum, 2, password=PASSWORD)
                payloads = [payload(handle.id, e, 300) for e in range(30)]
                for p in payloads:
                    await handle.append(p)
                await handle.close()
                return handle.id, payloads

            moved_id, moved = await write(3, 3)  # on 3 of the 4 bookies: one of them is the victim
            victim = (await bk.context.ledgers.read(moved_id)).metadata.ensembles[0][1][0]
            kept_id, kept = await write(4, 2)  # on all four: its victim fragment is not healed
            open_handle = await bk.create_ledger(4, 2, 2, password=PASSWORD)  # open: never judged
            for n in range(4):  # E entries: every bookie of its ensemble holds some
                await open_handle.append(b"still open %d" % n)

            proc = next(p for p in procs if p.bookie_id == victim)
            assert proc.stop() == 0
            urm = UnderReplicationManager(bk.context.ledgers.store, bk.context.ledgers.keys.root)
            worker = ReplicationWorker(bk, urm, AutorecoveryConfig(passwords=(PASSWORD,)), worker_id="w-test")
            result = await worker.heal(await urm.mark(moved_id, [victim], reason="lost"))
            assert (result.healed, result.left) == ((victim,), ())
            placed = (await bk.context.ledgers.read(moved_id)).metadata.ensembles[0][1]
            assert victim not in placed

            async def key(ledger_id: int) -> bytes:  # reads carry each ledger's own (salted) key
                return codec_for((await bk.context.ledgers.read(ledger_id)).metadata, PASSWORD).master_key

            proc.start()  # back, with its copy of the moved ledger
            assert await statuses(proc, [moved_id], await key(moved_id)) == {StatusCode.EOK}
            report = await run_gc(proc)  # (no grace here: collected at its first sighting)
            assert report["error"] is None
            assert (report["replicas_checked"], report["over_replicated_collected"]) == (3, 1)
            assert await statuses(proc, [moved_id], await key(moved_id)) == {StatusCode.ENOLEDGER}
            # still held (entry 0 may live on other bookies of the E4/Qw2 write sets: EOK or ENOENTRY)
            for held in (kept_id, open_handle.id):
                assert StatusCode.ENOLEDGER not in await statuses(proc, [held], await key(held))

            for ledger_id, payloads in ((moved_id, moved), (kept_id, kept)):
                reader = await bk.open_ledger(ledger_id, password=PASSWORD)
                assert [e.payload async for e in reader.read()] == payloads
                await reader.close()
            await open_handle.close()
    finally:
        for proc in procs:
            proc.cleanup()
