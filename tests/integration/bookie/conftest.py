"""Fixtures for bookie integration tests: a running bookie process per test, and a client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.harness.bookie_proc import BookieProcess

from .wire import WireClient


@pytest.fixture
def bookie(tmp_path: Path) -> Iterator[BookieProcess]:
    proc = BookieProcess(
        tmp_path / "bookie", bookie_id="bookie-1", extra_args=["--frame-read-timeout-s", "1.5"]
    )
    proc.start()
    yield proc
    proc.cleanup()


@pytest.fixture
async def client(bookie: BookieProcess) -> AsyncIterator[WireClient]:
    wire = await WireClient.connect(*bookie.address)
    yield wire
    wire.close()
