"""Commands that take a bookie id refuse one the cluster has no trace of (a typo must not succeed
silently), and ``bkaio bookie format`` refuses a bookie that is registered or still named by a
ledger unless ``--force``. A real etcd; the bookie's traces are written to it directly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import pytest

import metadata
from metadata.keys import ClusterKeys
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd


async def _setup(url: str) -> None:
    """b-cookie: only a cookie (a stopped, empty bookie); b-ledger: a cookie and a ledger naming it;
    b-live: a cookie and a registration."""
    async with metadata.connect(url) as meta:
        info = await metadata.init_cluster(meta.store, meta.root)
        for bookie_id in ("b-cookie", "b-ledger", "b-live"):
            cookie = metadata.Cookie(bookie_id, info.instance_id, ("/j",), ("/l",))
            await metadata.write_cookie(meta.store, meta.root, cookie, None)
        await meta.ledger_manager().create(["b-ledger"], write_quorum=1, ack_quorum=1)
        await meta.store.put(ClusterKeys(meta.root).bookie("writable", "b-live"), b"{}")


async def _cookie(url: str, bookie_id: str) -> bool:
    async with metadata.connect(url) as meta:
        return await metadata.read_cookie(meta.store, meta.root, bookie_id) is not None


def _bkaio(url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bookkeeper_aio.cli.main", *argv, "--metadata", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_bookie_id_typo_is_an_error_and_format_refuses_a_bookie_in_use(etcd_server: EtcdCluster) -> None:
    url = etcd_server.url(f"/bookkeeper/ids-{uuid.uuid4().hex[:8]}")
    asyncio.run(_setup(url))

    for argv in (["recover", "nosuch"], ["decommission", "nosuch"], ["bookie", "format", "nosuch"]):
        done = _bkaio(url, *argv)
        assert done.returncode == 1, (argv, done.stdout, done.stderr)
        assert "no bookie 'nosuch' in this cluster" in done.stderr, (argv, done.stderr)
        assert "bkaio bookies" in done.stderr

    live = _bkaio(url, "bookie", "format", "b-live")
    assert live.returncode == 1, live.stdout
    assert "b-live is in use: it is registered" in live.stderr
    assert "bkaio decommission b-live" in live.stderr
    named = _bkaio(url, "bookie", "format", "b-ledger")
    assert named.returncode == 1, named.stdout
    assert "ledgers name it (" in named.stderr
    assert asyncio.run(_cookie(url, "b-live"))
    assert asyncio.run(_cookie(url, "b-ledger"))  # nothing deleted by a refusal

    idle = _bkaio(url, "bookie", "format", "b-cookie", "--json")
    assert idle.returncode == 0, idle.stderr
    assert json.loads(idle.stdout)["metadata_cookie_deleted"] is True
    forced = _bkaio(url, "bookie", "format", "b-ledger", "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert json.loads(forced.stdout)["metadata_cookie_deleted"] is True
    assert not asyncio.run(_cookie(url, "b-ledger"))
