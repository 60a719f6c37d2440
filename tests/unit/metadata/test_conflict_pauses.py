"""The metadata retry loops pause (growing, jittered) after losing a CAS race."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from metadata.errors import BadVersion
from metadata.idgen import IdGenerator
from metadata.memory import MemoryStore
from metadata.underreplication import UnderReplicationManager


class _LosingStore(MemoryStore):
    """Every conditional write loses ``losses`` times in a row (another writer won), then works."""

    def __init__(self, losses: int) -> None:
        super().__init__()
        self.losses = losses

    def _lose(self, key: str) -> None:
        if self.losses:
            self.losses -= 1
            raise BadVersion(key, 0, 1)

    async def compare_and_set(self, key: str, value: bytes, expected_version: int, **kwargs: Any) -> int:
        self._lose(key)
        return await super().compare_and_set(key, value, expected_version, **kwargs)

    async def create(self, key: str, value: bytes, *, lease_id: int = 0) -> int:
        self._lose(key)
        return await super().create(key, value, lease_id=lease_id)


async def test_retry_loops_pause_growing_and_jittered_after_a_lost_race(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the id claim and the mark loops retry after a lost CAS race: not at once (contenders would
    # retry in lockstep, and a lost answer on a slow store would be re-sent in a hot loop)
    pauses: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, result: Any = None) -> Any:
        if delay > 0:
            pauses.append(delay)
        return await real_sleep(delay, result)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    store = _LosingStore(losses=4)
    assert await IdGenerator(store, "/r/idgen").next_id() == 1
    assert len(pauses) == 4
    assert all(0 < p <= 0.05 for p in pauses)
    pauses.clear()
    store.losses = 3
    await UnderReplicationManager(store, "/r").mark(7, ["b1"], reason="lost")
    assert len(pauses) == 3
