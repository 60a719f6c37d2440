"""Squatting ledger ids (issue 20, items 2 and 3) against real bookie processes and a real etcd:
fences and adds of future ledger ids with a junk key create no record on a bookie with metadata,
records squatted while a bookie ran without metadata are re-keyed when the real writer comes, and
a bookie of the ensemble that never got an entry keeps its recovery fence through all of it."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

import metadata
from bookkeeper_aio import BookKeeper, ClientConfig, LedgerFenced
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from metadata.idgen import BLOCK_SIZE_DEFAULT, FIRST_ID
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

from .wire import WireClient, entry_body

pytestmark = pytest.mark.etcd

JUNK = b"J" * 32
PASSWORD = b"tenant password"
SQUATTED = 20
"""Future ledger ids squatted on each bookie at the start of each of the next two id blocks (the
issue fenced 3000; what matters is that the next clients' ids are among them)."""
CONFIG = ClientConfig(add_timeout_s=5.0, read_timeout_s=5.0)


async def _next_ids(url: str) -> list[int]:
    """The first ids of the next two clients (what a squatter reads in etcd)."""
    async with metadata.connect(url) as conn:
        if await metadata.read_cluster_info(conn.store, conn.root) is None:
            await metadata.init_cluster(conn.store, conn.root)
        manager = metadata.LedgerManager(conn.store, conn.root)
        counter = await conn.store.get(manager.keys.idgen)
    first = int(counter.value) if counter is not None else FIRST_ID
    return [first, first + BLOCK_SIZE_DEFAULT]


async def _squat(bookie: BookieProcess, ids: list[int]) -> set[int]:
    """Fence the first half of ``ids`` and add an entry to the others, with a junk key; the
    statuses."""
    wire = await WireClient.connect(*bookie.address)
    half = len(ids) // 2
    try:
        fences = [wire.fence(i, key=JUNK) for i in ids[:half]]
        adds = [wire.add(i, 0, b"junk", key=JUNK) for i in ids[half:]]
        return {r.status for r in await asyncio.gather(*fences, *adds)}
    finally:
        wire.close()


async def _ledger_count(bookie: BookieProcess) -> int:
    wire = await WireClient.connect(*bookie.address)
    try:
        info = await wire.request(m.GetBookieInfoRequest)
        return int(info.info["ledgers"])
    finally:
        wire.close()


async def _write_and_read(url: str, entries: int) -> None:
    """A new client's ledger, written, closed and read back whole."""
    async with BookKeeper.connect(url, config=CONFIG) as bk:
        handle = await bk.create_ledger(3, 3, 2, password=PASSWORD)
        for i in range(entries):
            await handle.append(b"entry %d" % i)
        await handle.close()
        reader = await bk.open_ledger(handle.id, password=PASSWORD)
        assert [e.payload async for e in reader.read()] == [b"entry %d" % i for i in range(entries)]


def _bookies(tmp_path: Path, url: str | None) -> list[BookieProcess]:
    args = ["--metadata", url] if url is not None else []
    return [BookieProcess(tmp_path / f"b{i}", f"b{i}", extra_args=args) for i in range(3)]


async def test_squatted_future_ids_are_refused_or_rekeyed_and_new_ledgers_work(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/keys-{uuid.uuid4().hex[:8]}")
    squatted = [i for first in await _next_ids(url) for i in range(first, first + SQUATTED)]
    later = [i + SQUATTED for i in squatted]

    # 1. The bookies join the cluster, then run once without metadata (as before this check): the
    # squatter's records are created.
    for proc in _bookies(tmp_path, url):
        proc.start()
        proc.stop()
    plain = _bookies(tmp_path, None)
    try:
        for proc in plain:
            proc.start()
            # a fence proves itself by EOK/ENOENTRY (no last entry), an add by EOK
            assert await _squat(proc, squatted) == {StatusCode.EOK, StatusCode.ENOENTRY}
            assert await _ledger_count(proc) == len(squatted)
    finally:
        for proc in plain:
            proc.stop()

    # 2. The same bookies with metadata: new squats create nothing (metadata has no such ledger)...
    procs = _bookies(tmp_path, url)
    try:
        for proc in procs:
            proc.start()
            assert await _squat(proc, later) == {StatusCode.EUA}
            assert await _ledger_count(proc) == len(squatted)
        # ... and the next clients' ledgers, whose ids the squatter fenced, work: re-keyed.
        await _write_and_read(url, 5)
        await _write_and_read(url, 5)
    finally:
        for proc in procs:
            proc.cleanup()


async def test_a_recovery_fence_on_a_bookie_without_entries_is_kept(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/keys-{uuid.uuid4().hex[:8]}")
    await _next_ids(url)
    procs = _bookies(tmp_path, url)
    try:
        for proc in procs:
            proc.start()
        async with BookKeeper.connect(url, config=CONFIG) as bk:
            writer = await bk.create_ledger(3, 2, 2, password=PASSWORD)
            await writer.append(b"only entry")  # written to 2 of the 3 bookies
            md = writer.metadata
            ensemble = md.ensembles[0][1]
            bare = next(p for p in procs if p.bookie_id == ensemble[2])  # never got an entry
            async with BookKeeper.connect(url, config=CONFIG) as recoverer:
                await recoverer.open_ledger(writer.id, password=PASSWORD, recovery=True)
            with pytest.raises(LedgerFenced):
                await writer.append(b"after recovery")
            writer.abort()
        key = codec_for(md, PASSWORD).master_key
        body = entry_body(writer.id, 1, b"late add", 0)
        # The recovery's fence went to all three, but it finished once two covered every write
        # set, and its client may have closed before the third one's frame left: the same fence
        # (real key, no entry), sent here, is sure to be on the bare bookie.
        wire = await WireClient.connect(*bare.address)
        try:
            assert (await wire.fence(writer.id, key=key)).status in (StatusCode.EOK, StatusCode.ENOENTRY)
        finally:
            wire.close()
        for restart in (False, True):
            if restart:
                bare.restart()
            wire = await WireClient.connect(*bare.address)
            try:
                # A junk key neither unfences nor re-keys it; the real key's plain add is fenced.
                assert (await wire.fence(writer.id, key=JUNK)).status == StatusCode.EUA
                assert (await wire.add(writer.id, 1, b"junk", key=JUNK)).status == StatusCode.EUA
                late = await wire.request(m.AddEntryRequest, writer.id, 1, 0, key, body)
                assert late.status == StatusCode.EFENCED
            finally:
                wire.close()
    finally:
        for proc in procs:
            proc.cleanup()


async def test_a_bulk_creator_is_never_refused(etcd_server: EtcdCluster, tmp_path: Path) -> None:
    """One client host starts 300 ledgers at once (a broker opening its topics): every bookie
    checks 300 new keys against metadata for one peer address, more than its read slots for one
    peer (64) and for everyone (256); the lookups queue, no add is refused (issue 20: they were
    answered ETOOMANYREQUESTS, and with three bookies the ledgers failed)."""
    url = etcd_server.url(f"/bookkeeper/keys-{uuid.uuid4().hex[:8]}")
    await _next_ids(url)
    procs = _bookies(tmp_path, url)
    try:
        for proc in procs:
            proc.start()
        config = ClientConfig(add_timeout_s=30.0, read_timeout_s=10.0)
        async with BookKeeper.connect(url, config=config) as bk:
            creates = (bk.create_ledger(3, 3, 2, password=PASSWORD) for _ in range(300))
            handles = await asyncio.gather(*creates)
            await asyncio.gather(*(h.append(b"first of %d" % h.id) for h in handles))  # all at once
            await asyncio.gather(*(h.append(b"second of %d" % h.id) for h in handles))
            await asyncio.gather(*(h.close() for h in handles))
            for handle in (handles[0], handles[-1]):
                reader = await bk.open_ledger(handle.id, password=PASSWORD)
                payloads = [e.payload async for e in reader.read()]
                assert payloads == [b"first of %d" % handle.id, b"second of %d" % handle.id]
        for proc in procs:
            assert await _ledger_count(proc) == 300
    finally:
        for proc in procs:
            proc.cleanup()
