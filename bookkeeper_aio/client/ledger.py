"""The write handle: the add pipeline, plus ensemble change and close (docs/replication.md §2, §3).

The handle is the ledger's one writer. Its parts, each in its own module:

- :mod:`~bookkeeper_aio.client.add_pipeline`: sequential adds, quorum acks, ordered completion,
  LAC, backpressure, explicit LAC (the hot path; the handle *is* an :class:`AddPipeline`);
- :mod:`~bookkeeper_aio.client.ensemble_change`: the replication primitive that replaces a
  bookie and CASes the new fragment;
- :mod:`~bookkeeper_aio.client.ledger_close`: the close decision and its CAS.

What this module adds is the orchestration:

- A failed or timed-out bookie is replaced: one ensemble change task at a time, started on the
  first failure (from then on no add completes until it ends); it replaces every bookie that failed
  meanwhile with a new fragment starting at LAC+1, then the pipeline drops acks of the replaced
  bookies and re-sends every outstanding entry to its new write set. On a CAS conflict the
  metadata is re-read: not OPEN any more -> fail every outstanding add (LedgerFenced when
  IN_RECOVERY, LedgerClosed when CLOSED); OPEN -> decide again on the fresh metadata. Late failures
  from a bookie of the current ensemble still lead to its replacement; answers from replaced
  bookies are ignored.
- EFENCED or EUA from any bookie fails the handle (and every outstanding add). Any error of an add
  that was sent is *unknown* (``outcome_unknown`` True): it may or may not be in the ledger (only
  the recovered ledger's last entry tells); later adds are refused before sending (False).
- No replacement bookie: the replacer reads the stored state first, so a ledger fenced or closed
  meanwhile fails the adds with LedgerFenced / LedgerClosed rather than NotEnoughBookies.
- Close: wait for outstanding adds and any ensemble change, then CAS state CLOSED + last entry =
  LAC (outcomes in :mod:`~bookkeeper_aio.client.ledger_close`).
"""

from __future__ import annotations

import asyncio

import structlog

from bookkeeper_aio.client.add_pipeline import AddPipeline, EventListener, HandleState
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.ensemble_change import BookieReplacer
from bookkeeper_aio.client.ledger_close import close_in_metadata
from bookkeeper_aio.errors import (
    BKError,
    BKInternalError,
    BKTimeout,
    LedgerClosed,
    LedgerFenced,
    NotEnoughBookies,
    with_outcome_unknown,
)
from metadata.ledger_manager import VersionedLedger
from metadata.ledger_metadata import LedgerMetadata, LedgerState

__all__ = ["EventListener", "HandleState", "LedgerHandle"]

log = structlog.get_logger(__name__)

_ACTIVE = (HandleState.WRITABLE, HandleState.CLOSING)


class LedgerHandle(AddPipeline):
    """A ledger open for writing. Made by ``BookKeeper.create_ledger``; use as an async context
    manager or call :meth:`close`."""

    __slots__ = ("_change_task", "_close_task", "_replacer", "ensemble_changes")

    def __init__(
        self, ctx: ClientContext, versioned: VersionedLedger, password: bytes, master_key: bytes
    ) -> None:
        super().__init__(ctx, versioned, password, master_key)
        self._replacer: BookieReplacer | None = None  # made at the first ensemble change
        self._change_task: asyncio.Task[None] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self.ensemble_changes = 0

    # ------------------------------------------------------------------ properties
    @property
    def id(self) -> int:
        return self._id

    @property
    def last_add_confirmed(self) -> int:
        """The highest entry id completed (acked by Qa and every lower entry), -1 if none."""
        return self._lac

    @property
    def length(self) -> int:
        """Bytes of payload completed."""
        return self._length_confirmed

    @property
    def metadata(self) -> LedgerMetadata:
        return self._metadata

    @property
    def state(self) -> HandleState:
        return self._state

    @property
    def pending_adds(self) -> int:
        return len(self._pending)

    async def wait_for_adds(self) -> None:
        """Return once every add sent so far completed; raise the handle's error if one failed
        (the handle is then FAILED, every add after it failed too)."""
        await self._wait_drained()
        if self._error is not None:
            raise with_outcome_unknown(self._error, True)

    def set_event_listener(self, listener: EventListener | None) -> None:
        self._listener = listener

    async def __aenter__(self) -> LedgerHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ ensemble change
    def _bookie_failed(self, bookie_id: str, error: BKError) -> None:
        if self._state not in _ACTIVE:
            return
        # acks counted before this failure (the same burst): those adds complete first, and the
        # change's new fragment starts after them
        self._complete_due()
        if self._state is HandleState.CLOSING and not self._pending and self._change_task is None:
            # a late failure of an entry already acknowledged (Qw > Qa), with no add left to send:
            # a change now would race the close's CAS (or outlive the close) for nothing
            log.info("ledger.bookie_failed_at_close", ledger_id=self._id, bookie=bookie_id, error=repr(error))
            return
        if bookie_id not in self._failed_bookies:
            log.info("ledger.bookie_failed", ledger_id=self._id, bookie=bookie_id, error=repr(error))
        self._failed_bookies[bookie_id] = error
        if self._change_task is None:
            self._changing = True  # from now on no add completes until the change is done
            if self._listener is not None:
                self._listener("ensemble_change.started", self._lac)
            self._change_task = self._loop.create_task(
                self._run_ensemble_change(), name=f"ensemble change {self._id}"
            )

    async def _run_ensemble_change(self) -> None:
        try:
            while self._failed_bookies and self._state in _ACTIVE:
                failed = dict(self._failed_bookies)
                await self._change_ensemble(failed)
                for bookie_id in failed:
                    self._failed_bookies.pop(bookie_id, None)
                self._resend_outstanding()
        except BKError as error:
            self._fail(error)
        except TimeoutError as error:
            wrapped = NotEnoughBookies(f"ensemble change of ledger {self._id} failed: {error!r}")
            wrapped.__cause__ = error
            self._fail(wrapped)
        except Exception as error:  # a bug (ours, a placement policy's): fail the adds, never strand them
            log.exception("ledger.ensemble_change_crashed", ledger_id=self._id)
            crashed = BKInternalError(f"ensemble change of ledger {self._id} failed unexpectedly: {error!r}")
            crashed.__cause__ = error
            self._fail(crashed)
        finally:
            self._failed_bookies.clear()
            self._change_task = None
            self._changing = False
            if self._listener is not None and self._state is not HandleState.FAILED:
                self._listener("ensemble_change.finished", self._lac + 1)
            if self._state in _ACTIVE:
                self._complete_ready()

    async def _change_ensemble(self, failed: dict[str, BKError]) -> None:
        first_entry = self._lac + 1
        if self._replacer is None:
            self._replacer = BookieReplacer(self._ctx, self._id)
        change = await self._replacer.replace(
            self._versioned(),
            first_entry,
            failed,
            accept=_require_open,
            attempts_max=self._config.ensemble_change_attempts_max,
        )
        assert change.stored is not None
        self._set_metadata(change.stored)
        self._use_ensemble(change.stored.metadata.current_ensemble)
        self.ensemble_changes += 1
        if self._metrics is not None:
            self._metrics.ensemble_changed(self._id)
        log.info(
            "ensemble.changed",
            ledger_id=self._id,
            first_entry=first_entry,
            replaced=sorted(failed),
            ensemble=list(self._ensemble),
        )

    # ------------------------------------------------------------------ close / abort
    async def close(self) -> None:
        """Wait for outstanding adds, then close the ledger in metadata at the LAC (docs/replication.md §3).

        Idempotent. Raises LedgerFenced (the ledger is being recovered by someone else) or
        MetadataConflict (closed by someone else at another last entry). Cancelling leaves the
        handle closable again.
        """
        if self._state is HandleState.CLOSED:
            return
        if self._state is HandleState.WRITABLE:
            self._state = HandleState.CLOSING
            self._release_slot_waiters()
        if self._close_task is None:
            self._close_task = self._loop.create_task(self._close(), name=f"close {self._id}")
            self._close_task.add_done_callback(_retrieve)
        task = self._close_task
        try:
            # Shielded: a cancelled caller leaves the close running; calling close() again joins it.
            await asyncio.shield(task)
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if task.cancelled() and self._error is not None and (caller is None or not caller.cancelling()):
                raise self._error from None  # abort() ended the close: the caller was not cancelled
            raise
        finally:
            if task.done():
                self._close_task = None

    async def _close(self) -> None:
        await self._wait_drained()
        while self._change_task is not None:
            await asyncio.shield(self._change_task)
        self._stop_lac_timer()
        try:
            stored = await close_in_metadata(self._ctx, self._versioned(), self._lac, self._length_confirmed)
        except TimeoutError as error:
            raise BKTimeout(f"ledger {self._id}: metadata did not answer the close in time") from error
        except BKError as error:
            self._fail(error)
            raise
        self._set_metadata(stored)
        self._state = HandleState.CLOSED
        log.info("ledger.closed", ledger_id=self._id, last_entry=self._lac, length=self._length_confirmed)

    def abort(self) -> None:
        """Stop now: outstanding adds fail with LedgerClosed, metadata is left OPEN (a reader's
        recovery will close it)."""
        if self._state is HandleState.CLOSED:
            return
        error = LedgerClosed(f"ledger {self._id} handle aborted")
        if self._change_task is not None:
            self._change_task.cancel()
        if self._close_task is not None:
            self._close_task.cancel()
        self._stop_lac_timer()
        self._state = HandleState.CLOSED
        self._error = error
        self._fail_outstanding(error)


def _require_open(md: LedgerMetadata) -> None:
    """The writer's ensemble change is only for an OPEN ledger (docs/replication.md §2)."""
    if md.state is LedgerState.IN_RECOVERY:
        raise LedgerFenced(f"ledger {md.ledger_id} is in recovery: outstanding adds have unknown outcome")
    if md.state is LedgerState.CLOSED:
        raise LedgerClosed(f"ledger {md.ledger_id} was closed at entry {md.last_entry_id}")


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()
