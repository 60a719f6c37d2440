"""Ledger recovery: fence the last fragment, find the last entry, replicate, close (docs/replication.md §4).

The steps, exactly as docs/replication.md §4 and BookKeeper's two TLA+-found bugs require:

1. **IN_RECOVERY** by CAS (OPEN -> IN_RECOVERY). CLOSED: nothing to do, the metadata is the answer.
   IN_RECOVERY: another recoverer started (and maybe died): run recovery too; the close CAS decides.
   From here on the old writer cannot change the ensemble (its CAS finds IN_RECOVERY).
2. **Fence**: READ_ENTRY(-1) with FENCE_LEDGER + master key to every bookie of the *last* fragment.
   EOK / ENOENTRY / ENOLEDGER prove the fence; anything else (EUA, EIO, EUNKNOWNLEDGERSTATE, a
   timeout, a lost connection) does not. Done once the proven bookies cover every write set with
   ``Qw - Qa + 1`` of its members (ensemble coverage): then no write set has ``Qa`` unfenced bookies
   left, so the old writer can complete nothing new. The LAC is the highest header LAC of the
   digest-verified last entries (as BookKeeper's ReadLastConfirmedOp; the response's ``lac`` field
   is covered by no digest), -1 for a reply without one. A bookie whose last entry is unreadable
   (EOK with ``unreadable`` set, no body) or comes back failing its digest is fenced all the same
   (the status proves the fence; the body has nothing to do with it): it counts toward coverage,
   contributes -1, and its copy of that entry stays *unknown* in step 3, never absent (without
   this, two such bookies of a 3-bookie ensemble made the ledger unfenceable forever).
   Start at ``max(that LAC, first entry of the last fragment - 1)``
   (BOOKKEEPER-2615: a fragment is created at the writer's LAC + 1, so everything before it is
   settled; never read or rewrite earlier ones).
3. **Recovery reads** of ``start + 1, start + 2, ...`` to the whole write set, **with FENCE_LEDGER**
   (BOOKKEEPER-2614: a bookie whose fence was lost must be fenced before its "no" is counted,
   otherwise the old writer can still complete the entry on it after we declared it absent).
   Per entry (:func:`decide_entry`): one valid body -> EXISTS; ``Qw - Qa + 1`` NoSuchEntry /
   NoSuchLedger answers -> ABSENT; everything answered and neither -> UNDECIDED, and recovery aborts
   with the retriable :class:`LedgerRecoveryError` (never guess). Timeouts, I/O errors, corrupt
   bodies and EUNKNOWNLEDGERSTATE are *unknown*, never "absent". The last entry is the one before the
   first ABSENT entry; entries after it are ignored even if some bookie has them (docs/replication.md §5).
4. **Write back** every found entry with RECOVERY_ADD (passes the fence) to its whole write set
   (:mod:`bookkeeper_aio.client.recovery_writeback`). A failing bookie is replaced locally: a new fragment
   from the lowest entry not yet fully written, and every entry from there on — including those
   already fully written to the old write set — goes to the replacement before it counts; the
   change is persisted only by the close. Reads and write-backs run in a bounded window of entries
   in flight; decisions are still taken strictly in entry order.
5. **Close** by CAS: CLOSED, last entry, length. If the CAS finds the ledger CLOSED, someone else
   recovered it: adopt their result (concurrent recoveries converge on whichever closed first).

The decision logic is pure (:func:`decide_entry`, :func:`fence_reply_counts`,
:func:`recovery_start`) and tested exhaustively; the async shell only gathers replies.
"""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from bookkeeper_aio.client.connection import Result
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.quorum import schedule_of
from bookkeeper_aio.client.read_handle import EntryReader
from bookkeeper_aio.client.recovery_writeback import WriteBack, describe
from bookkeeper_aio.common import failpoints
from bookkeeper_aio.errors import BKError, BKInternalError, BKTimeout, LedgerRecoveryError, NoSuchLedger
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import LAST_ENTRY, NO_ENTRY, ReadFlag, StatusCode
from bookkeeper_aio.protocol.digest import Entry, EntryCodec
from bookkeeper_aio.protocol.errors import DigestMismatch
from metadata import errors as md_errors
from metadata.ledger_manager import UNCHANGED, VersionedLedger, _Unchanged
from metadata.ledger_metadata import LedgerMetadata, LedgerState

log = structlog.get_logger(__name__)

RECOVERY_READ_FLAGS = int(ReadFlag.FENCE_LEDGER)
"""Every recovery read fences (BOOKKEEPER-2614). The simulation proves the #2614 trace is found
without it: the planted-bug switch ``bug.recovery_read_without_fence`` (common/failpoints.py)."""

RECOVERY_WINDOW_MAX = 512
"""Entries being read or written back at once. Bounds memory (bodies held until replicated) and the
requests a recovery puts on each bookie; 512 keeps ~1,000-entry tails well under a second."""

READ_AHEAD_PAST_HINT = 4
"""Reads issued beyond the highest entry any fenced bookie reported: the end is almost always there,
so reading far past it only costs NoSuchEntry round trips."""


# ---------------------------------------------------------------------------------- pure core
class Reply(enum.Enum):
    """One replica's answer to a recovery read."""

    POSITIVE = "positive"  # EOK with a body that verifies (digest, ledger id, entry id)
    NEGATIVE = "negative"  # ENOENTRY / ENOLEDGER: the bookie knows it does not have the entry
    UNKNOWN = "unknown"  # anything else: timeout, EIO, EUNKNOWNLEDGERSTATE, corrupt body, ...


class Decision(enum.Enum):
    PENDING = "pending"  # not enough replies yet
    EXISTS = "exists"
    ABSENT = "absent"
    UNDECIDED = "undecided"  # every replica answered, neither rule holds: abort, never guess


# What the recovery reads compare against, as module names: on Python 3.11 every ``Enum.MEMBER``
# takes ``EnumType.__getattr__``'s slow attribute path (about 0.3 us), and a recovery read made ten.
_PENDING, _EXISTS = Decision.PENDING, Decision.EXISTS
_ABSENT, _UNDECIDED = Decision.ABSENT, Decision.UNDECIDED
_POSITIVE, _NEGATIVE, _UNKNOWN = Reply.POSITIVE, Reply.NEGATIVE, Reply.UNKNOWN
_EOK = StatusCode.EOK
_OPEN, _IN_RECOVERY, _CLOSED = LedgerState.OPEN, LedgerState.IN_RECOVERY, LedgerState.CLOSED
_FENCE_FLAGS = int(ReadFlag.FENCE_LEDGER)  # the fencing reads' (RECOVERY_READ_FLAGS is the reads')
_NEGATIVE_STATUSES = frozenset((StatusCode.ENOENTRY, StatusCode.ENOLEDGER))
"""The answers that say the bookie does not have the entry."""
_FENCED_STATUSES = _NEGATIVE_STATUSES | {_EOK}
"""The answers to a fencing read that prove the bookie fenced the ledger."""


def classify_read(status: int, body_valid: bool) -> Reply:
    """A recovery read answer as evidence. Only an explicit "I do not have it" is negative."""
    if status == _EOK:
        return _POSITIVE if body_valid else _UNKNOWN
    if status in _NEGATIVE_STATUSES:
        return _NEGATIVE
    return _UNKNOWN


def decide_entry(
    write_quorum: int, ack_quorum: int, positives: int, negatives: int, unknowns: int
) -> Decision:
    """The recovery-read rule (docs/replication.md §4, BOOKKEEPER-1067).

    EXISTS on one valid body: writing it back makes it replicated, and closing after it is correct
    even if it was never acknowledged (docs/replication.md §5). ABSENT on ``Qw - Qa + 1``
    negatives: the bookies that did not say "no" are fewer than ``Qa``, so the entry cannot have
    been acknowledged, and as each negative came from a fenced bookie it never will be. Otherwise
    wait; once every replica answered without either rule holding, UNDECIDED.
    """
    assert 1 <= ack_quorum <= write_quorum
    assert min(positives, negatives, unknowns) >= 0
    assert positives + negatives + unknowns <= write_quorum
    if positives > 0:
        return _EXISTS
    if negatives >= write_quorum - ack_quorum + 1:
        return _ABSENT
    if negatives + unknowns == write_quorum:
        return _UNDECIDED
    return _PENDING


def fence_reply_counts(status: int) -> bool:
    """Does a fencing read's answer prove that the bookie is fenced (counts toward coverage)?"""
    return status in _FENCED_STATUSES


def recovery_start(highest_lac: int, last_fragment_first_entry: int) -> int:
    """The last entry known to be in the ledger before reading forward (BOOKKEEPER-2615 rule)."""
    return max(highest_lac, last_fragment_first_entry - 1)


def last_entry_of(decisions: Sequence[Decision], start: int) -> int | None:
    """Given decisions for ``start + 1, start + 2, ...`` in order: the last entry of the ledger, or
    None when the prefix does not settle it yet. Raises LedgerRecoveryError at an UNDECIDED entry
    that comes before any ABSENT one."""
    last = start
    for decision in decisions:
        if decision is _EXISTS:
            last += 1
        elif decision is _ABSENT:
            return last
        elif decision is _UNDECIDED:
            raise LedgerRecoveryError(f"entry {last + 1}: replies neither prove nor exclude it")
        else:
            return None
    return None


# ---------------------------------------------------------------------------------- results
@dataclass(frozen=True, slots=True)
class RecoveryResult:
    """What a recovery ended with (the stored metadata is the authority)."""

    versioned: VersionedLedger
    recovered_entries: int
    """Entries this recovery found past the fenced LAC and wrote back (0 when adopted)."""
    adopted: bool
    """True when the ledger was already closed (or someone else closed it first)."""


@dataclass(slots=True)
class _Fenced:
    lac: int
    last_entry_hint: int
    lengths: dict[int, int]
    last_stored: dict[str, int]
    """Bookie -> the last entry it reported (verified) when fenced: whom to ask first."""


# ---------------------------------------------------------------------------------- the shell
class LedgerRecovery:
    """One recovery run of one ledger. ``await LedgerRecovery(...).run()``; owns every request it
    sends (late answers are ignored) and leaves nothing running when it returns or raises."""

    def __init__(
        self,
        ctx: ClientContext,
        ledger_id: int,
        codec: EntryCodec,
        key: bytes,
        *,
        window: int = RECOVERY_WINDOW_MAX,
    ) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._ctx = ctx
        self._loop = asyncio.get_running_loop()
        self._ledger_id = ledger_id
        self._codec = codec
        self._key = key
        self._window = window

    async def run(self) -> RecoveryResult:
        versioned = await self._metadata_op(self._ctx.ledgers.update(self._ledger_id, _mark_in_recovery))
        md = versioned.metadata
        if md.state is _CLOSED:
            return RecoveryResult(versioned, 0, adopted=True)
        log.info("recovery.started", ledger_id=self._ledger_id, fragments=len(md.ensembles))
        fenced = await self._fence(md)
        first = md.ensembles[-1][0]
        start = recovery_start(fenced.lac, first)
        if failpoints.switched(failpoints.BUG_RECOVERY_FROM_FENCED_LAC):  # a planted bug (tests/simulation)
            start = fenced.lac
        run = _ReadAndReplicate(self, md, start, fenced)
        try:
            last, last_length = await run.run()
        finally:
            run.abort()
        if last_length is None:
            last_length = await self._length_at(md, last, fenced)
        stored, adopted = await self._close(md, last, last_length, run.writer.fragments)
        result_md = stored.metadata
        log.info(
            "recovery.finished",
            ledger_id=self._ledger_id,
            fenced_lac=fenced.lac,
            start=start,
            last_entry=result_md.last_entry_id,
            recovered=last - start,
            adopted=adopted,
        )
        return RecoveryResult(stored, 0 if adopted else last - start, adopted)

    # ------------------------------------------------------------------ step 2: fence
    async def _fence(self, md: LedgerMetadata) -> _Fenced:
        first, ensemble = md.ensembles[-1]
        schedule = schedule_of(md.ensemble_size, md.write_quorum, md.ack_quorum)
        ctx, ledger_id, key = self._ctx, self._ledger_id, self._key
        floor = first - 1  # the 2615 rule here too: what precedes the last fragment is settled
        if failpoints.switched(failpoints.BUG_RECOVERY_FROM_FENCED_LAC):  # a planted bug (tests/simulation)
            floor = NO_ENTRY
        fenced = _Fenced(lac=floor, last_entry_hint=floor, lengths={}, last_stored={})
        answered: set[int] = set()
        failures: list[str] = []

        def make(rid: int) -> m.Request:
            return m.ReadEntryRequest(rid, ledger_id, LAST_ENTRY, _FENCE_FLAGS, key)

        async def ask(position: int, bookie_id: str) -> tuple[int, str, m.Response | BKError]:
            try:
                return position, bookie_id, await ctx.pool.request(bookie_id, make, ctx.config.read_timeout_s)
            except BKError as error:
                return position, bookie_id, error

        tasks = [asyncio.ensure_future(ask(i, b)) for i, b in enumerate(ensemble)]
        try:
            for next_done in asyncio.as_completed(tasks):
                position, bookie_id, response = await next_done
                if isinstance(response, BKError) or not fence_reply_counts(response.status):
                    failures.append(f"{bookie_id}: {describe(response)}")
                    continue
                self._note_fence_reply(fenced, bookie_id, response)
                answered.add(position)
                if schedule.covers_ensemble(answered):
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if not schedule.covers_ensemble(answered):
            raise LedgerRecoveryError(
                f"ledger {ledger_id}: fencing did not cover the ensemble {list(ensemble)}: {failures}"
            )
        log.info(
            "recovery.fenced",
            ledger_id=ledger_id,
            lac=fenced.lac,
            hint=fenced.last_entry_hint,
            first_entry=first,
        )
        return fenced

    def _note_fence_reply(self, fenced: _Fenced, bookie_id: str, response: m.Response) -> None:
        """Take a proven fence's evidence.

        The LAC is the header ``lac`` of the digest-verified last entry, never the response's
        ``lac`` field: no digest covers that (the bookie keeps the maximum of unverified header
        LACs and WRITE_LAC values; bit rot above the bookie's record check or a bogus WRITE_LAC
        inflates it), and an inflated one would start the reads past entries that still need
        writing back, or close the ledger at an entry that does not exist. A reply without a
        verified body (no entry, no ledger, a last entry the bookie cannot read, one failing the
        digest) contributes -1; a lower start is always safe, it only reads more. Its last entry
        is not taken as stored either (the hint stays): reads of it go to every replica.
        """
        body = getattr(response, "body", None)
        if body is None:
            if getattr(response, "unreadable", False):
                log.warning(
                    "recovery.fenced_last_entry_unreadable",
                    ledger_id=self._ledger_id,
                    bookie=bookie_id,
                    entry_id=getattr(response, "entry_id", NO_ENTRY),
                )
            return
        entry_id = getattr(response, "entry_id", NO_ENTRY)
        try:
            entry = self._codec.decode(body, self._ledger_id, entry_id)
        except DigestMismatch as mismatch:
            log.warning(
                "recovery.corrupt_fence_reply",
                ledger_id=self._ledger_id,
                bookie=bookie_id,
                error=str(mismatch),
            )
            return
        fenced.lac = max(fenced.lac, entry.lac)
        fenced.last_entry_hint = max(fenced.last_entry_hint, entry_id)
        fenced.lengths[entry_id] = entry.length
        fenced.last_stored[bookie_id] = entry_id

    # ------------------------------------------------------------------ step 5: close
    async def _length_at(self, md: LedgerMetadata, entry_id: int, fenced: _Fenced) -> int:
        """Ledger length up to ``entry_id`` when no entry past it was recovered (plain read)."""
        if entry_id < 0:
            return 0
        known = fenced.lengths.get(entry_id)
        if known is not None:
            return known
        entry = await EntryReader(self._ctx, md, self._codec).read_entry(entry_id)
        return entry.length

    async def _close(
        self, md: LedgerMetadata, last: int, length: int, fragments: list[tuple[int, tuple[str, ...]]]
    ) -> tuple[VersionedLedger, bool]:
        adopted = False

        def transform(current: LedgerMetadata) -> LedgerMetadata | _Unchanged:
            nonlocal adopted
            if current.state is _CLOSED:
                adopted = True
                return UNCHANGED
            if current.state is not _IN_RECOVERY:
                raise BKInternalError(f"ledger {self._ledger_id} went back to {current.state.name}")
            # What recovery judged lies in the last fragment (it read from its first entry - 1 on):
            # a change there voids its decisions. An earlier fragment healed meanwhile (an
            # autorecovery worker re-replicating a lost bookie's copies) does not: it is kept.
            if len(current.ensembles) != len(md.ensembles) or current.ensembles[-1] != md.ensembles[-1]:
                raise LedgerRecoveryError(f"ledger {self._ledger_id}: fragments changed during recovery")
            proposed = current
            for first, ensemble in fragments:
                if first <= last:  # a fragment past the last entry would be empty
                    proposed = proposed.with_ensemble_change(first, ensemble)
            return proposed.closed(last, length)

        stored = await self._metadata_op(self._ctx.ledgers.update(self._ledger_id, transform))
        if adopted:
            log.info(
                "recovery.adopted",
                ledger_id=self._ledger_id,
                ours=last,
                theirs=stored.metadata.last_entry_id,
            )
        assert stored.metadata.state is _CLOSED
        return stored, adopted

    async def _metadata_op(self, operation: Any) -> VersionedLedger:
        try:
            async with asyncio.timeout(self._ctx.config.metadata_timeout_s):
                result: VersionedLedger = await operation
                return result
        except md_errors.NoSuchLedger as error:
            raise NoSuchLedger(f"ledger {self._ledger_id} does not exist") from error
        except TimeoutError as error:
            raise BKTimeout(f"ledger {self._ledger_id}: metadata did not answer in time") from error
        except md_errors.MetadataError as error:
            raise LedgerRecoveryError(f"ledger {self._ledger_id}: metadata: {error!r}") from error


def _mark_in_recovery(current: LedgerMetadata) -> LedgerMetadata | _Unchanged:
    if current.state is _OPEN:
        return current.in_recovery()
    return UNCHANGED  # CLOSED: done; IN_RECOVERY: join


# ---------------------------------------------------------------------------------- steps 3 + 4
class _EntryRead:
    """One recovery read of one entry; decided by callbacks.

    An entry some fenced bookie reported as stored (up to the fence's hint) is first asked of one
    replica: a body settles it. Any other answer, or no answer within the speculative read delay,
    sends the read to the rest of the write set. Entries past the hint go to the whole write set at
    once (the end needs ``Qw - Qa + 1`` negatives). Every copy of the read carries the fence flag.
    """

    __slots__ = (
        "body",
        "corrupt",
        "decision",
        "entry",
        "entry_id",
        "frame",
        "future",
        "negatives",
        "positives",
        "replicas",
        "rid",
        "run",
        "sent",
        "timer",
        "unknowns",
    )

    def __init__(self, run: _ReadAndReplicate, entry_id: int, replicas: tuple[str, ...]) -> None:
        self.run = run
        self.entry_id = entry_id
        self.replicas = replicas
        self.sent = 0
        self.rid = 0
        self.frame = b""
        self.timer: asyncio.TimerHandle | None = None
        self.positives = 0
        self.negatives = 0
        self.unknowns = 0
        self.corrupt = 0
        """Unknowns that were a copy the replica holds but cannot give intact (EIO, a body
        failing the digest): never absent; only named in the error when the entry stays undecided."""
        self.decision = _PENDING
        self.entry: Entry | None = None
        self.body = b""
        self.future: asyncio.Future[None] = run.loop.create_future()


def _on_recovery_read(op: _EntryRead, bookie_id: str, result: Result) -> None:
    if op.decision is not _PENDING:
        return  # decided already (first rule to hold wins; both outcomes are correct, docs/replication.md §5)
    run = op.run
    if isinstance(result, BKError):
        reply = _UNKNOWN
    else:
        body = getattr(result, "body", None)
        valid = False
        if result.status == _EOK and body is not None:
            try:
                op.entry = run.codec.decode(body, run.ledger_id, op.entry_id)
                op.body = body
                valid = True
            except DigestMismatch as mismatch:
                log.warning(
                    "recovery.corrupt_replica",
                    ledger_id=run.ledger_id,
                    entry_id=op.entry_id,
                    bookie=bookie_id,
                    error=str(mismatch),
                )
        reply = classify_read(result.status, valid)
        if reply is _UNKNOWN and (result.status == StatusCode.EIO or body is not None):
            op.corrupt += 1
    if reply is _POSITIVE:
        op.positives += 1
    elif reply is _NEGATIVE:
        op.negatives += 1
    else:
        op.unknowns += 1
    op.decision = decide_entry(run.write_quorum, run.ack_quorum, op.positives, op.negatives, op.unknowns)
    if op.decision is _PENDING:
        if op.sent < len(op.replicas):
            run.fan_out(op)
        return
    if op.timer is not None:
        op.timer.cancel()
        op.timer = None
    if not op.future.done():
        op.future.set_result(None)


class _ReadAndReplicate:
    """Steps 3 and 4: read forward in a window, decide in order, write back what exists."""

    def __init__(self, owner: LedgerRecovery, md: LedgerMetadata, start: int, fenced: _Fenced) -> None:
        self.loop = owner._loop
        self.ctx = owner._ctx
        self.codec = owner._codec
        self.ledger_id = md.ledger_id
        self.write_quorum = md.write_quorum
        self.ack_quorum = md.ack_quorum
        self.window = owner._window
        self.start = start
        self.hint = fenced.last_entry_hint
        self._last_stored = fenced.last_stored
        self.schedule = schedule_of(md.ensemble_size, md.write_quorum, md.ack_quorum)
        self.ensemble = md.ensembles[-1][1]  # every entry past `start` lives in the last fragment
        self.writer = WriteBack(self.ctx, self.ledger_id, self.schedule, self.ensemble, owner._key, start)
        self._read_timeout_s = self.ctx.config.read_timeout_s
        self._speculative_delay_s = self.ctx.config.speculative_read_delay_ms / 1000
        self._reads: collections.deque[_EntryRead] = collections.deque()
        self._read_flags = RECOVERY_READ_FLAGS
        if failpoints.switched(
            failpoints.BUG_RECOVERY_READ_WITHOUT_FENCE
        ):  # a planted bug (tests/simulation)
            self._read_flags = 0

    def _send_read(self, entry_id: int) -> None:
        replicas = tuple(self.ensemble[p] for p in self.schedule.write_set(entry_id))
        if entry_id <= self.hint:  # first the replicas that said they store it
            stored = self._last_stored
            replicas = tuple(sorted(replicas, key=lambda b: stored.get(b, -1) < entry_id))
        op = _EntryRead(self, entry_id, replicas)
        op.rid = rid = self.ctx.pool.next_request_id()  # unique per pool: one frame for every replica
        op.frame = m.encode(
            m.ReadEntryRequest(rid, self.ledger_id, entry_id, self._read_flags, self.writer.key)
        )
        self._reads.append(op)
        if entry_id > self.hint or self._speculative_delay_s <= 0:
            self.fan_out(op)
            return
        self._send_to(op, 1)
        op.timer = self.loop.call_later(self._speculative_delay_s, self.fan_out, op)

    def _send_to(self, op: _EntryRead, count: int) -> None:
        pool = self.ctx.pool
        while op.sent < count:
            bookie_id = op.replicas[op.sent]
            op.sent += 1
            pool.connection(bookie_id).request(op.rid, op.frame, _on_recovery_read, op, self._read_timeout_s)

    def fan_out(self, op: _EntryRead) -> None:
        """Ask the replicas not asked yet (a non-positive answer came, or the first was slow)."""
        if op.timer is not None:
            op.timer.cancel()
            op.timer = None
        if op.decision is _PENDING:
            self._send_to(op, len(op.replicas))

    async def run(self) -> tuple[int, int | None]:
        """(last entry, its length if known from a recovered body)."""
        last, length = self.start, None
        next_read = self.start + 1
        reads, writer = self._reads, self.writer
        decided: list[Decision] = []
        while True:
            ahead_max = max(self.hint, last) + READ_AHEAD_PAST_HINT
            while not reads or (len(reads) + writer.outstanding < self.window and next_read <= ahead_max):
                self._send_read(next_read)
                next_read += 1
            head = reads[0]
            await writer.wait(head.future)
            reads.popleft()
            assert head.entry_id == last + 1, (head.entry_id, last)
            decided.append(head.decision)
            if head.decision is _ABSENT:
                break
            if head.decision is _UNDECIDED:
                raise LedgerRecoveryError(self._undecided(head))
            assert head.decision is _EXISTS
            assert head.entry is not None
            last, length = head.entry_id, head.entry.length
            writer.add(head.entry_id, head.body)
        await writer.drain()
        assert last_entry_of(decided, self.start) == last  # the loop is the pure rule, incrementally
        return last, length

    def _undecided(self, op: _EntryRead) -> str:
        what = (
            f"ledger {self.ledger_id} entry {op.entry_id}: {op.positives} present, {op.negatives} "
            f"absent, {op.unknowns} unknown of {self.write_quorum}: cannot decide"
        )
        if not op.corrupt:
            return f"{what} (retry the recovery)"
        return (
            f"{what}: {op.corrupt} replica(s) could not give an intact copy (EIO: corrupt on disk "
            "or an I/O error; or a body failing its digest). A copy that cannot be read is never "
            "taken as absent, so the ledger is not closed before this entry: retry once a replica "
            "holding a good copy is back; if there is none, the entry is damaged on every replica "
            "(the bookies' logs name the records) and must be restored before the ledger can close"
        )

    def abort(self) -> None:
        for op in self._reads:
            op.decision = _UNDECIDED  # late answers are ignored
            if op.timer is not None:
                op.timer.cancel()
                op.timer = None
        self._reads.clear()
        self.writer.abort()


async def recover_ledger(
    ctx: ClientContext, ledger_id: int, codec: EntryCodec, key: bytes, *, window: int = RECOVERY_WINDOW_MAX
) -> RecoveryResult:
    """Run recovery once (see the module docstring). Raises LedgerRecoveryError (retriable: replies
    could not decide an entry, fencing could not cover the ensemble, metadata trouble),
    NoSuchLedger, BKTimeout. Reports ``recovery_finished`` to the client's metrics hooks."""
    started = asyncio.get_running_loop().time()
    result = await LedgerRecovery(ctx, ledger_id, codec, key, window=window).run()
    if ctx.metrics is not None:
        elapsed = asyncio.get_running_loop().time() - started
        ctx.metrics.recovery_finished(ledger_id, elapsed, result.recovered_entries)
    return result


async def fence_ledger(ctx: ClientContext, md: LedgerMetadata, codec: EntryCodec) -> None:
    """Step 2 alone: fence the last fragment of ``md`` with the codec's master key, until the
    proven fences cover the ensemble (a live writer can then complete no add). What deleting an
    open ledger does first. Raises LedgerRecoveryError (retriable: too few bookies proved it; a
    wrong key shows as their EUA in the message)."""
    await LedgerRecovery(ctx, md.ledger_id, codec, codec.master_key)._fence(md)
