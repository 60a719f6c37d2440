"""Claiming a bookie id in metadata, with real bookie processes and a real etcd:

- a bookie that cannot bind its port refuses before it writes the metadata cookie, so a retry on a
  fresh data dir under the same id starts;
- a bookie restarted after kill -9 takes over its own stale registration at once instead of waiting
  for the dead process's lease (default TTL, 10 s) to expire;
- a bookie with the same id and another data dir, or a copy of the live one's data dir, is refused.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
import uuid
from pathlib import Path

import metadata
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

EXIT_REFUSED = 3
TTL_S = 10  # the default registration_ttl_s: what a restart used to wait for
RESTART_BOUND_S = 4.0  # process start + recovery + registration, on a loaded 2-core machine


async def _init(url: str) -> None:
    async with metadata.connect(url) as conn:
        await metadata.init_cluster(conn.store, conn.root)


async def _registration(url: str, bookie_id: str) -> tuple[metadata.BookieInfo | None, int]:
    """The bookie's writable registration and the lease it is bound to (0: absent)."""
    async with metadata.connect(url) as conn:
        key = metadata.ClusterKeys(conn.root).bookie("writable", bookie_id)
        current = await conn.store.get(key)
        if current is None:
            return None, 0
        return metadata.BookieInfo.decode(key, current.value), current.lease_id


async def _cookie(url: str, bookie_id: str) -> metadata.Cookie | None:
    async with metadata.connect(url) as conn:
        stored = await metadata.read_cookie(conn.store, conn.root, bookie_id)
        return None if stored is None else stored[0]


def _cluster(etcd: EtcdCluster, name: str) -> str:
    url = etcd.url(f"/bookkeeper/{name}-{uuid.uuid4().hex[:8]}")
    asyncio.run(_init(url))
    return url


def test_port_in_use_refuses_before_claiming_the_id(etcd_server: EtcdCluster, tmp_path: Path) -> None:
    url = _cluster(etcd_server, "bind")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        first = BookieProcess(tmp_path / "first", "b-bind", port=taken, extra_args=["--metadata", url])
        assert first.start_expect_failure() == EXIT_REFUSED
    log = first.log_tail()
    assert f"cannot listen on 127.0.0.1:{taken}" in log
    assert "another --port" in log  # says what to do
    assert asyncio.run(_cookie(url, "b-bind")) is None  # the id was not claimed
    assert asyncio.run(_registration(url, "b-bind")) == (None, 0)
    # the retry: a fresh data dir, the same id, a free port
    with BookieProcess(tmp_path / "fresh", "b-bind", extra_args=["--metadata", url]) as retry:
        host, port = retry.start()
        info, lease = asyncio.run(_registration(url, "b-bind"))
        assert info is not None
        assert (info.host, info.port) == (host, port)
        assert lease != 0
        cookie = asyncio.run(_cookie(url, "b-bind"))
        assert cookie is not None
        assert cookie.ledger_dirs == (str(tmp_path / "fresh"),)


def test_restart_after_kill9_takes_over_its_own_registration(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = _cluster(etcd_server, "restart")
    args = ["--metadata", url, "--registration-ttl-s", str(TTL_S)]
    with BookieProcess(tmp_path / "b", "b-restart", extra_args=args) as bookie:
        bookie.start()
        _, first_lease = asyncio.run(_registration(url, "b-restart"))
        for new_port in (False, True):  # same port (the harness default), then another one
            bookie.kill()
            stale, stale_lease = asyncio.run(_registration(url, "b-restart"))
            assert stale is not None
            assert stale_lease != 0  # the dead process's key is still there, for up to TTL_S
            if new_port:
                bookie.port = 0
            started = time.monotonic()
            host, port = bookie.restart()  # READY is printed once registered
            elapsed_s = time.monotonic() - started
            info, lease = asyncio.run(_registration(url, "b-restart"))
            print(f"restart after kill -9 (new port: {new_port}): registered in {elapsed_s:.2f} s")
            assert info is not None
            assert (info.host, info.port) == (host, port)
            assert lease not in (0, stale_lease, first_lease)
            assert elapsed_s < RESTART_BOUND_S < TTL_S
            assert "bookie.previous_registration_replaced" in bookie.log_tail(60)
        assert bookie.stop() == 0


def test_a_bookie_with_the_same_id_is_still_refused(etcd_server: EtcdCluster, tmp_path: Path) -> None:
    url = _cluster(etcd_server, "impostor")
    original = BookieProcess(tmp_path / "orig", "b-same", extra_args=["--metadata", url])
    with original:
        original.start()
        original.kill()  # its registration is stale: an impostor must not take it over
        impostor = BookieProcess(tmp_path / "other", "b-same", extra_args=["--metadata", url])
        assert impostor.start_expect_failure() == EXIT_REFUSED  # another data dir: another cookie
        assert "bkaio bookie format b-same" in impostor.log_tail()
        original.restart()
        _, lease = asyncio.run(_registration(url, "b-same"))
        # A copy of the running bookie's data dir has the same cookie, but not the same lock: it is
        # not the previous incarnation, so it waits for the live lease (2 TTLs) and is refused.
        original_dir = tmp_path / "orig"
        copy_dir = tmp_path / "copy"
        shutil.copytree(original_dir, copy_dir, ignore=shutil.ignore_patterns("LOCK"))
        copy = BookieProcess(copy_dir, "b-same", extra_args=["--metadata", url, "--registration-ttl-s", "2"])
        assert copy.start_expect_failure() == EXIT_REFUSED
        log = copy.log_tail()
        assert f"is registered by the bookie at {original.host}:{original.port}" in log
        assert "another --bookie-id" in log
        assert "bookie.previous_registration_replaced" not in log
        info, still = asyncio.run(_registration(url, "b-same"))
        assert info is not None
        assert (info.host, info.port) == original.address
        assert still == lease  # untouched
        assert original.stop() == 0
