"""The clock seam: every reading of monotonic time outside an event loop goes through a `Clock`.

Code that runs on an event loop reads ``loop.time()`` and schedules with ``loop.call_later``: a
simulated loop replaces both at once. Code that also runs off the loop (the journal's writer
thread, storage thread pools) or before one exists takes a `Clock` argument, `SYSTEM_CLOCK` by
default. Production pays one attribute load per reading; a deterministic simulation passes a
`ManualClock` it advances itself.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (only differences are meaningful)."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch, for times that are shown or recorded (a report's start and
        end), never for measuring intervals."""
        ...


class _SystemClock:
    __slots__ = ()

    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)


SYSTEM_CLOCK: Clock = _SystemClock()


class ManualClock:
    """A clock that moves only when told to: for tests and the simulator."""

    __slots__ = ("_now_s", "_wall_offset_s")

    def __init__(self, start_s: float = 0.0, wall_start_s: float = 0.0) -> None:
        self._now_s = start_s
        self._wall_offset_s = wall_start_s - start_s

    def monotonic(self) -> float:
        return self._now_s

    def wall(self) -> float:
        """``wall_start_s`` plus the time advanced since."""
        return self._now_s + self._wall_offset_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self._now_s += seconds
