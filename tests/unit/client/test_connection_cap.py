"""The client's own cap on requests pending to one bookie (``connection_pending_max``) is
backpressure, not a bookie failure: ledgers that share healthy bookies and together exceed it are
neither moved off them (ensemble changes) nor failed (seed 001: an ensemble replaces a bookie that
failed to write; here nothing was sent)."""

from __future__ import annotations

import asyncio
import dataclasses

from bookkeeper_aio.client.add_pipeline import HandleState
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from metadata.ledger_manager import LedgerManager
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.client.conftest import FAST, make_client


async def test_ledgers_over_the_connection_cap_wait_for_room_and_change_no_ensemble(
    ledgers: LedgerManager, cluster: FakeCluster, directory: StaticDirectory
) -> None:
    for bookie_id in cluster.ids:  # healthy, busy: each add answered after 20 ms
        cluster.by_id(bookie_id).script = lambda request: (
            Reply.delay(0.02) if isinstance(request, m.AddEntryRequest) else None
        )
    config = dataclasses.replace(FAST, add_window_max=60, connection_pending_max=100)
    bk = make_client(ledgers, directory, config)
    try:
        handles = [await bk.create_ledger(3, 3, 2) for _ in range(3)]  # 3 x 60 > 100 per bookie

        async def write(handle) -> list[int]:  # type: ignore[no-untyped-def]
            futures = [await handle.append_async(b"x") for _ in range(300)]
            return list(await asyncio.gather(*futures))

        results = await asyncio.wait_for(asyncio.gather(*(write(h) for h in handles)), 30)
        assert all(entry_ids == list(range(300)) for entry_ids in results)
        assert [h.ensemble_changes for h in handles] == [0, 0, 0]
        assert {h.state for h in handles} == {HandleState.WRITABLE}
    finally:
        await bk.close()
