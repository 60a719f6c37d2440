"""The log writer's CAS on the ledger list resolves a lost answer by reading the list back."""

from __future__ import annotations

import pytest

from bookkeeper_aio.log._common import cas_log as _cas
from bookkeeper_aio.log.position import LogPosition
from metadata import MemoryStore
from metadata.errors import CasResultUnknown
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogMetadata

ROOT = "/bookkeeper/test"


class LosingAnswers(LogManager):
    """Applies (or not) the CAS, then loses the answer ``losses`` times."""

    def __init__(self, *, apply: bool, losses: int = 1) -> None:
        super().__init__(MemoryStore(), ROOT)
        self.apply = apply
        self.losses = losses

    async def write(self, metadata: LogMetadata, expected_version: int) -> VersionedLog:
        if self.losses:
            self.losses -= 1
            if self.apply:
                await super().write(metadata, expected_version)
            raise CasResultUnknown(self.keys.log(metadata.name), "connection lost")
        return await super().write(metadata, expected_version)


async def test_applied_cas_is_recognised() -> None:
    manager = LosingAnswers(apply=True)
    start = await manager.create("orders")
    proposed = start.metadata.with_ledger_appended(5)
    result = await _cas(manager, proposed, start.version)
    assert result.metadata == proposed
    assert result == await manager.read("orders")


async def test_unapplied_cas_is_tried_again() -> None:
    manager = LosingAnswers(apply=False)
    start = await manager.create("orders")
    proposed = start.metadata.with_ledger_appended(5)
    assert (await _cas(manager, proposed, start.version)).metadata == proposed


async def test_list_moved_elsewhere_stays_unknown() -> None:
    manager = LosingAnswers(apply=False, losses=0)
    start = await manager.create("orders")
    await manager.write(start.metadata.with_ledger_appended(4), start.version)  # someone else
    manager.losses = 1
    with pytest.raises(CasResultUnknown):
        await _cas(manager, start.metadata.with_ledger_appended(5), start.version)


def test_positions_order_as_the_log() -> None:
    assert LogPosition(1, 9) < LogPosition(2, 0) < LogPosition(2, 1)
    assert sorted([LogPosition(3, 0), LogPosition(1, 5)]) == [LogPosition(1, 5), LogPosition(3, 0)]
