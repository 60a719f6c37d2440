"""Metadata failpoints: parsing, and their effect on the ledger manager (memory store)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bookkeeper_aio.common import failpoints
from metadata.errors import CasResultUnknown, MetadataUnavailable
from metadata.ledger_manager import LedgerManager
from metadata.ledger_metadata import LedgerState
from metadata.memory import MemoryStore


@pytest.fixture(autouse=True)
def reset_failpoints() -> Iterator[None]:
    yield
    failpoints.configure(None)


def test_every_name_is_taken_and_bad_specs_are_refused() -> None:
    failpoints.configure("journal.write=kill, metadata.cas_after=count:2:unknown")
    assert failpoints._active == {"journal.write": "kill", "metadata.cas_after": "count:2:unknown"}
    for bad in ("metadata.cas_after", "=kill", "journal.write=explode"):
        with pytest.raises(failpoints.FailpointError):
            failpoints.configure(bad)
    assert failpoints._active == {"journal.write": "kill", "metadata.cas_after": "count:2:unknown"}


async def test_cas_before_unavailable_applies_nothing() -> None:
    manager = LedgerManager(MemoryStore(), "/r")
    created = await manager.create(("a", "b"), write_quorum=2, ack_quorum=2)
    failpoints.configure("metadata.cas_before=unavailable")
    with pytest.raises(MetadataUnavailable):
        await manager.update(created.ledger_id, lambda md: md.in_recovery())
    failpoints.configure(None)
    assert (await manager.read(created.ledger_id)).metadata.state is LedgerState.OPEN


async def test_cas_after_unknown_applies_but_reports_unknown_on_the_second_write_only() -> None:
    manager = LedgerManager(MemoryStore(), "/r")
    created = await manager.create(("a", "b"), write_quorum=2, ack_quorum=2)
    failpoints.configure("metadata.cas_after=count:2:unknown")
    await manager.update(created.ledger_id, lambda md: md.with_custom_metadata({"n": b"1"}))
    with pytest.raises(CasResultUnknown):
        await manager.update(created.ledger_id, lambda md: md.in_recovery())
    assert (await manager.read(created.ledger_id)).metadata.state is LedgerState.IN_RECOVERY
