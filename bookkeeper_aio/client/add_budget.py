"""The client-wide budget of adds in flight: backpressure in the client, not in the bookies' queues.

Every add holds one permit from the moment it is handed to the bookies (``_start_add``) until it
completes or fails. Beyond ``adds_in_flight_max`` an append waits in the client for a permit, in
the order the appends asked (one FIFO for every ledger of the client). Why: an add's timeout runs
from when the kernel took its bytes, so a backlog sent all at once (100,000 ledgers of one add
each) waits in the bookies' queues and times out there although no bookie is stuck. With the
budget, what the bookies hold at once is bounded (5,000 adds at the default: a bookie must do only
1,000 adds/s for all of them to answer within the default 5 s timeout), and a wait for a permit
never counts against an add's timeout; a bookie that does not answer still times out, as before.
Apache BookKeeper's client bounds the same thing with its ``throttle`` setting (historically 5,000
permits per ledger handle, taken before an add is initiated; its add timeout starts at initiation).

Rules:

- ``take`` is the fast path (a free permit and nobody waiting: no barging past a waiter).
- ``release(n)`` gives ``n`` permits back and hands each freed permit to the oldest waiter at once
  (counted as taken before the waiter runs, so a fast-path append cannot steal it). Hence the
  invariant: while anyone waits, every permit is taken (no waiter is left behind a free permit).
- A waiter's future resolves True with a permit, False without one (:meth:`refuse`: its ledger
  failed or closed, it re-checks and raises). A woken waiter that is cancelled gives its permit
  back.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib


class AddBudget:
    """Permits for adds in flight across one client's ledger handles."""

    __slots__ = ("_waiters", "in_flight", "limit")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"adds in flight must be > 0, got {limit}")
        self.limit = limit
        self.in_flight = 0
        """Permits taken (by adds in flight, and by waiters woken but not yet run)."""
        self._waiters: collections.deque[asyncio.Future[bool]] = collections.deque()

    @property
    def waiting(self) -> int:
        """Appends waiting for a permit."""
        return len(self._waiters)

    def free(self) -> bool:
        """Whether an append may take a permit now without waiting."""
        return self.in_flight < self.limit and not self._waiters

    def release(self, count: int) -> None:
        """``count`` adds left flight: their permits go to the oldest waiters first."""
        self.in_flight -= count
        assert self.in_flight >= 0, "more permits released than taken"
        waiters = self._waiters
        while waiters and self.in_flight < self.limit:
            waiter = waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(True)

    async def wait(self, waiter: asyncio.Future[bool]) -> bool:
        """Queue ``waiter`` and wait until it holds a permit (True) or is refused (False). The
        caller makes the future (so it can refuse it: see the module doc). Cancelled after being
        given a permit: the permit goes back."""
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.release(1)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def refuse(self, waiter: asyncio.Future[bool]) -> None:
        """Wake ``waiter`` without a permit and take it out of the queue (rare: its ledger failed
        or closed while it waited)."""
        if not waiter.done():
            waiter.set_result(False)
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
