"""Waiting for a condition in autorecovery tests (bounded: a condition never reached fails)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = predicate()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
