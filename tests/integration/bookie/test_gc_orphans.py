"""Orphan copies with real bookie processes, a real etcd and a real replication worker: a heal
copies a closed ledger to a bookie, its metadata update fails (the worker's lock was gone at the
commit), and the heal is retried to another bookie. The copy left behind is listed by no metadata;
the bookie's GC drops it (reads answer ENOLEDGER), and keeps every ledger it is listed in, every
open ledger, and every ledger a worker holds the replication lock of — each of which it drops as
soon as that reason is gone, so each assertion below could fail."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.copier import FragmentCopy, copy_fragment
from bookkeeper_aio.autorecovery.errors import LockLost
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.protocol.codes import StatusCode
from metadata.underreplication import UnderReplicationManager
from tests.harness.admin_http import scrape
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

from .test_gc import init_cluster, payload, run_gc, statuses

pytestmark = pytest.mark.etcd

PASSWORD = b"orphans"


async def test_orphan_copies_are_collected_and_needed_copies_never(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/gcorphan-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    gc_args = [
        *("--metadata", url, "--admin-port", "0", "--gc-interval-s", "0"),
        *("--gc-deleted-ledger-grace-s", "0", "--gc-over-replicated-interval-s", "0.1"),
    ]
    procs = {f"b{i}": BookieProcess(tmp_path / f"b{i}", f"b{i}", extra_args=gc_args) for i in range(5)}
    try:
        for proc in procs.values():
            proc.start()
        config = ClientConfig(add_timeout_s=5.0, read_timeout_s=5.0)
        async with BookKeeper.connect(url, config=config) as bk:
            ledgers = bk.context.ledgers
            urm = UnderReplicationManager(ledgers.store, ledgers.keys.root)
            worker = ReplicationWorker(bk, urm, AutorecoveryConfig(passwords=(PASSWORD,)), worker_id="w-test")

            async def write(ensemble: int, write_quorum: int, entries: int, close: bool = True) -> int:
                handle = await bk.create_ledger(ensemble, write_quorum, 2, password=PASSWORD)
                for e in range(entries):
                    await handle.append(payload(handle.id, e, 200))
                if close:
                    await handle.close()
                else:
                    open_handles.append(handle)
                return handle.id

            async def key(ledger_id: int) -> bytes:
                return codec_for((await ledgers.read(ledger_id)).metadata, PASSWORD).master_key

            async def held_by(bookie: str, ledger_id: int) -> bool:
                found = await statuses(procs[bookie], [ledger_id], await key(ledger_id))
                return StatusCode.ENOLEDGER not in found

            open_handles: list[LedgerHandle] = []
            everywhere = await write(5, 2, 10)  # on all five bookies: whichever holds the orphan
            healed = await write(3, 3, 20)
            first = (await ledgers.read(healed)).metadata.ensembles[0][1]
            lost = first[0]
            assert procs[lost].stop() == 0
            candidates = sorted(set(procs) - set(first))

            # a heal whose commit fails: its lock's lease was gone (a worker paused past it)
            lease = await ledgers.store.grant_lease(30)
            stale = await urm.acquire(healed, "w-paused", lease)
            assert stale is not None
            await ledgers.store.revoke_lease(lease)
            with pytest.raises(LockLost):
                await worker.heal(await urm.mark(healed, [lost], reason="lost"), stale)
            assert (await ledgers.read(healed)).metadata.ensembles[0][1] == first  # nothing committed
            orphan_on = [b for b in candidates if await held_by(b, healed)]
            assert len(orphan_on) == 1, orphan_on
            orphan = orphan_on[0]
            other = next(b for b in candidates if b != orphan)

            # the retry goes to the other bookie (the orphan's is down meanwhile) and commits
            assert procs[orphan].stop() == 0
            mark = await urm.get(healed)
            assert mark is not None
            lease = await ledgers.store.grant_lease(30)
            lock = await urm.acquire(healed, "w-test", lease)
            result = await worker.heal(mark, lock)
            await ledgers.store.revoke_lease(lease)
            assert result.healed == (lost,)
            now_on = (await ledgers.read(healed)).metadata.ensembles[0][1]
            assert orphan not in now_on
            assert other in now_on
            assert await urm.get(healed) is None

            # two more ledgers on the three bookies up (not the orphan's bookie): one left open
            still_open = await write(3, 3, 5, close=False)
            locked = await write(3, 3, 5)
            procs[orphan].start()
            # copies of both on the orphan's bookie that no metadata lists (as a heal's copy whose
            # commit never came): one open, one whose lock a worker holds right now
            for ledger_id in (still_open, locked):
                md = (await ledgers.read(ledger_id)).metadata
                ensemble = md.ensembles[0][1]
                codec = codec_for(md, PASSWORD)
                copy = FragmentCopy(md, 0, 4, ensemble, (orphan, *ensemble[1:]))
                await copy_fragment(bk.context, copy, codec, codec.master_key, window=8)
                assert await held_by(orphan, ledger_id)
            worker_lease = await ledgers.store.grant_lease(30)
            assert await urm.acquire(locked, "w-busy", worker_lease) is not None

            assert await held_by(orphan, healed)  # back with its orphan copy
            report = await run_gc(procs[orphan])
            assert report["error"] is None
            assert (report["over_replicated_collected"], report["orphans_collected"]) == (1, 1)
            assert report["over_replicated_busy"] == 1
            assert not await held_by(orphan, healed)
            assert await held_by(orphan, everywhere)  # listed in its ensemble: kept
            assert await held_by(orphan, still_open)  # open: kept
            assert await held_by(orphan, locked)  # a worker holds its lock: kept
            metrics = await scrape(*procs[orphan].admin_address())
            assert metrics["bookie_gc_orphans_collected_total"] == 1

            # each reason gone, the copy goes: the lock released, the ledger closed
            await ledgers.store.revoke_lease(worker_lease)
            await open_handles[0].close()
            await asyncio.sleep(0.2)  # the check is due again (every 0.1 s here)
            report = await run_gc(procs[orphan])
            assert (report["over_replicated_collected"], report["orphans_collected"]) == (2, 2)
            assert not await held_by(orphan, locked)
            assert not await held_by(orphan, still_open)
            assert await held_by(orphan, everywhere)

            for ledger_id, entries in ((healed, 20), (everywhere, 10), (locked, 5), (still_open, 5)):
                reader = await bk.open_ledger(ledger_id, password=PASSWORD)
                assert [e.payload async for e in reader.read()] == [
                    payload(ledger_id, e, 200) for e in range(entries)
                ]
                await reader.close()
    finally:
        for proc in procs.values():
            proc.cleanup()
