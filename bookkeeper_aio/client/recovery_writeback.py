"""Recovery step 4: write every found entry back to its whole write set (RECOVERY_ADD).

An entry is *finished* when every bookie of its write set acked it (or ``Qa`` of them did and the
rest were given up). A failing bookie is replaced through the placement policy in a local fragment
that the close persists. That fragment starts right after the *written-through* mark: the highest
entry such that it and every entry below it are finished (what the writer's LAC is to its
ensemble changes). Every entry above the mark keeps its body, finished or not, so that when a
fragment changes its write set it is counted as unfinished again and re-sent to the new bookies:
otherwise an entry finished on the old bookie and placed by the close in a fragment naming the
replacement would lack a replica of its recorded write set (the review's reproduction in
``tests/unit/review/test_recovery_write_back.py``). Entries at or below the mark stay in the
earlier fragments, on the bookies that acked them, and are never re-sent.

Without a replacement a bookie is given up: its entries then need ``Qa`` acks from the rest (what
the writer's guarantee was in the first place); fewer is an error.
"""

from __future__ import annotations

import asyncio

import structlog

from bookkeeper_aio.client.connection import Result
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.ensemble_change import BookieReplacer
from bookkeeper_aio.client.quorum import AckSet, DistributionSchedule
from bookkeeper_aio.errors import BKError, LedgerRecoveryError, NotEnoughBookies
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, StatusCode
from bookkeeper_aio.protocol.messages import encode_add_request

log = structlog.get_logger("bookkeeper_aio.client.recovery")

_RECOVERY_ADD = int(AddFlag.RECOVERY_ADD)
_EOK = StatusCode.EOK
"""As module names, asked on every write-back: ``StatusCode.EOK`` goes through
``EnumType.__getattr__``'s slow attribute path on Python 3.11 (about 0.3 us)."""


def describe(response: m.Response | BKError) -> str:
    """A failed reply for logs and error messages."""
    if isinstance(response, BKError):
        return repr(response)
    name = StatusCode(response.status).name if response.status in StatusCode._value2member_map_ else ""
    return f"{name or response.status} {response.message or ''}".strip()


class _Add(AckSet):
    __slots__ = ("entry_id", "finished", "frame_body", "sent_to")

    def __init__(self, entry_id: int, body: bytes, write_set: tuple[str, ...]) -> None:
        super().__init__(write_set)
        self.entry_id = entry_id
        self.frame_body = body
        self.sent_to: set[str] = set()
        self.finished = False


class WriteBack:
    """Recovery adds of found entries, in entry order, with local ensemble changes (see module)."""

    def __init__(
        self,
        ctx: ClientContext,
        ledger_id: int,
        schedule: DistributionSchedule,
        ensemble: tuple[str, ...],
        key: bytes,
        start: int,
    ) -> None:
        self._ctx = ctx
        self._loop = asyncio.get_running_loop()
        self._ledger_id = ledger_id
        self._schedule = schedule
        self._ack_quorum = schedule.ack_quorum
        self.key = key
        self.ensemble = ensemble
        self.fragments: list[tuple[int, tuple[str, ...]]] = []
        """Local fragments ``(first entry, ensemble)``, in order; the close persists them."""
        self._ops: dict[int, _Add] = {}  # every entry above the written-through mark
        self._unfinished = 0
        self._written = start  # the written-through mark
        self._failed: set[str] = set()
        self._replacer = BookieReplacer(ctx, ledger_id)
        self._given_up: set[str] = set()
        self._error: BKError | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._change_task: asyncio.Task[None] | None = None

    @property
    def outstanding(self) -> int:
        """Entries whose bodies are held (above the written-through mark): counts in the window."""
        return len(self._ops)

    @property
    def written_through(self) -> int:
        return self._written

    def _write_set(self, entry_id: int) -> tuple[str, ...]:
        return tuple(self.ensemble[p] for p in self._schedule.write_set(entry_id))

    def add(self, entry_id: int, body: bytes) -> None:
        """Write back ``body`` exactly as read (verified): re-sent bodies are byte-identical.
        Entries come in order, without gaps."""
        self._check()
        assert entry_id == self._written + len(self._ops) + 1, (entry_id, self._written, len(self._ops))
        op = _Add(entry_id, body, self._write_set(entry_id))
        self._ops[entry_id] = op
        self._unfinished += 1
        for bookie_id in op.write_set:
            if bookie_id not in self._given_up:
                self._send(op, bookie_id)
        self._maybe_finished(op)

    def _send(self, op: _Add, bookie_id: str) -> None:
        pool = self._ctx.pool
        rid = pool.next_request_id()
        frame = encode_add_request(rid, self._ledger_id, op.entry_id, _RECOVERY_ADD, self.key, op.frame_body)
        op.sent_to.add(bookie_id)
        pool.connection(bookie_id).request(rid, frame, self._on_add, op, self._ctx.config.add_timeout_s)

    def _on_add(self, op: _Add, bookie_id: str, result: Result) -> None:
        if self._ops.get(op.entry_id) is not op or op.finished or bookie_id not in op.write_set:
            return  # finished already, or the bookie was replaced since
        if not isinstance(result, BKError) and result.status == _EOK:
            op.ack(bookie_id)
            self._maybe_finished(op)
            return
        error = result if isinstance(result, BKError) else BKError(describe(result))
        if bookie_id not in self._failed:
            log.info("recovery.bookie_failed", ledger_id=self._ledger_id, bookie=bookie_id, error=repr(error))
        self._failed.add(bookie_id)
        if self._change_task is None:
            self._start_change()

    def _maybe_finished(self, op: _Add) -> None:
        if op.finished or op.count < self._ack_quorum:
            return
        if all(op.has_acked(b) or b in self._given_up for b in op.write_set):
            op.finished = True
            self._unfinished -= 1
            ops = self._ops
            while (low := ops.get(self._written + 1)) is not None and low.finished:
                del ops[self._written + 1]
                self._written += 1
            self._wake()

    def _start_change(self) -> None:
        self._change_task = self._loop.create_task(self._change_ensemble(), name="recovery ensemble change")
        self._change_task.add_done_callback(self._change_done)

    async def _change_ensemble(self) -> None:
        while self._failed:
            failed, self._failed = self._failed, set()
            change = await self._replacer.choose(self.ensemble, failed, give_up=True)
            for bookie_id in change.given_up:
                log.warning("recovery.bookie_given_up", ledger_id=self._ledger_id, bookie=bookie_id)
            self._given_up.update(change.given_up)
            if change.replaced:
                first = self._written + 1  # every entry from here on is in self._ops (or not read yet)
                self.ensemble = change.ensemble
                self.fragments = [f for f in self.fragments if f[0] < first]
                self.fragments.append((first, self.ensemble))
                log.info(
                    "recovery.ensemble_changed",
                    ledger_id=self._ledger_id,
                    first_entry=first,
                    replaced=list(change.replaced),
                    ensemble=list(self.ensemble),
                )
            self._resend()

    def _resend(self) -> None:
        """After a change: every held entry whose write set changed is unfinished again and goes to
        its new bookies; every unfinished entry must still be able to reach ``Qa``.

        Two passes: every write set is updated before any entry can finish (finishing one moves the
        mark past the finished entries above it, which must have been reopened first)."""
        unfinished: list[_Add] = []
        for op in self._ops.values():
            write_set = self._write_set(op.entry_id)
            if write_set != op.write_set:
                op.move_to(write_set)
                # A replaced bookie's send no longer counts: if a later change brings it back (an
                # ever-failed bookie is chosen when nothing else is left), it must get the entry
                # again (the writer's pipeline had this bug: the simulation's seed 208).
                op.sent_to.intersection_update(write_set)
                if op.finished:
                    op.finished = False
                    self._unfinished += 1
            if not op.finished:
                unfinished.append(op)
        for op in unfinished:
            if sum(1 for b in op.write_set if b not in self._given_up) < self._ack_quorum:
                self._set_error(NotEnoughBookies(f"entry {op.entry_id}: fewer than Qa bookies left"))
                return
            for bookie_id in op.write_set:
                if bookie_id not in op.sent_to and bookie_id not in self._given_up:
                    self._send(op, bookie_id)
            self._maybe_finished(op)

    def _change_done(self, task: asyncio.Task[None]) -> None:
        self._change_task = None
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            wrapped = LedgerRecoveryError(f"ledger {self._ledger_id}: write-back failed: {error!r}")
            wrapped.__cause__ = error
            self._set_error(wrapped)
        elif self._failed:  # failures that arrived while the task was finishing
            self._start_change()

    def _set_error(self, error: BKError) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, future: asyncio.Future[None]) -> None:
        """Wait for ``future`` (a read decision); a write-back error raises at once instead."""
        while not future.done():
            self._check()
            self._wakeup = self._loop.create_future()
            future.add_done_callback(self._wake_cb)
            try:
                await self._wakeup
            finally:
                future.remove_done_callback(self._wake_cb)
                self._wakeup = None
        self._check()

    def _wake_cb(self, _: asyncio.Future[None]) -> None:
        self._wake()

    async def drain(self) -> None:
        """Until every entry added is finished (the mark reaches the last one), or an error."""
        while self._ops:
            self._check()
            self._wakeup = self._loop.create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        while (task := self._change_task) is not None:  # a change whose resends are all done
            if task.done():
                # Finished, its done callback (_change_done) not run yet: awaiting a done task
                # does not yield, so this loop would spin forever without letting it run.
                await asyncio.sleep(0)
            else:
                await asyncio.shield(task)
        self._check()
        assert self._unfinished == 0

    def abort(self) -> None:
        self._ops.clear()
        self._unfinished = 0
        if self._change_task is not None:
            self._change_task.cancel()
            self._change_task = None
