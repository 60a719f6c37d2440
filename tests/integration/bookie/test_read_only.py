"""Read-only mode of real bookie processes with real etcd (docs/bookie.md "Read-only mode": disk full).

- A bookie whose disk is below ``disk_free_bytes_min`` at start registers straight under
  ``bookies/readonly/``, answers EREADONLY (with the reason) to normal adds and accepts recovery adds.
- The admin toggle moves a running bookie to ``readonly/`` and back.
- A client writing to a 4-bookie cluster replaces the read-only bookie with an ensemble change, every
  entry reads back, and new ledgers never choose it; once writable again it is chosen again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import metadata
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.admin_http import get_json, post_json
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

from .wire import WireClient, known_ledgers

pytestmark = pytest.mark.etcd

HUGE = str(1 << 60)  # more free bytes than any test machine has
CONFIG = ClientConfig(add_timeout_s=5.0, read_timeout_s=5.0, reconnect_backoff_max_s=0.5)


async def _bookies(url: str) -> metadata.BookieSet:
    async with metadata.connect(url) as conn:
        return await metadata.list_bookies(conn.store, conn.root)


async def _wait_for(url: str, check: Callable[[metadata.BookieSet], bool], timeout_s: float = 10.0) -> None:
    """Poll the registration sets until ``check`` holds (the bookie moves itself asynchronously)."""
    async with asyncio.timeout(timeout_s):
        while True:
            if check(await _bookies(url)):
                return
            await asyncio.sleep(0.05)


@pytest.fixture
async def cluster_url(etcd_server: EtcdCluster) -> str:
    url = etcd_server.url(f"/bookkeeper/ro-{uuid.uuid4().hex[:8]}")
    async with metadata.connect(url) as conn:
        await metadata.init_cluster(conn.store, conn.root)
    return url


@pytest.fixture
def procs() -> Iterator[list[BookieProcess]]:
    started: list[BookieProcess] = []
    yield started
    for proc in started:
        proc.cleanup()


def _bookie(tmp_path: Path, url: str, bookie_id: str, *extra: str) -> BookieProcess:
    args = ["--metadata", url, "--admin-port", "0", "--disk-check-interval-s", "0.1", *extra]
    return BookieProcess(tmp_path / bookie_id, bookie_id, extra_args=args)


async def test_starts_read_only__readonly_registration_ereadonly_recovery_adds_ok(
    cluster_url: str, tmp_path: Path, procs: list[BookieProcess]
) -> None:
    proc = _bookie(
        tmp_path, cluster_url, "full", "--disk-free-bytes-min", HUGE, "--disk-free-bytes-writable", HUGE
    )
    procs.append(proc)
    proc.start()
    found = await _bookies(cluster_url)
    assert "full" in found.readonly
    assert "full" not in found.writable
    await known_ledgers(cluster_url, 7)
    client = await WireClient.connect(*proc.address)
    try:
        refused = await client.add(7, 0, b"normal")
        assert refused.status == StatusCode.EREADONLY
        assert "disk_free_bytes_min" in refused.message
        assert (await client.add(7, 0, b"recovery", recovery=True)).status == StatusCode.EOK
        assert (await client.read(7, 0)).status == StatusCode.EOK
        assert (await client.fence(7)).status == StatusCode.EOK
        info = await client.request(m.GetBookieInfoRequest)
        assert info.info["state"] == "readonly"
        assert "disk_free_bytes_min" in info.info["read_only_reason"]
    finally:
        client.close()
    status, state = await get_json(*proc.admin_address(), "/state")
    assert status == 200
    assert state["state"] == "read_only"
    assert state["read_only"]["mode"] == "readonly"
    assert state["read_only"]["registered_read_only"] is True
    assert state["errors"] == {"EREADONLY": 1}
    assert proc.stop() == 0
    assert "full" not in (await _bookies(cluster_url)).readonly  # deregistered from readonly/ too


async def test_admin_toggle__registration_moves_and_comes_back(
    cluster_url: str, tmp_path: Path, procs: list[BookieProcess]
) -> None:
    proc = _bookie(tmp_path, cluster_url, "toggle")
    procs.append(proc)
    proc.start()
    admin = proc.admin_address()
    await _wait_for(cluster_url, lambda s: "toggle" in s.writable)
    status, answer = await post_json(*admin, "/readonly?set=1", proc.admin_token())
    assert status == 200
    assert answer["mode"] == "readonly"
    assert answer["manual"] is True
    await _wait_for(cluster_url, lambda s: "toggle" in s.readonly and "toggle" not in s.writable)
    await known_ledgers(cluster_url, 1)
    client = await WireClient.connect(*proc.address)
    try:
        refused = await client.add(1, 0, b"x")
        assert refused.status == StatusCode.EREADONLY
        assert "operator" in refused.message
        await asyncio.sleep(0.3)  # several disk checks with plenty of room: manual read-only sticks
        assert (await client.add(1, 0, b"x")).status == StatusCode.EREADONLY
        status, answer = await post_json(*admin, "/readonly?set=0", proc.admin_token())
        assert answer["mode"] == "writable"
        await _wait_for(cluster_url, lambda s: "toggle" in s.writable and "toggle" not in s.readonly)
        assert (await client.add(1, 0, b"x")).status == StatusCode.EOK
    finally:
        client.close()
    _, state = await get_json(*admin, "/state")
    assert state["read_only"]["transitions"] == 2


async def test_client_replaces_the_read_only_bookie_and_new_ledgers_avoid_it(
    cluster_url: str, tmp_path: Path, procs: list[BookieProcess]
) -> None:
    for i in range(4):
        procs.append(_bookie(tmp_path, cluster_url, f"b{i}"))
        procs[-1].start()
    await _wait_for(cluster_url, lambda s: len(s.writable) == 4)
    async with BookKeeper.connect(cluster_url, config=CONFIG) as bk:
        lh = await bk.create_ledger(3, 3, 2, password=b"pw")
        ensemble = lh.metadata.current_ensemble
        victim = ensemble[0]
        payloads = [b"entry-%d" % i for i in range(400)]
        for payload in payloads[:200]:
            await lh.append(payload)
        proc = next(p for p in procs if p.bookie_id == victim)
        status, _ = await post_json(*proc.admin_address(), "/readonly?set=1", proc.admin_token())
        assert status == 200
        await _wait_for(cluster_url, lambda s: victim in s.readonly)
        for payload in payloads[200:]:
            await lh.append(payload)
        assert lh.ensemble_changes >= 1
        assert victim not in lh.metadata.current_ensemble
        await lh.close()
        rh = await bk.open_ledger(lh.id, password=b"pw")
        read = [entry.payload async for entry in rh.read()]
        assert read == payloads
        for _ in range(10):
            new = await bk.create_ledger(3, 2, 2, password=b"pw")
            assert victim not in new.metadata.current_ensemble
            await new.append(b"x")
            await new.close()
        status, _ = await post_json(*proc.admin_address(), "/readonly?set=0", proc.admin_token())
        assert status == 200
        await _wait_for(cluster_url, lambda s: victim in s.writable)
        chosen = set()
        for _ in range(3):  # with 4 writable bookies and E=4 every one is chosen
            back = await bk.create_ledger(4, 2, 2, password=b"pw")
            chosen.update(back.metadata.current_ensemble)
            await back.append(b"y")
            await back.close()
        assert victim in chosen
