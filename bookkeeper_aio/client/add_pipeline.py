"""The writer's add pipeline: pending adds, ordered completion, ack counting, LAC, explicit LAC.

Rules (docs/replication.md §2):

- Entry ids are sequential. Entry ``e`` goes to its write set: ``Qw`` bookies of the *current*
  ensemble starting at position ``e mod E``; its body carries the LAC at send time (piggyback).
- An add *completes* (its future resolves, the LAC advances) only when ``Qa`` bookies of its write
  set acked it **and** every lower entry completed, and never while an ensemble change is in
  flight (``_changing``).
- After an ensemble change (:meth:`AddPipeline._use_ensemble`), acks of replaced bookies no longer
  count and every outstanding entry is re-sent to the bookies of its new write set it was not
  sent to (:meth:`AddPipeline._resend_outstanding`).
- Backpressure: at most ``add_window_max`` adds in flight per handle, and ``adds_in_flight_max``
  across the client (:mod:`~bookkeeper_aio.client.add_budget`); ``append`` waits for a slot, then
  for a permit. An add holds its permit from ``_start_add`` until it completes or fails, so the
  wait is in the client and never part of the add's timeout (which runs once it is sent).
- Explicit LAC: after ``explicit_lac_interval_ms`` without an add carrying the latest LAC, the LAC is
  sent to the ensemble with WRITE_LAC so readers see the last entry. A writer that is slow rather
  than idle (its next add comes within a few intervals of a WRITE_LAC) has its interval doubled, up
  to ``explicit_lac_interval_max_ms``: a steady stream slower than the interval otherwise pays E
  WRITE_LACs per add (thousands of slowly written ledgers: half the throughput). A longer pause
  brings the interval back to the base. A writer whose next add waits for a permit of the client's
  budget is not idle either: that add carries the LAC once sent.

What to do about a failing bookie is the subclass's business (:meth:`AddPipeline._bookie_failed`:
the ledger handle replaces it). Hot path: one small :class:`PendingAdd` per entry completed by
connection callbacks, one frame encoded per entry and shared by its write set, one future per entry
for the caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import functools
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from bookkeeper_aio.client.add_budget import AddBudget
from bookkeeper_aio.client.connection import ADD_OK, BookieConnection, ConnectionState, Result
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.metrics import ClientMetrics
from bookkeeper_aio.client.quorum import AckSet, schedule_of
from bookkeeper_aio.errors import (
    BKError,
    BKInterfaceError,
    LedgerClosed,
    LedgerFenced,
    TooManyRequests,
    Unauthorized,
    error_for_status,
    with_outcome_unknown,
)
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.digest import DigestType, EntryCodec
from metadata.ledger_manager import VersionedLedger

log = structlog.get_logger("bookkeeper_aio.client.ledger")


class HandleState(enum.Enum):
    WRITABLE = "writable"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


EventListener = Callable[[str, int], None]
"""``listener(event, entry_id)``: ``add.completed`` (entry id), ``ensemble_change.started`` (the
LAC), ``ensemble_change.finished`` (first entry of the new fragment). Observability and tests."""

LAC_SLOW_WRITER_INTERVALS = 4
"""An add this many explicit-LAC intervals or sooner after a WRITE_LAC doubles the interval."""
OVERLOADED_RETRY_S = 0.01
"""How soon an add the client's own cap on requests pending to a bookie refused is sent again."""

_WRITABLE = HandleState.WRITABLE
_CLOSED = ConnectionState.CLOSED
_request_each = BookieConnection.request_each


class PendingAdd(AckSet):
    """One outstanding add; its acks are the :class:`AckSet` over ``write_set``. ``sent_to`` is
    the write set itself while the entry went to exactly that (the common case, no allocation),
    else a set of every bookie it was sent to. ``frame`` is the encoded ADD request. ``started``
    (loop time) is set only when the handle reports metrics."""

    __slots__ = ("entry_id", "frame", "future", "length", "quorum", "sent_to", "started")
    started: float

    def __init__(
        self,
        entry_id: int,
        length: int,
        future: asyncio.Future[int],
        frame: bytes,
        write_set: tuple[str, ...],
    ) -> None:
        self.entry_id = entry_id
        self.length = length
        self.future = future
        self.frame = frame
        self.write_set = write_set
        self.acked = 0
        self.sent_to: tuple[str, ...] | set[str] = write_set
        self.quorum = False


def _fail_future(future: asyncio.Future[int], error: BKError) -> None:
    if not future.done():
        future.set_exception(error)
        # The caller may drop an append future without awaiting it; the error is also in the
        # handle's state, so asyncio must not log "exception never retrieved" for each one.
        future.exception()


class AddResults(Protocol):
    """What the futures of a handle's adds complete with, for a layer above the ledger (the log
    writer: log positions, and its own error for a fenced ledger) without a second future per add.
    Both run synchronously in the pipeline: keep them quick, never raise."""

    def ok(self, ledger_id: int, entry_id: int) -> object:
        """The result of a completed add."""

    def failed(self, error: BKError) -> BKError:
        """The exception of a failed add (``error`` has ``outcome_unknown`` set as documented)."""


class AddPipeline:
    """The add pipeline of one ledger open for writing (the base of the ledger handle)."""

    # Slots: a client may hold 100,000 open ledgers (a __dict__ is ~1.5 KiB of each).
    __slots__ = (
        "__weakref__",
        "_ack_quorum",
        "_add_timeout_s",
        "_budget",
        "_budget_waiters",
        "_changing",
        "_codec",
        "_completing",
        "_config",
        "_crc32c",
        "_ctx",
        "_drained",
        "_ensemble",
        "_ensemble_size",
        "_entry_bytes_max",
        "_error",
        "_explicit_lac_at",
        "_failed_bookies",
        "_frames",
        "_id",
        "_lac",
        "_lac_base_s",
        "_lac_check",
        "_lac_interval_s",
        "_lac_max_s",
        "_lac_sent",
        "_lac_timers",
        "_length_confirmed",
        "_length_sent",
        "_listener",
        "_loop",
        "_master_key",
        "_metadata",
        "_metrics",
        "_next_entry_id",
        "_on_acks",
        "_on_add",
        "_pending",
        "_pool",
        "_results",
        "_schedule",
        "_sends",
        "_sends_at_lac_check",
        "_slot_waiters",
        "_slots_reserved",
        "_state",
        "_version",
        "_window",
        "_write_conns",
        "_write_sets",
    )

    def __init__(
        self, ctx: ClientContext, versioned: VersionedLedger, password: bytes, master_key: bytes
    ) -> None:
        md = versioned.metadata
        self._ctx = ctx
        self._config = ctx.config
        self._pool = ctx.pool
        self._loop = asyncio.get_running_loop()
        self._metadata = md
        self._version = versioned.version
        self._id = md.ledger_id
        self._schedule = schedule_of(md.ensemble_size, md.write_quorum, md.ack_quorum)
        self._ack_quorum = md.ack_quorum
        self._codec = EntryCodec(md.digest_type, password, master_key)
        self._master_key = master_key
        self._crc32c = self._codec.digest_type is DigestType.CRC32C
        self._frames = m.AddFrameEncoder(self._id, master_key)
        self._ensemble_size = md.ensemble_size
        self._use_ensemble(md.current_ensemble)
        self._state = HandleState.WRITABLE
        self._error: BKError | None = None
        self._next_entry_id = 0
        self._lac = -1
        self._length_sent = 0
        self._length_confirmed = 0
        self._pending: collections.deque[PendingAdd] = collections.deque()
        self._window = self._config.add_window_max
        self._slot_waiters: collections.deque[asyncio.Future[None]] | None = None  # made on first wait
        self._slots_reserved = 0
        self._budget: AddBudget = ctx.add_budget
        self._budget_waiters: set[asyncio.Future[bool]] | None = None  # made on first wait
        self._drained: asyncio.Event | None = None
        self._failed_bookies: dict[str, BKError] = {}
        self._changing = False
        self._completing = False  # a _complete_soon is scheduled
        self._lac_sent = -1
        self._sends = 0
        self._sends_at_lac_check = 0
        self._entry_bytes_max = self._config.entry_bytes_max
        self._add_timeout_s = self._config.add_timeout_s
        self._lac_check = False  # an explicit-LAC check is scheduled (on the wheel, or next on the loop)
        self._lac_timers = ctx.lac_timers
        self._lac_base_s = self._lac_interval_s = self._config.explicit_lac_interval_ms / 1000
        self._lac_max_s = max(self._lac_base_s, self._config.explicit_lac_interval_max_ms / 1000)
        self._explicit_lac_at: float | None = None  # when the last WRITE_LAC went out, until an add
        self._metrics: ClientMetrics | None = ctx.metrics
        self._on_add = self._on_add_result
        self._on_acks = self._on_add_acks
        self._listener: EventListener | None = None
        self._results: AddResults | None = None

    def adapt_results(self, results: AddResults | None) -> None:
        """From now on, the futures of this handle's adds complete with ``results.ok(ledger id,
        entry id)`` and fail with ``results.failed(error)`` (None: the entry id and the error)."""
        self._results = results

    def _use_ensemble(self, ensemble: tuple[str, ...]) -> None:
        """Send from now on to ``ensemble`` (the current fragment's)."""
        self._ensemble = ensemble
        self._write_sets = _write_sets(ensemble, self._schedule.write_sets())
        self._write_conns: list[tuple[BookieConnection, ...] | None] = [None] * self._ensemble_size
        """The pool's connections of each write set (None: look them up), so an add does not."""

    # ------------------------------------------------------------------ appends
    async def append(self, payload: bytes) -> int:
        """Add ``payload`` and wait for it to complete; returns its entry id.

        Raises LedgerClosed, LedgerFenced, NotEnoughBookies, Unauthorized, BKInterfaceError (payload
        too large). An error failing an add that was already sent has ``outcome_unknown`` True: the
        entry may or may not be in the ledger (docs/api.md); one raised before sending has it False.
        Cancelling the wait does not withdraw the entry once it was handed to the bookies.
        """
        if (  # fast path, same checks as append_async: no extra coroutine per entry
            self._state is _WRITABLE
            and type(payload) is bytes
            and len(payload) <= self._entry_bytes_max
            and not self._slot_waiters
            and len(self._pending) + self._slots_reserved < self._window
            and self._budget.in_flight < self._budget.open_limit  # AddBudget.free() without a call
        ):
            future = self._start_add(payload)
        else:
            future = await self.append_async(payload)
        return await future

    def append_nowait(self, payload: bytes) -> asyncio.Future[int] | None:
        """`append_async` when a window slot is free right now (nothing to wait for): the future
        of the entry id; None when it would have to wait (nothing was done). Raises as
        `append_async` does for a handle that is not writable or a payload too large."""
        if (
            self._slot_waiters
            or len(self._pending) + self._slots_reserved >= self._window
            or self._budget.in_flight >= self._budget.open_limit  # not AddBudget.free()
        ):
            return None
        if self._state is not _WRITABLE:
            self._check_writable()  # raises
        if len(payload) > self._entry_bytes_max:
            raise BKInterfaceError(f"entry of {len(payload)} bytes exceeds {self._entry_bytes_max}")
        return self._start_add(payload if type(payload) is bytes else bytes(payload))

    async def append_async(self, payload: bytes) -> asyncio.Future[int]:
        """Hand ``payload`` to the bookies; returns a future of its entry id (pipelining).

        Waits only while the handle's window of in-flight adds, or the client's budget of them,
        is full (backpressure): first for a slot of the window, then for a permit of the budget.
        The returned future fails with the errors listed for :meth:`append`.
        """
        if self._state is not _WRITABLE:
            self._check_writable()  # raises
        if len(payload) > self._entry_bytes_max:
            raise BKInterfaceError(f"entry of {len(payload)} bytes exceeds {self._entry_bytes_max}")
        slot = permit = False
        try:
            if self._slot_waiters or len(self._pending) + self._slots_reserved >= self._window:
                await self._wait_for_slot()
                slot = True
                self._check_writable()
            if self._budget.in_flight >= self._budget.open_limit:  # not AddBudget.free()
                permit = await self._wait_for_permit()
        except BaseException:
            if slot:  # unused: pass it on
                self._slots_reserved -= 1
                self._wake_slot_waiters()
            raise
        if slot:
            self._slots_reserved -= 1  # the add below takes the slot over
        if permit:
            self._budget.in_flight -= 1  # ... and the permit (``_start_add`` takes one)
        return self._start_add(payload if type(payload) is bytes else bytes(payload))

    def _check_writable(self) -> None:
        if self._state is HandleState.WRITABLE:
            return
        if self._error is not None:  # a fresh copy: this add was not sent, its outcome is known
            raise with_outcome_unknown(self._error, False)
        raise LedgerClosed(f"ledger {self._id} is {self._state.value}")

    async def _wait_for_slot(self) -> None:
        waiter: asyncio.Future[None] = self._loop.create_future()
        if self._slot_waiters is None:
            self._slot_waiters = collections.deque()
        self._slot_waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._slots_reserved -= 1  # woken, then cancelled: pass the slot on
                self._wake_slot_waiters()
            else:  # still queued, unless a wake-up or a release popped it in the meantime
                with contextlib.suppress(ValueError):
                    self._slot_waiters.remove(waiter)
            raise

    async def _wait_for_permit(self) -> bool:
        """Wait for a permit of the client's budget (True: held). Raises as ``_check_writable``
        when the handle stops being writable meanwhile (any permit given back)."""
        budget = self._budget
        if self._budget_waiters is None:
            self._budget_waiters = set()
        while True:
            waiter: asyncio.Future[bool] = self._loop.create_future()
            self._budget_waiters.add(waiter)
            try:
                got = await budget.wait(waiter)
            finally:
                self._budget_waiters.discard(waiter)
            try:
                self._check_writable()
            except BKError:
                if got:
                    budget.release(1)
                raise
            if got:
                return True
            if budget.free():  # refused although writable (not expected): take one the usual way
                return False

    def _wake_slot_waiters(self) -> None:
        waiters = self._slot_waiters
        while waiters and len(self._pending) + self._slots_reserved < self._window:
            waiter = waiters.popleft()
            if not waiter.done():
                self._slots_reserved += 1
                waiter.set_result(None)

    def _release_slot_waiters(self) -> None:
        """Wake every slot and permit waiter now: each re-checks the state and raises."""
        if self._budget_waiters:
            for permit_waiter in list(self._budget_waiters):
                self._budget.refuse(permit_waiter)
        if not self._slot_waiters:
            return
        for waiter in self._slot_waiters:
            if not waiter.done():
                waiter.set_result(None)
                self._slots_reserved += 1
        self._slot_waiters.clear()

    def _start_add(self, payload: bytes) -> asyncio.Future[int]:
        entry_id = self._next_entry_id
        self._next_entry_id = entry_id + 1
        length = self._length_sent + len(payload)
        self._length_sent = length
        lac = self._lac
        self._lac_sent = lac
        self._sends += 1
        self._budget.in_flight += 1  # given back when the add completes or fails
        # One request id for the whole write set: ids are unique per pool, hence per connection,
        # so the frame is encoded once and shared.
        pool = self._pool
        rid = pool.next_request_id()
        if self._crc32c:
            frame = self._frames.crc32c_frame(rid, entry_id, lac, length, payload)
        else:
            frame = self._frames.frame(
                rid, entry_id, self._codec.encode(self._id, entry_id, lac, length, payload)
            )
        future: asyncio.Future[int] = self._loop.create_future()
        index = entry_id % self._ensemble_size
        write_set = self._write_sets[index]
        op = PendingAdd(entry_id, length, future, frame, write_set)
        if self._metrics is not None:
            op.started = self._loop.time()
        self._pending.append(op)
        timeout_s, on_add, on_acks = self._add_timeout_s, self._on_add, self._on_acks
        if self._failed_bookies:
            failed = self._failed_bookies
            op.sent_to = sent_to = set()
            for bookie_id in write_set:
                if bookie_id not in failed:
                    sent_to.add(bookie_id)
                    pool.connection(bookie_id).request(rid, frame, on_add, op, timeout_s, on_acks)
        else:
            conns = self._write_conns[index]
            if conns is None:
                conns = self._write_conns[index] = tuple(pool.connection(b) for b in write_set)
            for conn in conns:
                if conn.state is _CLOSED:  # the pool replaces it: look the set up again
                    conns = self._write_conns[index] = tuple(pool.connection(b) for b in write_set)
                    break
            _request_each(conns, rid, frame, on_add, op, timeout_s, on_acks)
        return future

    def _resend(self, op: PendingAdd, bookie_id: str) -> None:
        rid = self._pool.next_request_id()
        frame = m.add_request_with_id(op.frame, rid)
        if type(op.sent_to) is not set:
            op.sent_to = set(op.sent_to)
        op.sent_to.add(bookie_id)
        self._pool.connection(bookie_id).request(
            rid, frame, self._on_add, op, self._add_timeout_s, self._on_acks
        )

    def _send_again(self, op: PendingAdd, bookie_id: str) -> None:
        """Send ``op`` to ``bookie_id`` again after the client's own cap on requests pending to it
        refused it, unless the add is done, the bookie left its write set meanwhile, or it was
        sent since. During an ensemble change it waits: the change's end sends every entry to
        the bookies of its write set it is not sent to (:meth:`_resend_outstanding`)."""
        if op.future.done() or self._state not in (_WRITABLE, HandleState.CLOSING) or self._changing:
            return
        if (
            bookie_id in op.write_set
            and bookie_id in self._ensemble
            and bookie_id not in op.sent_to
            and not op.has_acked(bookie_id)
        ):
            self._resend(op, bookie_id)

    # ------------------------------------------------------------------ responses
    def _on_add_result(self, op: PendingAdd, bookie_id: str, result: Result) -> None:
        if result is ADD_OK:  # an ack of its own (from a bookie replaced since: not counted)
            if op.ack(bookie_id) >= self._ack_quorum and not op.quorum:
                op.quorum = True
                pending = self._pending
                if pending and pending[0] is op and not self._completing:
                    # Completed once the acks at hand are counted (the rest of the socket read, its
                    # other answers): one pass per burst of acks, not one per entry of it.
                    self._completing = True
                    self._loop.call_soon(self._complete_soon)
            return
        error = result if isinstance(result, BKError) else error_for_status(result.status, result.message)
        if bookie_id not in op.write_set or bookie_id not in self._ensemble:
            return  # failure of a bookie already replaced
        if type(result) is TooManyRequests:
            # the client's own cap on requests pending to one bookie (connection_pending_max), not
            # the bookie's answer: nothing was sent, the bookie did not fail. Backpressure: sent
            # again shortly (a bookie that stopped answering still times out on what it holds)
            op.sent_to = {sent for sent in op.sent_to if sent != bookie_id}
            self._loop.call_later(OVERLOADED_RETRY_S, self._send_again, op, bookie_id)
            return
        if isinstance(error, LedgerFenced | Unauthorized):
            self._fail(error)
            return
        self._bookie_failed(bookie_id, error)

    def _on_add_acks(self, ops: list[PendingAdd], bookie_id: str) -> None:
        """``bookie_id`` acked ``ops`` (one batched answer, a journal group's): as
        ``_on_add_result`` with ADD_OK for each, in one call."""
        for op in AckSet.ack_each(ops, bookie_id, self._ack_quorum):
            op.quorum = True
        pending = self._pending
        if pending and pending[0].quorum and not self._completing:
            self._completing = True  # one pass once the rest of the read is counted, as above
            self._loop.call_soon(self._complete_soon)

    def _complete_soon(self) -> None:
        self._completing = False
        self._complete_ready()

    def _complete_due(self) -> None:
        """Complete now the adds whose quorum was counted but whose pass (``_complete_soon``) has
        not run yet: before a failure is acted on, as they would have had the pass run first."""
        if self._completing:
            self._complete_ready()

    def _complete_ready(self) -> None:
        if self._changing:
            return
        pending = self._pending
        listener = self._listener
        metrics = self._metrics
        results = self._results
        now = self._loop.time() if metrics is not None else 0.0
        completed = 0
        while pending and pending[0].quorum:
            op = pending.popleft()
            self._lac = op.entry_id
            self._length_confirmed = op.length
            # an adapted handle's futures carry what ``results.ok`` makes (typed int for the rest);
            # try, not contextlib.suppress (two calls per add) nor future.done() (one)
            try:  # noqa: SIM105
                op.future.set_result(op.entry_id if results is None else results.ok(self._id, op.entry_id))  # type: ignore[arg-type]
            except asyncio.InvalidStateError:
                pass  # its caller cancelled it: the add completed all the same
            if metrics is not None:
                metrics.add_completed(now - op.started)
            if listener is not None:
                listener("add.completed", op.entry_id)
            completed += 1
        if not completed:
            return
        self._budget.release(completed)
        if self._slot_waiters:
            self._wake_slot_waiters()
        if not pending and self._drained is not None:
            self._drained.set()
        if self._lac_interval_s > 0 and not self._lac_check:
            if self._explicit_lac_at is not None:
                self._adapt_lac_interval()
            self._sends_at_lac_check = self._sends
            self._lac_check = True
            self._lac_timers.call_later(self._lac_interval_s, self._explicit_lac)

    def _resend_outstanding(self) -> None:
        """After an ensemble change: acks of replaced bookies no longer count, and each entry goes
        to the bookies of its write set it is not sent to (new ones, and any whose send the
        client's own cap refused during the change)."""
        write_sets = self._write_sets
        quorum = self._ack_quorum
        for op in self._pending:
            write_set = write_sets[op.entry_id % len(write_sets)]
            if write_set == op.write_set:
                if type(op.sent_to) is set:
                    for bookie_id in write_set:
                        if bookie_id not in op.sent_to:
                            self._resend(op, bookie_id)
                continue
            op.quorum = op.move_to(write_set) >= quorum
            sent_to = op.sent_to
            if any(bookie_id not in write_set for bookie_id in sent_to):
                # A replaced bookie's send no longer counts (its request failed, its ack was
                # dropped): should a later change bring it back, the entry must go to it again,
                # or the add waits forever for an ack no request will bring (no timeout either).
                op.sent_to = {bookie_id for bookie_id in sent_to if bookie_id in write_set}
            for bookie_id in write_set:
                if bookie_id not in op.sent_to:
                    self._resend(op, bookie_id)

    # ------------------------------------------------------------------ explicit LAC
    def _explicit_lac(self) -> None:
        """The LAC check, an interval after a completion (on the client's timer wheel). Idle, or
        only behind? A client busy with many ledgers runs this check before the writers its
        completions woke (their next adds carry the LAC): look again once they ran, after what is
        queued on the loop now, and only then send a WRITE_LAC."""
        if not self._lac_check:
            return  # stopped: the handle closed
        self._lac_check = False
        if self._lac_unsent_and_idle():
            self._lac_check = True
            self._loop.call_soon(self._write_lac)

    def _lac_unsent_and_idle(self) -> bool:
        """Whether the LAC is still unsent and no add went out since the last look, nor waits for
        a permit of the client's budget (look again an interval later). An add waiting for a
        permit carries the LAC once sent: it is the wait an add sent at once would spend in a
        bookie's queue (where the LAC reaches readers no sooner), moved into the client. Without
        this, a client with more ledgers than permits (each ledger's next add waits its turn)
        sent a WRITE_LAC to every bookie of the ensemble per entry: 3x the bookies' CPU per
        entry at 20,000 ledgers (docs/benchmarks.md, seventh pass)."""
        if self._state in (HandleState.CLOSED, HandleState.FAILED) or self._lac <= self._lac_sent:
            return False
        if self._sends != self._sends_at_lac_check or self._budget_waiters:  # not idle
            self._sends_at_lac_check = self._sends
            self._lac_check = True
            self._lac_timers.call_later(self._lac_interval_s, self._explicit_lac)
            return False
        return True

    def _write_lac(self) -> None:
        if not self._lac_check:
            return  # stopped: the handle closed
        self._lac_check = False
        if not self._lac_unsent_and_idle():
            return
        lac = self._lac_sent = self._lac
        ledger_id, key = self._id, self._master_key
        self._explicit_lac_at = self._loop.time()
        if self._metrics is not None:
            self._metrics.explicit_lac_sent(ledger_id)

        def make(rid: int) -> m.Request:
            return m.WriteLacRequest(rid, ledger_id, key, lac)

        for bookie_id in self._ensemble:
            self._pool.request_with_callback(bookie_id, make, _ignore_result, None, self._add_timeout_s)

    def _adapt_lac_interval(self) -> None:
        """An add completed after a WRITE_LAC: soon after it (within ``LAC_SLOW_WRITER_INTERVALS``
        intervals), the writer is slow, not idle, so the next WRITE_LAC waits twice as long (up to
        the maximum); after a longer pause, the base interval again."""
        assert self._explicit_lac_at is not None
        since = self._loop.time() - self._explicit_lac_at
        self._explicit_lac_at = None
        if since < LAC_SLOW_WRITER_INTERVALS * self._lac_interval_s:
            self._lac_interval_s = min(2 * self._lac_interval_s, self._lac_max_s)
        else:
            self._lac_interval_s = self._lac_base_s

    def _stop_lac_timer(self) -> None:
        self._lac_check = False  # what is scheduled finds it so and does nothing

    # ------------------------------------------------------------------ failures
    def _bookie_failed(self, bookie_id: str, error: BKError) -> None:
        """A bookie of the current ensemble failed an add (not fenced, not unauthorized)."""
        raise NotImplementedError

    def _fail(self, error: BKError) -> None:
        """Fail the handle and every outstanding add with ``error``."""
        if self._state in (HandleState.CLOSED, HandleState.FAILED):
            return
        log.warning("ledger.failed", ledger_id=self._id, lac=self._lac, error=repr(error))
        self._state = HandleState.FAILED
        self._error = error
        self._fail_outstanding(error)

    def _fail_outstanding(self, error: BKError) -> None:
        """Fail every outstanding add: each was sent, so its error says ``outcome_unknown``. Those
        whose completion is due (``_complete_soon``) complete first, as they would have had it run."""
        self._complete_due()
        pending, self._pending = self._pending, collections.deque()
        metrics = self._metrics
        if pending:
            error = with_outcome_unknown(error, True)
        results = self._results
        if pending:
            self._budget.release(len(pending))
        for op in pending:
            if metrics is not None:
                metrics.add_failed(error)
            _fail_future(op.future, error if results is None else results.failed(error))
        self._release_slot_waiters()
        if self._drained is not None:
            self._drained.set()

    async def _wait_drained(self) -> None:
        """Until no add is outstanding (completed or failed)."""
        if self._pending:
            if self._drained is None or self._drained.is_set():  # one event for every waiter
                self._drained = asyncio.Event()
            await self._drained.wait()

    def _versioned(self) -> VersionedLedger:
        """The latest metadata this writer knows, with its version (the CAS token)."""
        return VersionedLedger(self._metadata, self._version)

    def _set_metadata(self, stored: VersionedLedger) -> None:
        self._metadata = stored.metadata
        self._version = stored.version


def _ignore_result(context: Any, bookie_id: str, result: Result) -> None:
    return None


@functools.lru_cache(maxsize=4096)
def _write_sets(
    ensemble: tuple[str, ...], positions: tuple[tuple[int, ...], ...]
) -> tuple[tuple[str, ...], ...]:
    """The bookies of each write set of ``ensemble``: one copy for every ledger of that ensemble
    (a client with 100,000 open ledgers over a few bookies has a handful)."""
    return tuple(tuple(ensemble[i] for i in members) for members in positions)
