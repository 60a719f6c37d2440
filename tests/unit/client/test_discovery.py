"""``BookKeeper.connect()`` without a URL: ``$BKAIO_METADATA``, else the running sandbox's state
file, else a clear ``NoClusterFound`` (the lookup ``bkaio`` shares, bookkeeper_aio.client.discovery)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bookkeeper_aio import BKError, BKInterfaceError, BookKeeper, NoClusterFound
from bookkeeper_aio.client import discovery


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BKAIO_HOME", str(tmp_path))
    monkeypatch.delenv(discovery.METADATA_ENV, raising=False)
    return tmp_path


async def test_connect_without_url_and_nothing_configured_says_how_to_give_one(home: Path) -> None:
    with pytest.raises(NoClusterFound) as caught:
        async with BookKeeper.connect():
            pass
    message = str(caught.value)
    assert message == (
        "no cluster given: pass a metadata URL, set BKAIO_METADATA, or start the sandbox with `make run`"
    )
    assert isinstance(caught.value, BKInterfaceError)
    assert isinstance(caught.value, BKError)


async def test_connect_without_url_uses_bkaio_metadata(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(discovery.METADATA_ENV, "memory:///bookkeeper/env")
    async with BookKeeper.connect() as bk:
        assert [i async for i in bk.list_ledgers()] == []


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def test_connect_without_url_refuses_a_stale_sandbox_state(home: Path, dead_pid: int) -> None:
    (home / "sandbox.json").write_text(json.dumps({"metadata_url": "etcd://127.0.0.1:1/x", "pid": dead_pid}))
    with pytest.raises(discovery.SandboxNotRunning, match=rf"not running \(stale state from pid {dead_pid} "):
        await BookKeeper.connect()


def test_lookup_order_explicit_then_env_then_state(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "sandbox.json").write_text(json.dumps({"metadata_url": "etcd://s:1/sandbox", "pid": os.getpid()}))
    monkeypatch.setattr(discovery, "sandbox_alive", lambda pid: pid == os.getpid())
    assert discovery.find_metadata_url() == "etcd://s:1/sandbox"
    monkeypatch.setenv(discovery.METADATA_ENV, "etcd://e:1/env")
    assert discovery.find_metadata_url() == "etcd://e:1/env"
    assert discovery.find_metadata_url("etcd://x:1/explicit") == "etcd://x:1/explicit"
