"""The add window holds at most ``add_window_max`` adds in flight, whoever wakes whom; and every
waiter for a handle's adds (``wait_for_adds``, ``close``) returns once they are done."""

from __future__ import annotations

import asyncio
import dataclasses

from bookkeeper_aio.protocol import messages as m
from tests.harness.fake_bookie import Reply
from tests.unit.client.conftest import FAST
from tests.unit.log.fakes import World, world


def _hold_entries(w: World, gates: dict[int, asyncio.Event]) -> None:
    def script(request: object) -> Reply | None:
        if isinstance(request, m.AddEntryRequest) and request.entry_id in gates:
            return Reply.hold(gates[request.entry_id])
        return None

    for bookie in w.cluster.bookies:
        bookie.script = script


async def test_a_woken_slot_waiter_does_not_wake_one_more_than_the_window() -> None:
    async with world(dataclasses.replace(FAST, add_window_max=2), clients=1) as w:
        (bk,) = w.clients
        gates = {0: asyncio.Event(), 1: asyncio.Event()}
        _hold_entries(w, gates)
        handle = await bk.create_ledger(3, 2, 2)
        appends = [asyncio.ensure_future(handle.append(b"e%d" % i)) for i in range(4)]
        for _ in range(20):
            await asyncio.sleep(0)
        assert handle.pending_adds == 2
        gates[0].set()  # one slot frees: one waiter takes it, and wakes no other
        peak = 0
        for _ in range(200):
            peak = max(peak, handle.pending_adds)
            if appends[0].done() and handle.pending_adds == 2:
                break
            await asyncio.sleep(0.001)
        for _ in range(20):
            await asyncio.sleep(0)
            peak = max(peak, handle.pending_adds)
        assert peak <= 2, f"{peak} adds in flight with a window of 2"
        gates[1].set()
        assert await asyncio.gather(*appends) == [0, 1, 2, 3]
        await handle.close()


async def test_wait_for_adds_beside_close_both_return() -> None:
    async with world(clients=1) as w:
        (bk,) = w.clients
        gate = asyncio.Event()
        _hold_entries(w, {0: gate})
        handle = await bk.create_ledger(3, 2, 2)
        added = await handle.append_async(b"e0")
        waiter = asyncio.ensure_future(handle.wait_for_adds())
        await asyncio.sleep(0)
        closer = asyncio.ensure_future(handle.close())
        await asyncio.sleep(0)
        gate.set()
        assert await added == 0
        await asyncio.wait_for(closer, 5)
        await asyncio.wait_for(waiter, 5)  # the first of two drain waiters was never woken
