"""Found by the deterministic simulation (tests/simulation): recovery write-back's ``drain()`` spun
forever when its ensemble-change task had finished but the task's done callback (which clears it)
had not run yet. Awaiting a finished task does not yield to the loop, so the callback never ran and
the recovery hung at 100% CPU. It happens with plain asyncio ordering too: the change's last step
finishes the last entry (waking drain) and then the task itself, so drain's wake-up is queued
before the task's done callback."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from bookkeeper_aio.client.quorum import DistributionSchedule
from bookkeeper_aio.client.recovery_writeback import WriteBack


@pytest.mark.timeout(10, method="signal")  # the bug is a synchronous spin: only a signal ends it
async def test_drain__waits_for_a_finished_change_tasks_done_callback() -> None:
    write_back = WriteBack(cast(Any, None), 1, DistributionSchedule(3, 2, 2), ("a", "b", "c"), b"k", -1)
    loop = asyncio.get_running_loop()
    change = loop.create_task(asyncio.sleep(0))
    write_back._change_task = change
    change.add_done_callback(write_back._change_done)
    while not change.done():  # noqa: ASYNC110 (steps the loop until the task finished, its callback queued)
        await asyncio.sleep(0)
    assert write_back._change_task is change, "the done callback ran already: the race is not set up"
    await write_back.drain()  # in this task, at once: before the queued done callback
    assert write_back._change_task is None
