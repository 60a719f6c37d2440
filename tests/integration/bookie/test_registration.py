"""A bookie with --metadata: registers (lease-bound) so clients find it, deregisters on SIGTERM,
and refuses to serve a data directory that is not the one its id was first started with."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path

import metadata
from bookkeeper_aio import BookKeeper
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

from .wire import WireClient, known_ledgers

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


def test_a_data_dir_is_refused_by_another_cluster(etcd_server: EtcdCluster, tmp_path: Path) -> None:
    """A wrong --metadata root (or a re-initialised metadata store) must not take the bookie: its GC
    would find none of its ledgers there and collect them all."""
    home = etcd_server.url(f"/bookkeeper/home-{uuid.uuid4().hex[:8]}")
    other = etcd_server.url(f"/bookkeeper/other-{uuid.uuid4().hex[:8]}")
    asyncio.run(_init(home))
    asyncio.run(_init(other))
    data = tmp_path / "b0"
    bookie = BookieProcess(data, "b0", extra_args=["--metadata", home])
    elsewhere = BookieProcess(data, "b0", extra_args=["--metadata", other])
    try:
        bookie.start()
        asyncio.run(known_ledgers(home, 7))
        asyncio.run(_add_one(bookie))  # the data dir now holds a journal segment
        assert bookie.stop() == 0
        cookie = json.loads((data / "COOKIE").read_text())
        assert cookie["cluster_instance_id"]
        assert elsewhere.start_expect_failure() == EXIT_REFUSED
        assert "belongs to cluster" in elsewhere.log_tail()
        del cookie["cluster_instance_id"]  # a data dir from before bookies recorded their cluster
        (data / "COOKIE").write_text(json.dumps(cookie))
        assert elsewhere.start_expect_failure() == EXIT_REFUSED
        assert "has no cookie for bookie 'b0'" in elsewhere.log_tail()
        assert "b0" not in asyncio.run(_bookies(other)).writable
        bookie.start()  # at home it is accepted, and records its cluster again
        assert bookie.stop() == 0
        assert json.loads((data / "COOKIE").read_text())["cluster_instance_id"] == cookie_cluster(home)
    finally:
        bookie.cleanup()
        elsewhere.cleanup()


async def _add_one(bookie: BookieProcess) -> None:
    client = await WireClient.connect(*bookie.address)
    try:
        assert (await client.add(7, 0, b"kept")).status == StatusCode.EOK
    finally:
        client.close()


def cookie_cluster(url: str) -> str:
    async def read() -> str:
        async with metadata.connect(url) as conn:
            info = await metadata.read_cluster_info(conn.store, conn.root)
            assert info is not None
            return info.instance_id

    return asyncio.run(read())


def test_a_bookie_on_every_interface_publishes_its_advertised_address(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    """Listening on 0.0.0.0, the bookie registers the address it was told to advertise (here a second
    loopback address, 127.0.0.2), and a client that finds it through metadata writes and reads there."""
    url = etcd_server.url(f"/bookkeeper/adv-{uuid.uuid4().hex[:8]}")
    asyncio.run(_init(url))
    bookie = BookieProcess(
        tmp_path / "b0",
        "b0",
        extra_args=["--metadata", url, "--host", "0.0.0.0", "--advertised-address", "127.0.0.2"],
    )
    try:
        _, port = bookie.start()
        registered = asyncio.run(_bookies(url)).writable["b0"]
        assert (registered.host, registered.port) == ("127.0.0.2", port)

        async def write_and_read() -> list[bytes]:
            async with BookKeeper.connect(url) as bk:
                handle = await bk.create_ledger(1, 1, 1, password=b"pw")
                await handle.append(b"over the advertised address")
                await handle.close()
                async with await bk.open_ledger(handle.id, password=b"pw") as reader:
                    return [e.payload async for e in reader.read(0, 0)]

        assert asyncio.run(write_and_read()) == [b"over the advertised address"]
    finally:
        bookie.cleanup()


def test_an_unreachable_etcd_at_start_says_what_to_check(tmp_path: Path) -> None:
    url = "etcd://127.0.0.1:1/bookkeeper/x?op_timeout_s=0.5&connect_timeout_s=0.2"
    proc = BookieProcess(tmp_path / "b", bookie_id="b", extra_args=["--metadata", url])
    with proc:
        assert proc.start_expect_failure() == 3
    refused = next(line for line in proc.log_tail().splitlines() if "bookie: refusing to start" in line)
    assert f"check that etcd runs at the metadata URL's HOST:PORT ({url})" in refused
