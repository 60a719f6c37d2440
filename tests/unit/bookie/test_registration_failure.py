"""A bookie whose metadata registration ended for good says so: /ready false, /health a problem."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bookie.config import BookieConfig
from bookie.registration import MetadataRegistration
from bookie.server import BookieServer
from metadata import MetadataConnection
from metadata.bookies import BookieRegistration, list_bookies
from metadata.cluster import init_cluster
from metadata.memory import MemoryStore
from tests.harness.admin_http import get_json

ROOT = "/reg-failure"


async def test_a_registration_that_ended_makes_the_bookie_not_ready_and_unhealthy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore()
    await init_cluster(store, ROOT)
    ended = asyncio.Event()

    async def dies(self: BookieRegistration) -> None:
        await ended.wait()
        raise RuntimeError("keepalive bug")  # what the safety net cannot catch: the task is over

    monkeypatch.setattr(BookieRegistration, "_keepalive_loop", dies)
    config = BookieConfig(
        data_dir=str(tmp_path / "data"), bookie_id="b1", port=0, admin_port=0, registration_ttl_s=5
    ).validate()
    registration = MetadataRegistration(f"memory://{ROOT}", connection=MetadataConnection(store, ROOT))
    server = BookieServer(config, registration)
    await server.start()
    try:
        assert server.admin is not None
        assert server.admin.address is not None
        host, port = server.admin.address
        status, body = await get_json(host, port, "/ready")
        assert (status, body["ready"]) == (200, True)
        assert "b1" in (await list_bookies(store, ROOT)).writable
        ended.set()
        await asyncio.sleep(0.05)
        assert registration.failure is not None
        status, body = await get_json(host, port, "/ready")
        assert (status, body["ready"]) == (503, False)
        status, body = await get_json(host, port, "/health")
        assert status == 503
        assert any("registration ended" in problem and "restart" in problem for problem in body["problems"])
        state = server.snapshot()
        assert state.registration_failed is not None
        assert "keepalive bug" in state.registration_failed
    finally:
        await server.close()
