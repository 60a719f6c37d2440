"""Cancelling an append that waits for a window slot raises CancelledError (an ``asyncio.timeout``
around it raises TimeoutError), whatever else happened to its wait in the same loop turn."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.client.connection import ADD_OK
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.client.ledger import LedgerHandle
from metadata.ledger_manager import LedgerManager
from tests.unit.client.conftest import FAST, make_client


async def _full_window(
    ledgers: LedgerManager, directory: StaticDirectory
) -> tuple[BookKeeper, LedgerHandle, asyncio.Future[None]]:
    bk = make_client(ledgers, directory, dataclasses.replace(FAST, add_window_max=1))
    handle = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
    await handle.append_async(b"a")  # takes the only slot (its future stays pending: not acked)
    waiting = asyncio.ensure_future(handle.append(b"b"))
    await asyncio.sleep(0)  # parked for a slot
    assert len(handle._slot_waiters) == 1
    return bk, handle, waiting  # type: ignore[return-value]


async def test_cancelled_then_aborted_in_the_same_turn(
    ledgers: LedgerManager, directory: StaticDirectory
) -> None:
    bk, handle, waiting = await _full_window(ledgers, directory)
    try:
        waiting.cancel()
        handle.abort()  # the same turn, before the task runs: the waiters are released
        with pytest.raises(asyncio.CancelledError):
            await waiting
    finally:
        await bk.close()


async def test_cancelled_then_woken_in_the_same_turn(
    ledgers: LedgerManager, directory: StaticDirectory
) -> None:
    bk, handle, waiting = await _full_window(ledgers, directory)
    try:
        op = handle._pending[0]
        waiting.cancel()
        for bookie in op.write_set:  # entry 0's acks read in the same turn free the slot
            handle._on_add_result(op, bookie, ADD_OK)
        with pytest.raises(asyncio.CancelledError):
            await waiting
    finally:
        await bk.close()
