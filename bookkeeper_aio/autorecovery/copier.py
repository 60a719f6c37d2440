"""The copy step of re-replication: a fragment's entries, read from surviving replicas, written to
the bookies that replace the missing ones, before the fragment's new ensemble is published.

Rules (docs/autorecovery.md):

- Only the entries a replacement must hold are copied: those whose write set includes the position
  it takes (with striping, E > Qw, a bookie holds only some entries of a fragment).
- Entries that share a write set are read in batches (BATCH_READ) from a survivor of it, each body
  verified: with Qw == E every entry, with striping (E > Qw) each stripe ``e, e + E, ...`` (step E);
  an entry a batch did not return is read on its own.
- An entry is read from the other members of its write set that stay (the survivors), then from the
  replaced bookie itself (alive when it is being decommissioned). Every body is verified (digest,
  ledger id, entry id) before it is written anywhere; a corrupt replica is skipped and logged.
- It is written with RECOVERY_ADD (accepted on a fenced ledger and on a read-only bookie) and the
  ledger's master key, byte for byte as read. Only an EOK (durable, docs/protocol.md §7.1) counts.
- When no replica has the entry (every answer "no such entry/ledger"), the copy stops with
  EntryUnavailable: the fragment keeps the missing bookie, whose disk may hold the only copy. Any
  other failure (timeouts, EIO, a failing replacement) stops it with a retriable ReplicationError.
  Either way nothing was published: the replacement holds orphan copies that no metadata lists
  (its GC drops them once the ledger is healed and lists it nowhere: docs/bookie.md, step 1b).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from bookkeeper_aio.autorecovery.errors import EntryUnavailable, ReplicationError
from bookkeeper_aio.client.connection import Result
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.client.quorum import DistributionSchedule
from bookkeeper_aio.common import failpoints
from bookkeeper_aio.errors import BKError, BKInternalError, NoSuchEntry, NoSuchLedger, error_for_status
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, StatusCode
from bookkeeper_aio.protocol.digest import EntryCodec
from bookkeeper_aio.protocol.errors import DigestMismatch
from metadata.ledger_metadata import LedgerMetadata

log = structlog.get_logger("bookkeeper_aio.autorecovery.copier")

BUG_SHORT_BATCH = failpoints.BUG_COPY_TRUSTS_SHORT_BATCH


class RateLimiter:
    """Spaces copies so they average ``bytes_per_s`` (0: unlimited), shared by a daemon's workers:
    foreground adds on the replacement bookie keep their latency (docs/autorecovery.md measures
    both). Each caller reserves its bytes and sleeps until its reservation starts."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._next = 0.0

    async def acquire(self, size: int) -> None:
        if self.bytes_per_s <= 0:
            return
        now = asyncio.get_running_loop().time()  # the loop's clock (a simulation's is virtual)
        start = max(now, self._next)
        self._next = start + size / self.bytes_per_s
        if start > now:
            await asyncio.sleep(start - now)


@dataclass(slots=True)
class CopyStats:
    entries: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class FragmentCopy:
    """What to copy: entries ``first``..``last`` (inclusive; ``last < first``: none) of ``metadata``'s
    ledger, from ``old`` to ``new`` (same length, differing where a bookie was replaced)."""

    metadata: LedgerMetadata
    first: int
    last: int
    old: tuple[str, ...]
    new: tuple[str, ...]


async def copy_fragment(
    ctx: ClientContext,
    fragment: FragmentCopy,
    codec: EntryCodec,
    master_key: bytes,
    *,
    window: int,
    stats: CopyStats | None = None,
    limiter: RateLimiter | None = None,
) -> CopyStats:
    """Copy the entries of ``fragment`` to its replacement bookies (see the module doc).

    The pipeline: up to ``window`` entries are being written at once. The survivors' copies are
    read in batches, per write set (every entry with Qw == E; each stripe with BATCH_READ's step E
    when E > Qw), the next batch already in flight while the current one is written (read-ahead of
    one batch per stream, the batches from the stream's survivors in turn), and a batch's entries
    are written straight from the read with one callback per write (no task per entry: the copy's
    client-side cost per entry is what bounds it once the reads no longer wait). Entries no batch
    returned are read (from every replica in turn) and written by a task each."""
    md = fragment.metadata
    schedule = DistributionSchedule(md.ensemble_size, md.write_quorum, md.ack_quorum)
    changed = {p for p, (a, b) in enumerate(zip(fragment.old, fragment.new, strict=True)) if a != b}
    stats = stats if stats is not None else CopyStats()
    if not changed or fragment.last < fragment.first:
        return stats
    slots = asyncio.Semaphore(window)
    failure: BaseException | None = None  # anything: a copy must never pass with an entry missing
    started = stats.entries
    expected = 0
    loop = asyncio.get_running_loop()
    pool = ctx.pool
    add_timeout_s = ctx.config.add_timeout_s
    ledger_id = md.ledger_id
    recovery_add = int(AddFlag.RECOVERY_ADD)
    writing = 0  # entries written by callbacks, not all answered yet
    drained: asyncio.Future[None] | None = None

    def fail(error: BaseException) -> None:
        nonlocal failure
        if failure is None:
            failure = error

    def written(context: list[int], bookie_id: str, result: Result) -> None:
        """One replacement answered a write of the callback path; ``context``: [entry id, answers
        still awaited, bytes]."""
        nonlocal writing
        refused: BKError | None = None
        if isinstance(result, BKError):
            refused = result
        elif result.status != StatusCode.EOK:
            refused = error_for_status(result.status, getattr(result, "message", ""))
        if refused is not None:
            fail(
                ReplicationError(
                    f"ledger {ledger_id} entry {context[0]}: replacement {bookie_id}: {refused!r}"
                )
            )
        context[1] -= 1
        if context[1]:
            return
        if failure is None:
            stats.entries += 1
            stats.bytes += context[2]
        slots.release()
        writing -= 1
        if not writing and drained is not None and not drained.done():
            drained.set_result(None)

    def write_now(entry_id: int, targets: list[str], body: bytes) -> None:
        nonlocal writing
        writing += 1
        context = [entry_id, len(targets), len(body) * len(targets)]
        for target in targets:
            pool.request_with_callback(
                target,
                lambda rid: m.AddEntryRequest(rid, ledger_id, entry_id, recovery_add, master_key, body),
                written,
                context,
                add_timeout_s,
            )

    async def one(entry_id: int, targets: list[str], sources: list[str]) -> None:
        try:
            body = await _read_verified(ctx, ledger_id, entry_id, sources, codec)
            if limiter is not None:
                await limiter.acquire(len(body) * len(targets))
            await asyncio.gather(*(_write(ctx, ledger_id, entry_id, t, master_key, body) for t in targets))
            stats.entries += 1
            stats.bytes += len(body) * len(targets)
        except Exception as error:  # noqa: BLE001 - the first failure of any kind stops the copy
            fail(error)
        finally:
            slots.release()

    # Entries that share a write set are read in batches from a survivor of it: with Qw == E every
    # entry (one stream, step 1), with striping (E > Qw) each stripe e, e + E, ... (one stream per
    # stripe the replaced positions are in, BATCH_READ with step E). A stripe whose every member
    # is replaced (a decommission of several) has no stream: its entries are read one by one.
    striped = md.write_quorum < md.ensemble_size
    step = md.ensemble_size if striped else 1
    streams: dict[int, _Stream] = {}
    for stripe in range(md.ensemble_size if striped else 1):
        positions = schedule.write_set(stripe)
        if changed.isdisjoint(positions):
            continue
        holders = [fragment.old[p] for p in positions if p not in changed]
        if holders:  # the stripe's last entry in the fragment: fragment.last or a bit before
            last = fragment.last - (fragment.last - stripe) % step
            streams[stripe] = _Stream(holders, fragment.first - 1, last)
    prefetched: dict[int, bytes] = {}

    def fetch(stream: _Stream, start: int) -> asyncio.Task[int]:
        turn = stream.batches % len(stream.holders)
        stream.batches += 1
        order = stream.holders[turn:] + stream.holders[:turn]  # spread the reads over the survivors
        return loop.create_task(_prefetch(ctx, ledger_id, start, stream.last, order, codec, prefetched, step))

    tasks: set[asyncio.Task[None]] = set()
    try:
        for entry_id in range(fragment.first, fragment.last + 1):
            stream = streams.get(entry_id % step)
            if stream is not None and entry_id > stream.fetched_to:
                batch = stream.ahead if stream.ahead is not None else fetch(stream, entry_id)
                stream.ahead = None
                stream.fetched_to = max(await batch, entry_id)
                if stream.fetched_to + step <= stream.last:  # read ahead while this batch is written
                    stream.ahead = fetch(stream, stream.fetched_to + step)
            positions = schedule.write_set(entry_id)
            targets = [fragment.new[p] for p in positions if p in changed]
            if not targets:
                continue
            await slots.acquire()
            if failure is not None:
                slots.release()
                break
            expected += 1
            body = prefetched.pop(entry_id, None)
            if body is None and stream is not None and failpoints.switched(BUG_SHORT_BATCH):
                expected -= 1  # a planted bug (tests/simulation): what the survivor lacked is skipped
                slots.release()
                continue
            if body is not None:
                if limiter is not None:
                    await limiter.acquire(len(body) * len(targets))
                write_now(entry_id, targets, body)
                continue
            survivors = [fragment.old[p] for p in positions if p not in changed]
            replaced = [fragment.old[p] for p in positions if p in changed]
            copying = loop.create_task(one(entry_id, targets, survivors + replaced))
            tasks.add(copying)
            copying.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        if writing:
            drained = loop.create_future()
            await drained
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams.values():
            if stream.ahead is not None:
                stream.ahead.cancel()
    if failure is not None:
        raise failure
    if stats.entries - started != expected:  # never publish a replacement that lacks an entry
        raise BKInternalError(
            f"ledger {md.ledger_id}: copied {stats.entries - started} of {expected} entries of "
            f"fragment [{fragment.first}, {fragment.last}] without an error: refusing to list the copy"
        )
    return stats


class _Stream:
    """The batch reads of the entries sharing one write set: its surviving ``holders`` (asked in
    turn), its ``last`` entry in the fragment, the last entry fetched, the batch read ahead."""

    __slots__ = ("ahead", "batches", "fetched_to", "holders", "last")

    def __init__(self, holders: list[str], fetched_to: int, last: int) -> None:
        self.holders = holders
        self.fetched_to = fetched_to
        self.last = last
        self.batches = 0
        self.ahead: asyncio.Task[int] | None = None


async def _prefetch(
    ctx: ClientContext,
    ledger_id: int,
    start: int,
    last: int,
    holders: Sequence[str],
    codec: EntryCodec,
    into: dict[int, bytes],
    step: int = 1,
) -> int:
    """BATCH_READ entries ``start``, ``start + step``, ... ``last`` from the first holder that
    answers; the verified bodies go to ``into``. Returns the last entry fetched, or ``start`` when
    none was (that entry is then read on its own: a short or failed batch says nothing about the
    entries it did not return)."""
    config = ctx.config
    count = min((last - start) // step + 1, config.batch_read_count_max)
    for bookie_id in holders:
        try:
            response = await ctx.pool.request(
                bookie_id,
                lambda rid: m.BatchReadRequest(
                    rid, ledger_id, start, count, config.batch_read_bytes_max, 0, codec.master_key, step
                ),
                config.read_timeout_s,
            )
        except BKError:
            continue
        bodies = getattr(response, "bodies", None)
        if response.status != StatusCode.EOK or not bodies:
            continue
        if getattr(response, "step", 1) != step:
            bodies = bodies[:1]  # a bookie that ignores ``step`` answered consecutive entries
        fetched = start - step
        for offset, body in enumerate(bodies[:count]):
            entry_id = start + offset * step
            try:
                codec.decode(body, ledger_id, entry_id)
            except DigestMismatch:
                break  # this one and the rest: read on their own, from every replica
            into[entry_id] = bytes(body)
            fetched = entry_id
        if fetched >= start:
            return fetched
    return start


async def _read_verified(
    ctx: ClientContext, ledger_id: int, entry_id: int, sources: Sequence[str], codec: EntryCodec
) -> bytes:
    errors: list[BKError] = []
    for bookie_id in sources:
        try:
            response = await ctx.pool.request(
                bookie_id,
                lambda rid: m.ReadEntryRequest(rid, ledger_id, entry_id, 0, codec.master_key),
                ctx.config.read_timeout_s,
            )
        except BKError as error:
            errors.append(error)
            continue
        if response.status != StatusCode.EOK:
            errors.append(error_for_status(response.status, response.message))
            continue
        body = getattr(response, "body", None)
        if body is None:
            errors.append(NoSuchEntry(f"{bookie_id} has no entry {entry_id}"))
            continue
        try:
            codec.decode(body, ledger_id, entry_id)
        except DigestMismatch as mismatch:
            log.warning(
                "autorecovery.corrupt_replica",
                ledger_id=ledger_id,
                entry_id=entry_id,
                bookie=bookie_id,
                error=str(mismatch),
            )
            errors.append(ReplicationError(f"{bookie_id}: corrupt entry {entry_id}: {mismatch}"))
            continue
        return bytes(body)
    if errors and all(isinstance(e, NoSuchEntry | NoSuchLedger) for e in errors):
        raise EntryUnavailable(
            f"ledger {ledger_id} entry {entry_id}: none of {list(sources)} has it; the fragment keeps "
            "the missing bookie (its disk may hold the only copy: bring it back if it can be)"
        )
    raise ReplicationError(f"ledger {ledger_id} entry {entry_id}: no replica could be read: {errors}")


async def _write(
    ctx: ClientContext, ledger_id: int, entry_id: int, bookie_id: str, master_key: bytes, body: bytes
) -> None:
    try:
        response = await ctx.pool.request(
            bookie_id,
            lambda rid: m.AddEntryRequest(
                rid, ledger_id, entry_id, int(AddFlag.RECOVERY_ADD), master_key, body
            ),
            ctx.config.add_timeout_s,
        )
    except BKError as error:
        raise ReplicationError(
            f"ledger {ledger_id} entry {entry_id}: replacement {bookie_id}: {error!r}"
        ) from error
    if response.status != StatusCode.EOK:
        refused = error_for_status(response.status, response.message)
        raise ReplicationError(
            f"ledger {ledger_id} entry {entry_id}: replacement {bookie_id}: {refused!r}"
        ) from refused
