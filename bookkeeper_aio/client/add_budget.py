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
- A refused or cancelled waiter stays in the queue, done, until a release skips it: removing it
  from the middle costs the queue's length (100,000 ledgers closing with a waiter each: quadratic).
  ``waiting`` counts only the live ones, and the queue is dropped whole once none is live.
"""

from __future__ import annotations

import asyncio
import collections


class AddBudget:
    """Permits for adds in flight across one client's ledger handles."""

    __slots__ = ("_live", "_waiters", "in_flight", "limit", "open_limit")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"adds in flight must be > 0, got {limit}")
        self.limit = limit
        self.in_flight = 0
        """Permits taken (by adds in flight, and by waiters woken but not yet run)."""
        self._waiters: collections.deque[asyncio.Future[bool]] = collections.deque()
        self._live = 0  # waiters in the queue not done yet
        self.open_limit = limit
        """``limit`` while nobody waits, 0 while anyone does: an append may take a permit without
        waiting iff ``in_flight < open_limit`` (:meth:`free`, as one comparison on the add path)."""

    @property
    def waiting(self) -> int:
        """Appends waiting for a permit."""
        return self._live

    def free(self) -> bool:
        """Whether an append may take a permit now without waiting."""
        return self.in_flight < self.open_limit

    def release(self, count: int) -> None:
        """``count`` adds left flight: their permits go to the oldest waiters first."""
        self.in_flight -= count
        assert self.in_flight >= 0, "more permits released than taken"
        waiters = self._waiters
        # ``waiters`` may run out before ``_live`` does: a waiter cancelled in this loop turn is
        # done at once but leaves the count only when its ``wait`` runs again (``_left``).
        while self._live and waiters and self.in_flight < self.limit:
            waiter = waiters.popleft()
            if not waiter.done():
                self._live -= 1
                self.in_flight += 1
                waiter.set_result(True)
        if not self._live:
            self.open_limit = self.limit

    async def wait(self, waiter: asyncio.Future[bool]) -> bool:
        """Queue ``waiter`` and wait until it holds a permit (True) or is refused (False). The
        caller makes the future (so it can refuse it: see the module doc). Cancelled after being
        given a permit: the permit goes back."""
        self._waiters.append(waiter)
        self._live += 1
        self.open_limit = 0
        try:
            return await waiter
        except asyncio.CancelledError:
            if not waiter.done() or waiter.cancelled():  # still queued: left there, done
                waiter.cancel()
                self._left()
            elif waiter.result():
                self.release(1)
            raise

    def refuse(self, waiter: asyncio.Future[bool]) -> None:
        """Wake ``waiter`` without a permit (its ledger failed or closed while it waited)."""
        if not waiter.done():
            waiter.set_result(False)
            self._left()

    def _left(self) -> None:
        """A queued waiter is done without a permit."""
        self._live -= 1
        if not self._live:
            self._waiters.clear()  # only done ones are left
            self.open_limit = self.limit
