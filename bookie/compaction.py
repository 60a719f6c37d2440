"""Journal compaction: copy the live entries of mostly-dead segments to the journal head, switch the
index to the copies, and delete segments nothing points into any more (docs/bookie.md, *Garbage
collection*). Driven by :class:`bookie.gc.GarbageCollector`, one step at a time:

1. **Usage.** Walk every ledger's index (in steps, yielding to the loop) and sum the record bytes
   each segment still holds. Only segments below ``limit``, the synced position's segment read
   *before* the walk, are judged: everything in them is durable and already indexed, and no index
   entry can ever move *into* them again (adds, recovery adds and compaction copies all go to the
   journal head), so their live bytes only fall while we look.
1b. **Roll.** The journal's current segment is never judged as it is (records still go into it).
   When, measured with its synced end read *before* the walk, at least ``roll_dead_bytes`` of it
   are dead and its live fraction is under ``threshold``, the journal is rolled
   (:meth:`bookie.journal.Journal.roll`: the next record goes to the next segment, already created
   ahead of time, so no disk space is needed) and the pass waits until the roll is durable; then
   the walk is made again and the old segment is judged like any other. The roll writes nothing
   but the next segment's header: a crash leaves a segment that ends in zeros, as a natural roll
   does, and a journal that goes on in the next one.
2. **Copy.** For a segment whose live bytes are below ``threshold`` of its size: read its live
   records in batches (CRC checked; a damaged record is left where it is, and so is the segment),
   append each record whose index entry still points there to the journal, unchanged, and wait
   for the covering fdatasync. Throttled to ``rate_bytes_per_s`` and paused (up to a second per
   batch) while the journal has a backlog; skipped for the rest of the pass while the bookie is
   read-only (copies need disk space, a full disk must not fail the journal; step 4 goes on and
   frees what is wholly dead).
3. **Switch.** Once a batch is durable, each index entry that still points at the old record is
   pointed at its copy (in one loop step, so a read sees one or the other, both whole).
4. **Checkpoint, then delete.** A fresh walk finds the segments with no live bytes left; a
   checkpoint is written (it points into none of them and its position is past them: replay never
   reads them), and only once it is durable are they deleted (the directory fsynced after).

Crash at any step: before the checkpoint, the old checkpoint and every old segment are still there
(the copies are extra records that replay applies over the originals: same bytes); after it, the
new checkpoint needs none of the dead segments, and one that survives an unlink is deleted by the
next pass. Nothing acknowledged is ever only in a deleted file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from bookie.index import Location
from bookie.journal_format import SEGMENT_HEADER_BYTES, Position
from bookie.ledger_state import LedgerState
from bookie.storage import Storage, durable_future
from bookkeeper_aio.common import failpoints

log = structlog.get_logger(__name__)

WALK_SLOTS_PER_STEP = 8192
"""Index slots walked per loop step: ~1 ms (7 ms per 64k slots measured on a loaded 2-CPU VM), so
a walk over millions of entries never holds the event loop for long. Small ledgers share a step
(each counts as :data:`WALK_LEDGER_SLOTS` more), and ledgers without entries are skipped: a loop
turn per ledger made a pass over a million ledgers cost ~3 s of CPU per walk."""
WALK_LEDGER_SLOTS = 64
"""What visiting one ledger costs in a walk step, in index slots (a Python call or two)."""
BATCH_BYTES_MAX = 256 * 1024
"""Copies appended per batch at most (one fdatasync each): an add that shares a group with a batch
waits for at most this much extra written (~1 ms of disk)."""
LIVE_BYTES_PER_WALK = 256 * 1024 * 1024
"""Live bytes of the segments one walk collects the entries of (bounds the memory of the list)."""
PAUSE_S = 0.05
BACKLOG_WAIT_S_MAX = 1.0
"""The longest a copy batch waits for the journal's backlog to drain."""
ROLL_READY_WAIT_S = 2.0
"""The longest a roll waits for the next segment to be created ahead of time (just restarted)."""


class CopiesRefused(Exception):
    """Copies must not be made now (the bookie is read-only); the message says why."""


@dataclass
class Progress:
    """What compaction has done so far in this pass (the GC report shows it)."""

    segments_total: int = 0
    segments_done: int = 0
    segment: int | None = None
    bytes_to_copy: int = 0
    bytes_copied: int = 0
    entries_copied: int = 0
    entries_corrupt: int = 0
    paused: str | None = None
    skipped: str | None = None
    """Why copying stopped early in this pass (read-only), if it did."""
    rolled: int | None = None
    """The journal's current segment this pass rolled (so it could be judged), if it did."""


async def segment_usage(storage: Storage) -> dict[int, int]:
    """Live record bytes per segment, over every ledger's index (walked in steps)."""
    counts: dict[int, int] = {}
    walked = 0
    for state in list(storage.ledgers.values()):
        index = state.index
        if not index.count:  # most ledgers of a bookie with a million hold no entry
            walked += 1  # but a million visits of them are ~50 ms: they count too (~a slot each)
            if walked >= WALK_SLOTS_PER_STEP:
                walked = 0
                await asyncio.sleep(0)
            continue
        for start in range(0, max(index.slots, 1), WALK_SLOTS_PER_STEP):
            index.segment_bytes(counts, start, start + WALK_SLOTS_PER_STEP)
            walked += min(WALK_SLOTS_PER_STEP, index.slots - start) + WALK_LEDGER_SLOTS
            if walked >= WALK_SLOTS_PER_STEP:
                walked = 0
                await asyncio.sleep(0)
    return counts


async def _live_entries(
    storage: Storage, segment_ids: frozenset[int]
) -> dict[int, list[tuple[LedgerState, int, int, Location]]]:
    """Per segment, ``(state, ledger id, entry id, location)`` of every entry in it, by offset."""
    found: dict[int, list[tuple[LedgerState, int, int, Location]]] = {s: [] for s in segment_ids}
    walked = 0
    for state in list(storage.ledgers.values()):
        index = state.index
        if not index.count:
            walked += 1  # as in segment_usage
            if walked >= WALK_SLOTS_PER_STEP:
                walked = 0
                await asyncio.sleep(0)
            continue
        for start in range(0, max(index.slots, 1), WALK_SLOTS_PER_STEP):
            for entry_id, location in index.in_segments(segment_ids, start, start + WALK_SLOTS_PER_STEP):
                found[location.segment_id].append((state, state.ledger_id, entry_id, location))
            walked += min(WALK_SLOTS_PER_STEP, index.slots - start) + WALK_LEDGER_SLOTS
            if walked >= WALK_SLOTS_PER_STEP:
                walked = 0
                await asyncio.sleep(0)
    for entries in found.values():
        entries.sort(key=lambda item: item[3].offset)
    return found


class Compactor:
    """One pass of compaction over one storage (see the module docstring)."""

    def __init__(
        self,
        storage: Storage,
        executor: Any,
        *,
        threshold: float,
        rate_bytes_per_s: int,
        copy_refused: Callable[[], str | None] = lambda: None,
        progress: Progress | None = None,
        roll_dead_bytes: int = 0,
    ) -> None:
        self.storage = storage
        self._executor = executor
        self.threshold = threshold
        self.roll_dead_bytes = roll_dead_bytes
        self.rate_bytes_per_s = rate_bytes_per_s
        self._copy_refused = copy_refused
        self.progress = progress or Progress()
        self._batch_bytes = max(64 * 1024, min(BATCH_BYTES_MAX, rate_bytes_per_s // 16))
        self._loop = asyncio.get_running_loop()

    async def candidates(self) -> tuple[dict[int, int], dict[int, int], int]:
        """``(usage, sizes, limit)``: live bytes and file size per segment, and the segment id
        below which segments may be judged (read before the walk, see step 1)."""
        usage, sizes, synced = await self._candidates()
        return usage, sizes, synced.segment_id

    async def _candidates(self) -> tuple[dict[int, int], dict[int, int], Position]:
        synced = self.storage.journal.synced_position
        usage = await segment_usage(self.storage)
        sizes = await self._loop.run_in_executor(self._executor, self.storage.segment_sizes_blocking)
        return usage, sizes, synced

    async def compact(self) -> None:
        """Copy the live entries out of every segment under the threshold (after rolling the
        current segment when enough of it is dead: step 1b)."""
        if self.threshold <= 0 or self.storage.journal.failed is not None:
            return
        usage, sizes, synced = await self._candidates()
        if await self._roll_if_dead(usage, synced):
            usage, sizes, synced = await self._candidates()
        limit = synced.segment_id
        chosen = sorted(
            (usage[s] / size, s)
            for s, size in sizes.items()
            if s < limit and size > 0 and 0 < usage.get(s, 0) < self.threshold * size
        )
        progress = self.progress
        progress.segments_total = len(chosen)
        progress.bytes_to_copy = sum(usage[s] for _, s in chosen)
        if chosen:
            log.info(
                "compaction.started",
                segments=len(chosen),
                bytes_to_copy=progress.bytes_to_copy,
                threshold=self.threshold,
            )
        group: list[int] = []
        group_bytes = 0
        try:
            for _, segment_id in chosen:
                group.append(segment_id)
                group_bytes += usage[segment_id]
                if group_bytes >= LIVE_BYTES_PER_WALK:
                    await self._compact_group(group)
                    group, group_bytes = [], 0
            if group:
                await self._compact_group(group)
        except CopiesRefused as refused:  # dead segments are still deleted: that needs no space
            progress.skipped = str(refused)
            progress.segment = None
            log.warning(
                "compaction.skipped", reason=str(refused), segments_left=len(chosen) - progress.segments_done
            )

    async def _roll_if_dead(self, usage: dict[int, int], synced: Position) -> bool:
        """Step 1b: roll the journal when its current segment is mostly dead; True once the roll
        is durable. ``synced`` was read before the walk that counted ``usage``: records indexed
        during the walk count as live although their bytes are not in ``synced.offset``, so the
        dead bytes are never overestimated."""
        journal = self.storage.journal
        if self.roll_dead_bytes <= 0 or journal.segment_id != synced.segment_id:
            return False  # off, or the journal is rolling by itself right now
        written = synced.offset - SEGMENT_HEADER_BYTES
        live = usage.get(synced.segment_id, 0)
        dead = written - live
        if dead < self.roll_dead_bytes or live >= self.threshold * written:
            return False
        refused = self._copy_refused()
        if refused is not None and live > 0:
            return False  # its live entries could not be copied now: rolling would gain nothing
        segment_id = synced.segment_id
        deadline = self._loop.time() + ROLL_READY_WAIT_S
        durable, done = durable_future(self._loop)

        while not journal.roll(done):
            if journal.segment_id != segment_id or self._loop.time() >= deadline:
                return False  # rolled by itself meanwhile, or the next segment is not there
            await asyncio.sleep(PAUSE_S)
        await durable  # JournalError: the pass ends; nothing was changed but where adds go
        failpoints.hit(failpoints.GC_ROLLED)
        self.progress.rolled = segment_id
        log.info(
            "compaction.segment_rolled",
            segment=f"{segment_id:016x}",
            written=written,
            live=live,
            threshold=self.threshold,
        )
        return True

    async def _compact_group(self, segment_ids: list[int]) -> None:
        found = await _live_entries(self.storage, frozenset(segment_ids))
        for segment_id in segment_ids:
            self.progress.segment = segment_id
            entries = found.pop(segment_id)
            started = self._loop.time()
            copied = await self._copy_segment(segment_id, entries)
            self.progress.segments_done += 1
            log.info(
                "compaction.segment_copied",
                segment=f"{segment_id:016x}",
                entries=len(entries),
                bytes=copied,
                seconds=round(self._loop.time() - started, 3),
            )
        self.progress.segment = None

    async def _copy_segment(
        self, segment_id: int, entries: list[tuple[LedgerState, int, int, Location]]
    ) -> int:
        copied = 0
        i = 0
        while i < len(entries):
            j, size = i, 0
            while j < len(entries) and (size == 0 or size + entries[j][3].length <= self._batch_bytes):
                size += entries[j][3].length
                j += 1
            await self._wait_until_allowed()
            started = self._loop.time()
            copied += await self._copy_batch(segment_id, entries[i:j])
            i = j
            budget_s = size / self.rate_bytes_per_s
            spent_s = self._loop.time() - started
            if spent_s < budget_s:
                await asyncio.sleep(budget_s - spent_s)
        return copied

    async def _wait_until_allowed(self) -> None:
        """Pause while the journal has a backlog (foreground adds first), but never longer than
        :data:`BACKLOG_WAIT_S_MAX` per batch: under endless load compaction still moves (one batch
        a second at worst), so dead segments get freed. Raise :class:`CopiesRefused` while copies
        must not be made at all (read-only: disk space)."""
        journal = self.storage.journal
        deadline = self._loop.time() + BACKLOG_WAIT_S_MAX
        while True:
            refused = self._copy_refused()
            if refused is not None:
                raise CopiesRefused(refused)
            busy = journal.under_pressure or journal.queue_bytes > self._batch_bytes * 4
            if not busy or self._loop.time() >= deadline:
                self.progress.paused = None
                return
            self.progress.paused = "journal backlog"
            await asyncio.sleep(PAUSE_S)

    async def _copy_batch(self, segment_id: int, batch: list[tuple[LedgerState, int, int, Location]]) -> int:
        storage = self.storage
        wanted = [(ledger_id, entry_id, location) for _, ledger_id, entry_id, location in batch]
        records = await self._loop.run_in_executor(
            self._executor, storage.read_records_blocking, segment_id, wanted
        )
        journal = storage.journal
        moves: list[tuple[LedgerState, int, Location, int, int]] = []
        copied = 0
        for (state, ledger_id, entry_id, location), record in zip(batch, records, strict=True):
            if storage.ledgers.get(ledger_id) is not state or state.index.get(entry_id) != location:
                continue  # deleted, or rewritten elsewhere since the walk: nothing to copy
            if record is None:
                self.progress.entries_corrupt += 1
                log.error(
                    "compaction.record_corrupt",
                    segment=f"{segment_id:016x}",
                    offset=location.offset,
                    ledger_id=ledger_id,
                    entry_id=entry_id,
                    hint="left in place (reads answer EIO); the segment is kept",
                )
                continue
            new_segment, new_offset = journal.append((record,), None)
            moves.append((state, entry_id, location, new_segment, new_offset))
            copied += location.length
        if not moves:
            return 0
        durable, done = durable_future(self._loop)

        journal.sync(done)
        await durable  # JournalError: the pass ends, the index still points at the originals
        failpoints.hit(failpoints.GC_COPIED)
        for state, entry_id, location, new_segment, new_offset in moves:
            if storage.ledgers.get(state.ledger_id) is state and state.index.get(entry_id) == location:
                state.index.put(entry_id, new_segment, new_offset, location.length)
                state.row = None  # the next checkpoint re-encodes it
        self.progress.bytes_copied += copied
        self.progress.entries_copied += len(moves)
        return copied

    async def delete_dead(self) -> tuple[int, int]:
        """Checkpoint, then delete every judged segment with no live bytes; ``(segments, bytes)``."""
        storage = self.storage
        if storage.journal.failed is not None:
            return 0, 0  # a failed journal: restart first; a checkpoint now could not be trusted
        usage, sizes, limit = await self.candidates()
        dead = sorted(s for s in sizes if s < limit and usage.get(s, 0) == 0)
        if not dead:
            return 0, 0
        failpoints.hit(failpoints.GC_BEFORE_CHECKPOINT)
        position = await storage.write_checkpoint()
        dead = [s for s in dead if s < position.segment_id]
        if not dead:
            return 0, 0
        failpoints.hit(failpoints.GC_BEFORE_DELETE)
        freed = await storage.delete_segments(dead)
        log.info("compaction.segments_deleted", segments=len(dead), bytes=freed, first=f"{dead[0]:016x}")
        return len(dead), freed
