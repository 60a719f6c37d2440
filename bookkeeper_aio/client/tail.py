"""Tailing a ledger that is still being written: ``async for entry in handle.tail(from_entry)``.

Rules (docs/replication.md §6):

- Entries up to the known LAC are read with normal (windowed) reads: a tailing reader that is behind
  catches up at read-range speed.
- Caught up, it sends a long poll (READ_ENTRY LONG_POLL + ENTRY_PIGGYBACK, ``previous_lac`` = LAC,
  entry LAC + 1) to every bookie of the last fragment. The first answer whose LAC passed ours wins:
  its LAC is adopted (a bookie only knows LACs the writer sent, so every entry up to it was acked)
  and the piggybacked entry, once its digest verifies, is handed out without another round trip.
  Slower answers are ignored; each long poll is bounded by ``long_poll_timeout_ms``.
- ENOLEDGER (the bookie has not received this ledger's first entry yet), errors, and answers that
  come back at once without progress (the ledger is fenced) mean "nothing yet": back off (bounded,
  exponential) and try again. They never end the tail.
- A read up to the LAC that fails re-reads the metadata once before the error is raised: the LAC
  may have come (from a long poll) from a fragment the watch has not delivered yet, and then the
  entries are read again from the fragment that holds them.
- The ledger metadata is watched for the whole iteration: a new fragment moves the LAC to at least
  its first entry - 1 (the writer made it at LAC + 1) and redirects reads and polls; CLOSED bounds
  the reader by the metadata's last entry (never a bookie's LAC), and the iteration ends once that
  entry was handed out. A deleted ledger raises NoSuchLedger.
- The watch task belongs to the iteration: it is cancelled and awaited when the iteration ends,
  fails, or is closed early (``aclose()``, or leaving an ``async with aclosing(...)`` block).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import structlog

from bookkeeper_aio.client.connection import Result
from bookkeeper_aio.errors import BKError, NoSuchLedger
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import LONG_POLL_TIMEOUT_MS_MAX, ReadFlag, StatusCode
from bookkeeper_aio.protocol.digest import Entry
from bookkeeper_aio.protocol.errors import DigestMismatch
from metadata.errors import MetadataError
from metadata.ledger_manager import VersionedLedger

if TYPE_CHECKING:
    from bookkeeper_aio.client.read_handle import ReadHandle

log = structlog.get_logger(__name__)

LONG_POLL_TIMEOUT_MS = 10_000
"""How long one long poll may wait at a bookie. Closing is noticed through the metadata watch, so
this only bounds how long a silent bookie can hold a request."""
BACKOFF_S_INITIAL = 0.002
BACKOFF_S_MAX = 0.5
"""Pause after a poll round that made no progress without waiting (ENOLEDGER, fenced, errors)."""
WATCH_RETRY_S_MAX = 2.0

_POLL_FLAGS = int(ReadFlag.LONG_POLL | ReadFlag.ENTRY_PIGGYBACK)


class _Poll:
    """One long-poll round to the bookies of the last fragment; completed by callbacks."""

    __slots__ = ("answers", "expected", "future", "handle", "previous_lac")

    def __init__(self, handle: ReadHandle, previous_lac: int, expected: int) -> None:
        self.handle = handle
        self.previous_lac = previous_lac
        self.expected = expected
        self.answers = 0
        self.future: asyncio.Future[tuple[int, Entry | None] | None] = (
            asyncio.get_running_loop().create_future()
        )


def _on_poll(poll: _Poll, bookie_id: str, result: Result) -> None:
    poll.answers += 1
    if poll.future.done():
        return
    if not isinstance(result, BKError) and result.status == StatusCode.EOK:
        lac = getattr(result, "lac", -1)
        if lac > poll.previous_lac:
            entry = None
            body = getattr(result, "body", None)
            wanted = poll.previous_lac + 1
            if body is not None:
                try:
                    entry = poll.handle._codec.decode(body, poll.handle.id, wanted)
                except DigestMismatch as mismatch:
                    log.warning(
                        "tail.corrupt_piggyback",
                        ledger_id=poll.handle.id,
                        bookie=bookie_id,
                        error=str(mismatch),
                    )
            poll.future.set_result((lac, entry))
            return
    if poll.answers >= poll.expected:
        poll.future.set_result(None)  # no progress from anyone


class Tail:
    """The state of one tailing iteration (see the module docstring)."""

    def __init__(self, handle: ReadHandle, from_entry: int, long_poll_timeout_ms: int) -> None:
        self._handle = handle
        self._next = from_entry
        self._timeout_ms = min(long_poll_timeout_ms, LONG_POLL_TIMEOUT_MS_MAX)
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[object] | None = None
        self._error: BaseException | None = None
        self._watch: asyncio.Task[None] | None = None
        self._changes = 0

    async def entries(self) -> AsyncGenerator[Entry, None]:
        handle = self._handle
        self._watch = self._loop.create_task(self._follow(), name=f"tail watch {handle.id}")
        backoff_s = BACKOFF_S_INITIAL
        try:
            while True:
                self._check()
                lac = handle.last_add_confirmed
                if self._next <= lac:
                    try:
                        async for entry in handle._reader.read_range(self._next, lac):
                            yield entry
                            self._next = entry.entry_id + 1
                    except BKError:
                        if await self._refreshed():
                            continue  # the LAC came from a fragment it did not know: read again
                        raise
                    backoff_s = BACKOFF_S_INITIAL
                    continue
                if handle.is_closed:
                    return
                started, changes = self._loop.time(), self._changes
                outcome = await self._long_poll(lac)
                if outcome is None:
                    if changes != self._changes:
                        continue  # the metadata moved (new fragment, closed): look again at once
                    if self._loop.time() - started < self._timeout_ms / 2000:
                        await self._sleep(backoff_s)  # answered at once without progress
                        backoff_s = min(backoff_s * 2, BACKOFF_S_MAX)
                    continue
                backoff_s = BACKOFF_S_INITIAL
                new_lac, piggybacked = outcome
                handle._advance_lac(new_lac)
                if (
                    piggybacked is not None
                    and piggybacked.entry_id == self._next <= handle.last_add_confirmed
                ):
                    yield piggybacked  # acked: the LAC passed it; verified in _on_poll
                    self._next += 1
        finally:
            watch, self._watch = self._watch, None
            if watch is not None:
                watch.cancel()
                try:
                    await watch
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # our caller's cancel, not only the watch's: pass it on

    async def _refreshed(self) -> bool:
        """Read the metadata now (the watch may lag, or be down and retrying): whether it changed.
        A LAC from a long poll may lie in a fragment the handle has not seen yet, whose entries the
        old fragment's bookies do not hold (NoSuchEntry, or all of them gone): read with the
        fragment that holds them, they are there."""
        handle = self._handle
        try:
            return self._apply(await handle._ctx.ledgers.read(handle.id))
        except MetadataError as error:
            log.info("tail.metadata_read_failed", ledger_id=handle.id, error=repr(error))
            return False

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    async def _long_poll(self, lac: int) -> tuple[int, Entry | None] | None:
        """Result of one round: (new LAC, piggybacked entry or None), or None for no progress (also
        when the metadata changed meanwhile: the caller re-evaluates)."""
        handle = self._handle
        ensemble = handle.metadata.ensembles[-1][1]
        poll = _Poll(handle, lac, len(ensemble))
        pool = handle._ctx.pool
        timeout_s = self._timeout_ms / 1000 + handle._ctx.config.read_timeout_s
        rid = pool.next_request_id()
        frame = m.encode(
            m.ReadEntryRequest(
                rid, handle.id, lac + 1, _POLL_FLAGS, handle._codec.master_key, lac, self._timeout_ms
            )
        )
        for bookie_id in ensemble:
            pool.connection(bookie_id).request(rid, frame, _on_poll, poll, timeout_s)
        return await self._wait(poll.future)

    async def _wait(
        self, future: asyncio.Future[tuple[int, Entry | None] | None]
    ) -> tuple[int, Entry | None] | None:
        self._waiter = future  # type: ignore[assignment]
        try:
            return await future
        finally:
            self._waiter = None

    async def _sleep(self, delay_s: float) -> None:
        future: asyncio.Future[tuple[int, Entry | None] | None] = self._loop.create_future()
        timer = self._loop.call_later(delay_s, _resolve, future)
        try:
            await self._wait(future)
        finally:
            timer.cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _follow(self) -> None:
        """Apply every metadata change to the handle; wake the iteration when one lands."""
        handle = self._handle
        retry_s = BACKOFF_S_INITIAL
        try:
            while True:
                try:
                    async for versioned in handle._ctx.ledgers.watch(handle.id):
                        if versioned is None:
                            raise NoSuchLedger(f"ledger {handle.id} was deleted while being tailed")
                        retry_s = BACKOFF_S_INITIAL
                        if self._apply(versioned):
                            self._wake()
                        if versioned.metadata.is_closed:
                            return
                except MetadataError as error:
                    log.info("tail.watch_failed", ledger_id=handle.id, error=repr(error))
                    await asyncio.sleep(retry_s)
                    retry_s = min(retry_s * 2, WATCH_RETRY_S_MAX)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the iteration fails with whatever killed its watch
            self._error = error
            self._wake()
            if not isinstance(error, Exception):
                raise

    def _apply(self, versioned: VersionedLedger) -> bool:
        changed = self._handle._apply_metadata(versioned)
        if changed:
            self._changes += 1
        return changed


def _resolve(future: asyncio.Future[tuple[int, Entry | None] | None]) -> None:
    if not future.done():
        future.set_result(None)
