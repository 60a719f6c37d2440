"""`bkaio decommission` without the bookie's admin token stops before it records anything: the
bookie is not marked decommissioning (which would keep it out of every new ensemble) and stays
writable."""

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
from tests.harness.admin_http import get_json
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd


async def test_decommission_without_the_admin_token_records_nothing(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/dt-{uuid.uuid4().hex[:8]}")
    async with metadata.connect(url) as meta:
        await metadata.ensure_cluster(meta.store, meta.root)
    # registered in the cluster: decommission refuses an id the cluster has no trace of
    extra = ["--admin-port", "0", "--metadata", url]
    with BookieProcess(tmp_path / "b1", "bookie-1", extra_args=extra) as bookie:
        bookie.start()
        admin = "{}:{}".format(*bookie.admin_address())
        env = {k: v for k, v in os.environ.items() if k != "BKAIO_ADMIN_TOKEN_FILE"}
        env["BKAIO_HOME"] = str(tmp_path / "home")  # no sandbox whose token could be found
        command = [
            sys.executable, "-m", "bookkeeper_aio.cli.main", "decommission", "bookie-1",
            "--metadata", url, "--admin", admin, "--timeout", "10",
        ]  # fmt: skip
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert done.returncode != 0
        assert "--admin-token-file" in done.stderr, done.stderr
        async with metadata.connect(url) as meta:
            assert await UnderReplicationManager(meta.store, meta.root).decommissioning() == set()
        status, mode = await get_json(*bookie.admin_address(), "/readonly")
        assert (status, mode["mode"]) == (200, "writable")
