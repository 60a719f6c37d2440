"""Many coarse deadlines on one event-loop timer: the explicit-LAC checks of every open ledger.

A client may hold 100,000 open ledgers, each re-arming its explicit-LAC check after its adds
complete. One ``loop.call_later`` each is a timer handle (a GC-tracked object, a libuv timer in
uvloop) made and dropped per completion: at 100,000 ledgers, a fifth of the client's CPU went there
(docs/benchmarks.md). Here a deadline is an entry in the list of its tick (``tick_s`` wide); one
loop timer runs at the earliest tick that holds any, calls what is due, and sleeps again.

Rules:

- A callback runs no earlier than its delay, and at most one tick later (ticks are rounded up).
- Callbacks due at the same tick run in the order they were scheduled; one that raises is logged
  by the loop's exception handler like any timer callback, the others still run.
- No cancel: a caller that stops wanting its callback makes it a no-op (the ledger handle checks its
  own state). The wheel holds the callback, hence its object, until the tick.
- Nothing runs while the wheel is empty: the loop timer is only armed while a deadline waits.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable


class TimerWheel:
    """Deadlines rounded up to ``tick_s``; one loop timer for all of them."""

    __slots__ = ("_handle", "_handle_tick", "_loop", "_slots", "_tick_s", "_ticks")

    def __init__(self, tick_s: float = 0.01) -> None:
        if not tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s}")
        self._tick_s = tick_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: dict[int, list[Callable[[], object]]] = {}
        self._ticks: list[int] = []  # a heap of the keys of _slots
        self._handle: asyncio.TimerHandle | None = None
        self._handle_tick = 0

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once, ``delay_s`` from now (up to one tick later)."""
        loop = self._loop
        if loop is None or self._handle is None:  # idle: the loop may be another one now
            loop = self._loop = asyncio.get_running_loop()
        tick = math.ceil((loop.time() + delay_s) / self._tick_s)
        slot = self._slots.get(tick)
        if slot is not None:
            slot.append(callback)
            return
        self._slots[tick] = [callback]
        heapq.heappush(self._ticks, tick)
        if self._handle is None or tick < self._handle_tick:
            self._arm(tick)

    def __len__(self) -> int:
        """Callbacks waiting."""
        return sum(len(slot) for slot in self._slots.values())

    def close(self) -> None:
        """Drop every waiting callback (the client closes)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._slots.clear()
        self._ticks.clear()

    def _arm(self, tick: int) -> None:
        assert self._loop is not None
        if self._handle is not None:
            self._handle.cancel()
        self._handle_tick = tick
        self._handle = self._loop.call_at(tick * self._tick_s, self._run_due)

    def _run_due(self) -> None:
        self._handle = None
        assert self._loop is not None
        # The loop may run a timer a hair before its time: whatever its tick rounds to is due.
        now_tick = max(self._handle_tick, math.floor(self._loop.time() / self._tick_s))
        ticks, slots = self._ticks, self._slots
        due: list[Callable[[], object]] = []
        while ticks and ticks[0] <= now_tick:
            due.extend(slots.pop(heapq.heappop(ticks)))
        if ticks:
            self._arm(ticks[0])
        for callback in due:
            try:
                callback()
            except Exception as error:  # noqa: BLE001 (one failing callback must not starve the rest)
                self._loop.call_exception_handler(
                    {"message": "timer wheel callback failed", "exception": error, "callback": callback}
                )
