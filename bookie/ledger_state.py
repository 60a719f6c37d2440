"""Per-ledger state on a bookie: master key, fence bit, LAC, the index, long-poll waiters.

LAC = max(piggybacked LAC of durable entries, explicit LAC from WRITE_LAC). Long-poll readers wait
for the LAC to pass their ``previous_lac``; they are woken on advance, on fence, or at their timeout.
Waiters per ledger are bounded (:data:`LONG_POLL_WAITERS_PER_LEDGER_MAX`): each holds a timer and a
pending request, and a flood of tailers must get ETOOMANYREQUESTS, not unbounded memory.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from bookie.index import LedgerIndex

_NO_WAITERS: frozenset[Waiter] = frozenset()
"""The waiters of a ledger nobody waits on (most of them): shared, 216 bytes saved on each."""
LONG_POLL_WAITERS_PER_LEDGER_MAX = 1024
"""Tailing readers per ledger per bookie; BookKeeper deployments see a handful, 1024 is generous."""


class WakeReason(enum.Enum):
    ADVANCED = "advanced"
    FENCED = "fenced"
    TIMEOUT = "timeout"


class Waiter:
    """One long-poll read parked on a ledger; ``cancel()`` when its connection goes away."""

    __slots__ = ("_callback", "_ledger", "_timer", "previous_lac")

    def __init__(
        self, ledger: LedgerState, previous_lac: int, callback: Callable[[WakeReason], None]
    ) -> None:
        self._ledger: LedgerState | None = ledger
        self.previous_lac = previous_lac
        self._callback = callback
        self._timer: asyncio.TimerHandle | None = None

    def fire(self, reason: WakeReason) -> None:
        if self._ledger is None:
            return
        self._detach()
        self._callback(reason)

    def cancel(self) -> None:
        self._detach()

    def _detach(self) -> None:
        if self._ledger is not None:
            waiters = self._ledger.waiters
            if isinstance(waiters, set):  # always, while attached (add_waiter made it)
                waiters.discard(self)
            self._ledger = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class LedgerState:
    __slots__ = (
        "explicit_lac",
        "fence_durable",
        "fenced",
        "index",
        "key_verified",
        "lac_body",
        "ledger_id",
        "master_key",
        "piggyback_lac",
        "row",
        "waiters",
    )

    def __init__(self, ledger_id: int) -> None:
        self.ledger_id = ledger_id
        self.waiters: set[Waiter] | frozenset[Waiter] = _NO_WAITERS
        self.key_verified = False
        """The key was found to be the one metadata checks (in memory only): a mismatching key is
        then refused at once, without asking metadata again (bookie/ledger_keys.py)."""
        self._start(None)

    def _start(self, key: bytes | None) -> None:
        """The record of a ledger that holds nothing yet but its ``key``."""
        self.master_key = key
        self.fenced = False
        self.fence_durable = False
        self.piggyback_lac = -1
        self.explicit_lac = -1
        self.lac_body = b""
        self.index = LedgerIndex()
        self.row: bytes | None = None
        """This ledger's checkpoint row as last encoded (bookie/checkpoint.py), None once anything
        in it changed: every change below, and whoever changes the index, resets it."""

    @classmethod
    def restored(
        cls,
        ledger_id: int,
        key: bytes | None,
        fenced: bool,
        piggyback_lac: int,
        explicit_lac: int,
        lac_body: bytes,
        index: LedgerIndex,
    ) -> LedgerState:
        """The record as a checkpoint holds it (a fence there is durable)."""
        state = cls.__new__(cls)
        state.ledger_id = ledger_id
        state.waiters = _NO_WAITERS
        state.key_verified = False
        state.master_key = key
        state.fenced = state.fence_durable = fenced
        state.piggyback_lac = piggyback_lac
        state.explicit_lac = explicit_lac
        state.lac_body = lac_body
        state.index = index
        state.row = None
        return state

    @property
    def lac(self) -> int:
        return max(self.piggyback_lac, self.explicit_lac)

    def advance_piggyback(self, lac: int) -> None:
        # On every add: keep it to a compare and a store unless someone is waiting.
        if lac > self.piggyback_lac:
            self.piggyback_lac = lac  # the caller drops the checkpoint row (it changed the index too)
            if self.waiters:
                self._wake_advanced()

    def advance_explicit(self, lac: int, body: bytes) -> None:
        if lac > self.explicit_lac:
            self.explicit_lac = lac
            self.lac_body = body
            self.row = None
            if self.waiters:
                self._wake_advanced()

    def rekey(self, key: bytes) -> None:
        """Start the ledger's record anew under ``key``: what it held (a fence, entries, LACs) was
        recorded under a key metadata proves wrong, so no legitimate client wrote it. Waiters are
        answered (as at a timeout). Replay's way; a live bookie puts a new record in its place
        (:meth:`bookie.storage.Storage.rekey`)."""
        self._start(key)
        self.release_waiters()

    def release_waiters(self) -> None:
        """Answer every waiter as at a timeout (it reads the LAC again, from the current record)."""
        for waiter in list(self.waiters):
            waiter.fire(WakeReason.TIMEOUT)

    def set_fenced(self) -> None:
        """Fence in memory (adds are refused from now on) and wake every waiter."""
        self.fenced = True
        self.row = None
        for waiter in list(self.waiters):
            waiter.fire(WakeReason.FENCED)

    def _wake_advanced(self) -> None:
        lac = self.lac
        for waiter in list(self.waiters):
            if waiter.previous_lac < lac:
                waiter.fire(WakeReason.ADVANCED)

    def add_waiter(
        self,
        previous_lac: int,
        timeout_s: float,
        callback: Callable[[WakeReason], None],
        loop: asyncio.AbstractEventLoop,
    ) -> Waiter | None:
        """Park a long poll; None when this ledger already has the maximum number of waiters."""
        if len(self.waiters) >= LONG_POLL_WAITERS_PER_LEDGER_MAX:
            return None
        waiter = Waiter(self, previous_lac, callback)
        waiter._timer = loop.call_later(timeout_s, waiter.fire, WakeReason.TIMEOUT)
        if not isinstance(self.waiters, set):
            self.waiters = set()
        self.waiters.add(waiter)
        return waiter
