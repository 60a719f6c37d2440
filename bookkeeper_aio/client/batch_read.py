"""Sequential range reads with BATCH_READ (docs/protocol.md §3.8, §7.6).

When every bookie of a fragment holds every entry of it (``Qw == E``), one BATCH_READ returns a run
of consecutive entries from one replica. With striping (``Qw < E``) a bookie holds no long run, but
entries ``e``, ``e + E``, ``e + 2E`` ... share one write set: one BATCH_READ with ``step`` E returns
such a stripe, and E stripes merged make the run (:func:`read_range_striped`).

Rules, the same guarantees as single reads (read_handle.py):

- A batch never crosses a fragment boundary (the replicas change there) nor the range asked for
  (never past the LAC / the last entry of a closed ledger): extra bodies in an answer are ignored.
- Every body is verified (digest, ledger id, entry id ``start + i``) before it is handed out. A
  corrupt body ends what is taken from that answer: the entries from it on are asked of the next
  replica; the corrupt replica is logged, never returned.
- An error, a timeout or an answer with nothing new → the next replica, for the entries still
  missing. After ``speculative_read_delay_ms`` without an answer the next replica is asked too; any
  answer extending the verified prefix is taken.
- A short batch (the bookie stopped early: byte budget, a gap, an unreadable entry) proves nothing
  about the entries after it: its prefix is handed out and the rest is asked for again, first
  replica first. When no replica gave even the first entry of a batch, that entry is read with a
  single read (:meth:`EntryReader.read_entry`), whose failover and errors (NoSuchEntry only when
  every replica said so) are the reference; then batching resumes after it.
- Entries are yielded in order. At most ``read_window_max`` entries are asked for at a time, in
  batches of at most ``batch_read_count_max`` entries, and the batches in flight together ask for
  at most ``batch_read_bytes_max`` bytes (a bookie always returns a batch's first entry, so one
  entry larger than a batch's share can exceed it).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog

from bookkeeper_aio.client.connection import Result
from bookkeeper_aio.client.speculation import SpeculativeOp
from bookkeeper_aio.errors import BKError
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import BATCH_READ_COUNT_MAX, StatusCode
from bookkeeper_aio.protocol.digest import Entry
from bookkeeper_aio.protocol.errors import DigestMismatch

if TYPE_CHECKING:
    from bookkeeper_aio.client.read_handle import EntryReader

log = structlog.get_logger(__name__)

_EOK = StatusCode.EOK
"""As a module name, asked on every batch answer: ``StatusCode.EOK`` goes through
``EnumType.__getattr__``'s slow attribute path on Python 3.11 (about 0.3 us)."""

BATCHES_IN_FLIGHT = 4
"""The read window is split into this many batches, so answers keep arriving while earlier ones
are decoded and consumed."""
RESPONSE_OVERHEAD_BYTES = 64 * 1024
"""Room for a response's envelope (and per-body framing) beside the bodies, under the frame limit."""


def can_batch(reader: EntryReader) -> bool:
    """Whether ranges of ``reader`` are read in batches: every bookie holds every entry (``Qw ==
    E``), a plain read (no fencing flags) and batches of more than one entry allowed."""
    schedule = reader.schedule
    return (
        schedule.write_quorum == schedule.ensemble_size
        and reader.flags == 0
        and reader.ctx.config.batch_read_count_max > 1
    )


class _BatchOp(SpeculativeOp):
    """Entries ``first, first + step, ..., last`` of one fragment, read from their replicas one
    batch at a time (``step`` > 1: one stripe of a striped ledger, entries sharing a write set).

    ``future`` resolves with the verified prefix received (all of it, part of it or nothing); it
    never fails: the caller decides what to do with what is missing.
    """

    __slots__ = (
        "bytes_max",
        "entries",
        "first",
        "future",
        "last",
        "next_replica",
        "outstanding",
        "reader",
        "replicas",
        "started",
        "step",
    )

    def __init__(self, reader: EntryReader, first: int, last: int, bytes_max: int, step: int = 1) -> None:
        assert (last - first) % step == 0, "last is on first's stripe"
        self.reader = reader
        self.first = first
        self.last = last
        self.step = step
        self.bytes_max = bytes_max
        self.replicas = reader.replicas(first)
        self.next_replica = 0
        self.outstanding = 0
        self.entries: list[Entry] = []
        self.future: asyncio.Future[list[Entry]] = reader.loop.create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.started = reader.loop.time()

    @property
    def count(self) -> int:
        return (self.last - self.first) // self.step + 1

    def send_next(self) -> bool:
        """Ask the next replica for the entries still missing; False when none is left."""
        if self.next_replica >= len(self.replicas):
            return False
        bookie_id = self.replicas[self.next_replica]
        self.next_replica += 1
        self.outstanding += 1
        reader, step = self.reader, self.step
        ledger_id, start, bytes_max = reader.ledger_id, self.first + len(self.entries) * step, self.bytes_max
        count = (self.last - start) // step + 1
        key = reader.master_key
        reader.ctx.pool.request_with_callback(
            bookie_id,
            lambda rid: m.BatchReadRequest(rid, ledger_id, start, count, bytes_max, 0, key, step),
            _on_batch_result,
            (self, start),
            reader.ctx.config.read_timeout_s,
        )
        return True

    def resolve(self) -> None:
        self.finish()
        self.future.set_result(self.entries)


def _on_batch_result(context: tuple[_BatchOp, int], bookie_id: str, result: Result) -> None:
    op, start = context
    op.outstanding -= 1
    if op.future.done():
        return  # a slower replica or a speculative duplicate: ignored
    reader = op.reader
    taken = len(op.entries)
    healthy = False  # an answer that only stopped early (no error, nothing corrupt)
    if isinstance(result, BKError):
        log.debug(
            "read.batch_failed", ledger_id=reader.ledger_id, start=start, bookie=bookie_id, error=str(result)
        )
    elif result.status != _EOK:
        log.debug(
            "read.batch_failed",
            ledger_id=reader.ledger_id,
            start=start,
            bookie=bookie_id,
            status=result.status,
        )
    elif (
        getattr(result, "start_entry_id", None) != start
        or getattr(result, "ledger_id", None) != reader.ledger_id
    ):
        log.warning(
            "read.batch_bad_answer",
            ledger_id=reader.ledger_id,
            start=start,
            bookie=bookie_id,
            answered=(getattr(result, "ledger_id", None), getattr(result, "start_entry_id", None)),
        )
    else:
        bodies = getattr(result, "bodies", [])
        if getattr(result, "step", 1) != op.step:
            # A bookie that does not know ``step`` answered consecutive entries: only the first is
            # one of ours; the caller asks again for the rest (one entry per answer from it).
            bodies = bodies[:1]
        healthy = _take(op, bookie_id, start, bodies)
    if len(op.entries) == op.count:
        op.resolve()
        return
    if healthy and len(op.entries) > taken:
        op.resolve()  # short but sound: the caller asks again for the rest
        return
    if op.send_next():  # this replica cannot give the next entry: the next one is asked
        if op.timer is None:
            op.arm_speculation()
        return
    if op.outstanding == 0:
        op.resolve()  # every replica tried: the caller falls back to a single read


def _take(op: _BatchOp, bookie_id: str, start: int, bodies: list[bytes]) -> bool:
    """Verify and append the bodies extending ``op.entries``; False if one was corrupt."""
    reader = op.reader
    entries = op.entries
    step = op.step
    wanted = op.first + len(entries) * step
    skip = max(0, (wanted - start) // step)  # bodies of entries taken already (from another answer)
    room = (op.last - wanted) // step + 1  # never past the range
    taken = len(entries)
    try:
        first_body = start + skip * step
        reader.codec.decode_run(bodies[skip : skip + room], reader.ledger_id, first_body, step, entries)
    except DigestMismatch as mismatch:
        log.warning(
            "read.corrupt_replica",
            ledger_id=reader.ledger_id,
            entry_id=start + (skip + len(entries) - taken) * step,
            bookie=bookie_id,
            error=str(mismatch),
        )
        return False
    finally:
        metrics = reader.metrics
        if metrics is not None:
            latency_s = reader.loop.time() - op.started
            for _ in range(len(entries) - taken):
                metrics.read_completed(latency_s)
    return True


def _fragment_last(reader: EntryReader, entry_id: int) -> int | None:
    """The last entry of the fragment holding ``entry_id`` (None for the last fragment)."""
    ensembles = reader.metadata.ensembles
    index = bisect.bisect_right(ensembles, entry_id, key=lambda fragment: fragment[0])
    return ensembles[index][0] - 1 if index < len(ensembles) else None


async def read_range_batched(reader: EntryReader, first: int, last: int) -> AsyncIterator[Entry]:
    """Entries ``first..last`` in order, read in BATCH_READs (see the module's rules)."""
    config = reader.ctx.config
    window = config.read_window_max
    count_max = max(
        1, min(config.batch_read_count_max, BATCH_READ_COUNT_MAX, -(-window // BATCHES_IN_FLIGHT))
    )
    batches_max = -(-window // count_max)
    frame_room = max(1, config.frame_bytes_max - RESPONSE_OVERHEAD_BYTES)
    bytes_max = max(1, min(config.batch_read_bytes_max // batches_max, frame_room))
    ops: collections.deque[_BatchOp] = collections.deque()
    asked = 0  # entries covered by the ops in ``ops``
    next_id = first

    def start(begin: int, end: int) -> _BatchOp:
        op = _BatchOp(reader, begin, end, bytes_max)
        op.future.add_done_callback(_retrieve)
        op.send_next()
        op.arm_speculation()
        return op

    try:
        while next_id <= last or ops:
            while next_id <= last and asked < window:
                end = min(last, next_id + count_max - 1, next_id + window - asked - 1)
                fragment_last = _fragment_last(reader, next_id)
                if fragment_last is not None:
                    end = min(end, fragment_last)
                ops.append(start(next_id, end))
                asked += end - next_id + 1
                next_id = end + 1
            op = ops.popleft()
            asked -= op.count
            entries = await op.future
            rest = op.first + len(entries)
            if not entries:  # no replica gave it in a batch: a single read decides (or raises)
                if rest < op.last:
                    ops.appendleft(start(rest + 1, op.last))
                    asked += op.last - rest
                yield await reader.read_entry(rest)
                continue
            if rest <= op.last:  # a short batch: the rest is asked for at once, before later ones
                ops.appendleft(start(rest, op.last))
                asked += op.last - rest + 1
            for entry in entries:
                yield entry
    finally:
        for op in ops:
            op.finish()
            if not op.future.done():
                op.future.cancel()


def can_batch_striped(reader: EntryReader) -> bool:
    """Whether ranges of a striped ledger (``Qw < E``) are read as stripes of BATCH_READs with a
    step (see :func:`read_range_striped`): a plain read, batches of more than one entry allowed."""
    schedule = reader.schedule
    return (
        schedule.write_quorum < schedule.ensemble_size
        and reader.flags == 0
        and reader.ctx.config.batch_read_count_max > 1
    )


async def read_range_striped(reader: EntryReader, first: int, last: int) -> AsyncIterator[Entry]:
    """Entries ``first..last`` of a striped ledger (``Qw < E``), in order.

    Entries ``e`` and ``e + E`` have the same write set, so a run of consecutive entries is read as
    E stripes: stripe ``r`` asks the replicas of its first entry for every E-th entry with one
    BATCH_READ of step E (its replicas hold all of them), with the failover, speculation and
    verification of :class:`_BatchOp`; the stripes are merged back in entry order. A stripe cut
    short is asked again from its first missing entry; an entry no replica gives in a batch is read
    with a single read, whose errors are the reference. A bookie that ignores the step (older
    than the field) gives one entry per answer: slower, still correct.
    """
    config = reader.ctx.config
    stripes = reader.schedule.ensemble_size
    window = config.read_window_max
    count_max = max(
        1,
        min(config.batch_read_count_max, BATCH_READ_COUNT_MAX, -(-window // (BATCHES_IN_FLIGHT * stripes))),
    )
    chunk_entries = count_max * stripes
    ops_max = stripes * -(-window // chunk_entries)
    frame_room = max(1, config.frame_bytes_max - RESPONSE_OVERHEAD_BYTES)
    bytes_max = max(1, min(config.batch_read_bytes_max // ops_max, frame_room))
    chunks: collections.deque[list[_BatchOp]] = collections.deque()
    live: set[_BatchOp] = set()  # every op not yet consumed: stopped if the reader goes away
    asked = 0
    next_id = first

    def start(begin: int, end: int) -> _BatchOp:
        op = _BatchOp(reader, begin, end, bytes_max, stripes)
        live.add(op)
        op.future.add_done_callback(_retrieve)
        op.send_next()
        op.arm_speculation()
        return op

    def start_chunk(begin: int, end: int) -> list[_BatchOp]:
        heads = range(begin, min(end, begin + stripes - 1) + 1)
        return [start(head, head + (end - head) // stripes * stripes) for head in heads]

    async def complete(op: _BatchOp) -> list[Entry]:
        entries = list(await op.future)
        live.discard(op)
        while len(entries) < op.count:
            missing = op.first + len(entries) * stripes
            rest = start(missing, op.last)
            more = await rest.future
            live.discard(rest)
            entries += more if more else [await reader.read_entry(missing)]
        return entries

    try:
        while next_id <= last or chunks:
            while next_id <= last and asked < window:
                end = min(last, next_id + chunk_entries - 1)
                fragment_last = _fragment_last(reader, next_id)
                if fragment_last is not None:
                    end = min(end, fragment_last)
                chunks.append(start_chunk(next_id, end))
                asked += end - next_id + 1
                next_id = end + 1
            ops = chunks.popleft()
            asked -= sum(op.count for op in ops)
            merged = [await complete(op) for op in ops]
            for i in range(sum(len(stripe) for stripe in merged)):
                yield merged[i % len(ops)][i // len(ops)]
    finally:
        for op in live:
            op.finish()
            if not op.future.done():
                op.future.cancel()


def _retrieve(future: asyncio.Future[list[Entry]]) -> None:
    if not future.cancelled():
        future.exception()
