"""`bkaio decommission` forgets what metadata kept of the bookie: its cookie and the auditor's
record of its data dir instance (``R/replication/instances/<bookie>``), which nothing deleted
before and which would otherwise outlive every retired bookie."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import metadata
from metadata.underreplication import UnderReplicationManager
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd


async def test_decommission_deletes_the_instance_record_with_the_cookie(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/df-{uuid.uuid4().hex[:8]}")
    async with metadata.connect(url) as meta:
        await metadata.ensure_cluster(meta.store, meta.root)
    extra = ["--admin-port", "0", "--metadata", url]
    with BookieProcess(tmp_path / "b1", "bookie-1", extra_args=extra) as bookie:
        bookie.start()
        async with metadata.connect(url) as meta:
            urm = UnderReplicationManager(meta.store, meta.root)
            registered = (await metadata.list_bookies(meta.store, meta.root)).writable["bookie-1"]
            instance = registered.attributes["instance_id"]
            assert await urm.record_instance("bookie-1", instance, None)  # as the auditor does
            cookie = await metadata.read_cookie(meta.store, meta.root, "bookie-1")
            assert cookie is not None
            assert cookie[0].instance_id == instance
        admin = "{}:{}".format(*bookie.admin_address())
        env = {**os.environ, "BKAIO_HOME": str(tmp_path / "home")}
        command = [
            sys.executable, "-m", "bookkeeper_aio.cli.main", "decommission", "bookie-1",
            "--metadata", url, "--admin", admin, "--timeout", "30",
            "--admin-token-file", str(tmp_path / "b1" / "admin.token"),
        ]  # fmt: skip
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert done.returncode == 0, done.stderr
        async with metadata.connect(url) as meta:
            urm = UnderReplicationManager(meta.store, meta.root)
            assert await metadata.read_cookie(meta.store, meta.root, "bookie-1") is None
            assert await urm.seen_instance("bookie-1") is None
            assert await urm.decommissioning() == set()
