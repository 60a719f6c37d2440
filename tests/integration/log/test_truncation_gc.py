"""Issue 14 acceptance 3 on a real bookie: a log's truncated ledgers leave the metadata, and the
bookie's GC takes them out of its index (reads answer ENOLEDGER), while the kept ledgers read back."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from bookkeeper_aio import (
    BookKeeper,
    LogPosition,
    NoSuchLedger,
    open_log_reader,
    open_log_writer,
    truncate_log,
)
from bookkeeper_aio.client.keys import codec_for
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.etcd import EtcdCluster
from tests.integration.bookie.test_gc import gc_bookie, init_cluster, run_gc, statuses
from tests.integration.log.conftest import CONFIG

pytestmark = pytest.mark.etcd


async def test_truncated_ledgers_leave_the_bookie_after_gc(etcd_server: EtcdCluster, tmp_path: Path) -> None:
    url = etcd_server.url(f"/bookkeeper/logtrunc-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    bookie = gc_bookie(tmp_path, url)
    bookie.start()
    try:
        async with BookKeeper.connect(url, config=CONFIG) as bk:
            writer = await open_log_writer(bk, "t", ensemble=1, write_quorum=1, ack_quorum=1, password=b"pw")
            positions = []
            for ledger in range(4):
                positions += [await writer.append(f"{ledger}-{i}".encode()) for i in range(5)]
                if ledger < 3:
                    await writer.roll()
            ledgers = sorted({p.ledger_id for p in positions if p is not None})
            assert await truncate_log(bk, "t", LogPosition(ledgers[2], 0), password=b"pw") == LogPosition(
                ledgers[2], 0
            )
            for gone in ledgers[:2]:
                with pytest.raises(NoSuchLedger):
                    await bk.open_ledger(gone, password=b"pw")
            report = await run_gc(bookie)
            assert report["error"] is None
            assert report["ledgers_collected"] == 2
            assert await statuses(bookie, ledgers[:2]) == {StatusCode.ENOLEDGER}
            for kept in ledgers[2:]:  # read with each ledger's key (a salted one per ledger)
                key = codec_for((await bk.context.ledgers.read(kept)).metadata, b"pw").master_key
                assert await statuses(bookie, [kept], key) == {StatusCode.EOK}
            await writer.append(b"after")  # the writer goes on, past the truncation and the GC
            await writer.close()
            reader = await open_log_reader(bk, "t", password=b"pw")
            assert [r.payload async for r in reader] == [
                f"{ledger}-{i}".encode() for ledger in (2, 3) for i in range(5)
            ] + [b"after"]
    finally:
        bookie.cleanup()
