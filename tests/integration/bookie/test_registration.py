"""A bookie with --metadata: registers (lease-bound) so clients find it, deregisters on SIGTERM,
and refuses to serve a data directory that is not the one its id was first started with."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import metadata
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

EXIT_REFUSED = 3


async def _bookies(url: str) -> metadata.BookieSet:
    async with metadata.connect(url) as conn:
        return await metadata.list_bookies(conn.store, conn.root)


async def _init(url: str) -> None:
    async with metadata.connect(url) as conn:
        await metadata.init_cluster(conn.store, conn.root)


def test_registration_cookie_and_wiped_disk_refusal(etcd_server: EtcdCluster, tmp_path: Path) -> None:
    url = etcd_server.url(f"/bookkeeper/reg-{uuid.uuid4().hex[:8]}")
    data = tmp_path / "b0"
    bookie = BookieProcess(data, "b0", extra_args=["--metadata", url])
    # no cluster yet: refused with the command to run
    assert bookie.start_expect_failure() == EXIT_REFUSED
    assert "bkaio cluster init" in bookie.log_tail()
    asyncio.run(_init(url))
    host, port = bookie.start()
    registered = asyncio.run(_bookies(url)).writable
    assert (registered["b0"].host, registered["b0"].port) == (host, port)
    assert bookie.stop() == 0
    assert "b0" not in asyncio.run(_bookies(url)).writable  # deregistered on SIGTERM
    bookie.start()  # same data dir: accepted again
    assert bookie.stop() == 0
    shutil.rmtree(data)  # the disk is lost; the id comes back on an empty directory
    assert bookie.start_expect_failure() == EXIT_REFUSED
    assert "bkaio bookie format b0" in bookie.log_tail()
