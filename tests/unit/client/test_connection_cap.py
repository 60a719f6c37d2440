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
from bookkeeper_aio.protocol.codes import StatusCode
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


async def test_an_add_the_cap_refused_during_an_ensemble_change_is_sent_once_the_change_ends(
    ledgers: LedgerManager, cluster: FakeCluster, directory: StaticDirectory
) -> None:
    """E2/Qw2/Qa2, a cap of 2 requests per bookie: X holds its answers (its connection stays full,
    so entry 2 is refused by the cap), Y fails entry 0 (an ensemble change, whose metadata write
    takes 50 ms). The refused entry's retry falls inside the change; the change's end must still
    send it to X, or the add waits forever (nothing pending anywhere: no timeout either)."""
    bk = make_client(
        ledgers, directory, dataclasses.replace(FAST, connection_pending_max=2, explicit_lac_interval_ms=0)
    )
    handle = await bk.create_ledger(2, 2, 2)
    try:
        write = ledgers.write

        async def slow_write(*args, **kwargs):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.05)
            return await write(*args, **kwargs)

        ledgers.write = slow_write  # type: ignore[method-assign]
        x, y = handle.metadata.current_ensemble
        hold = asyncio.Event()
        cluster.by_id(x).script = lambda r: Reply.hold(hold) if isinstance(r, m.AddEntryRequest) else None
        cluster.by_id(y).script = lambda r: (
            Reply.error(StatusCode.EIO) if isinstance(r, m.AddEntryRequest) and r.entry_id == 0 else None
        )
        futures = [await handle.append_async(b"e%d" % i) for i in range(3)]
        await asyncio.sleep(0.02)  # entry 2's retry (10 ms) came during the change
        hold.set()
        assert await asyncio.wait_for(asyncio.gather(*futures), 5) == [0, 1, 2]
        assert handle.ensemble_changes == 1
        assert y not in handle.metadata.current_ensemble
        await asyncio.wait_for(handle.close(), 5)
    finally:
        handle.abort()  # a regression fails fast here instead of waiting in close()
        await bk.close()
