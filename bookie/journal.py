"""The journal: append records, group-commit them, call back once they are durable.

Strategy (docs/bookie.md "Group commit"; docs/internals.md §6):

- The event loop owns the layout. ``append`` assigns each record its segment and offset at once
  (so the caller knows where the entry will live) and adds its bytes to the pending group; no I/O.
- One dedicated writer thread does all journal I/O: create/preallocate segments, ``pwrite`` a
  group, ``fdatasync``. Only one group is in flight; records appended meanwhile gather into the next
  group, which goes out the moment the previous sync returns (adaptive group commit). With
  ``group_wait_ms > 0`` a timed policy is used instead: a group goes out when it is
  ``group_bytes`` large or its first record has waited ``group_wait_ms``.
- Completion is a plain callback per record (``cb(error)``), fired on the loop after the covering
  fdatasync, in append order. No Future per record: they cost ~38% on this path (docs/internals.md §6).
- Each group starts with a GROUP header record (its own position and its records' length), one per
  segment it touches: ``append`` reserves the room when a run gets its first record, the writer
  fills it in. Replay uses it to tell the final group, torn by a power loss in any page order, from
  damage before a later group (``bookie.journal_format``).
- A group that spans a segment roll syncs the older segment before writing the newer one, so a
  crash never leaves a hole before durable records (the replay table relies on it). A segment's
  header, written with its first run, records where the segment before it ended, so replay can
  tell that segment's lost last groups from space never written. The next
  segment is created (directory fsynced) ahead of time, off the hot path; segments grow in
  preallocated 16 MiB steps.
- Bytes waiting for the disk are bounded (``queue_bytes_max``): above it ``on_pressure(True)`` tells
  the server to stop reading sockets; ``on_pressure(False)`` once the backlog halves.
- After a write or sync error the journal is failed: pending and later appends get the error, and
  nothing is ever acknowledged that was not synced.
- The add path appends many records with no call per record: :meth:`Journal.open_batch` hands out a
  :class:`RecordBatch` (where the records go), :meth:`Journal.close_batch` takes it back with its
  entry bodies and adds their records in one go. The bytes of a record come from
  :mod:`bookie.journal_format` only.

Seams (docs/internals.md §2): the writer thread is made by a :class:`bookie.threads.Threads`, the disk is a
:class:`bookie.fileio.FileIO`, time is a :class:`bookkeeper_aio.common.clock.Clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from bookie import journal_format as fmt
from bookie.fileio import FileIO
from bookie.journal_format import Position
from bookie.stats import FSYNC_SECONDS_BOUNDS, GROUP_RECORDS_BOUNDS, BucketHistogram
from bookie.threads import OS_THREADS, Threads
from bookkeeper_aio.common import failpoints
from bookkeeper_aio.common.clock import SYSTEM_CLOCK, Clock

log = structlog.get_logger(__name__)

Callback = Callable[[BaseException | None], None]


class JournalError(Exception):
    """The journal cannot accept or persist records (a disk error, or it is closed)."""


SEGMENT_BYTES_MAX = (1 << 32) - 1
"""The index packs offsets within a segment into 32 bits (bookie.index)."""


@dataclass(frozen=True)
class JournalConfig:
    segment_bytes: int = 256 * 1024 * 1024
    """Segment size: large enough that rolls (a create + fsync) are rare, small enough to GC."""
    group_wait_ms: float = 0.0
    """0 = adaptive group commit (the default); > 0 = timed policy with this maximum wait."""
    group_bytes: int = 512 * 1024
    """Timed policy: a group goes out once this many bytes gathered."""
    queue_bytes_max: int = 64 * 1024 * 1024
    """Bytes appended but not yet synced before sockets stop being read: ~0.4 s of disk at the
    measured peak, enough to keep the disk busy, small enough to bound memory."""

    record_bytes_max: int = fmt.RECORD_BODY_BYTES_MAX + fmt.RECORD_HEADER_BYTES
    """Largest record accepted: a record never spans segments, so a segment must hold two."""

    def validate(self) -> None:
        if not 0 < self.record_bytes_max <= fmt.RECORD_BODY_BYTES_MAX + fmt.RECORD_HEADER_BYTES:
            raise ValueError(f"journal record_bytes_max {self.record_bytes_max} is out of range")
        if self.segment_bytes > SEGMENT_BYTES_MAX:
            raise ValueError(f"journal segment_bytes {self.segment_bytes} exceeds {SEGMENT_BYTES_MAX}")
        if (
            self.segment_bytes
            < 2 * (self.record_bytes_max + fmt.GROUP_HEADER_BYTES) + fmt.SEGMENT_HEADER_BYTES
        ):
            raise ValueError(
                f"journal segment_bytes {self.segment_bytes} must hold two records of the maximum "
                f"size ({self.record_bytes_max} bytes)"
            )
        if self.group_wait_ms < 0 or self.group_bytes <= 0 or self.queue_bytes_max <= 0:
            raise ValueError("journal group_wait_ms must be >= 0, group_bytes and queue_bytes_max > 0")


class _Run:
    """Consecutive bytes of one group that go to one segment: from ``offset`` (the GROUP header,
    once a record is in ``parts``) to ``end`` (set when the run is closed by a roll or a flush).
    ``previous_end``: where the segment before ended, for the header of a run that writes it."""

    __slots__ = ("end", "offset", "parts", "previous_end", "segment_id")

    def __init__(self, segment_id: int, offset: int, previous_end: int) -> None:
        self.segment_id = segment_id
        self.offset = offset
        self.end = offset
        self.parts: list[bytes] = []
        self.previous_end = previous_end


class RecordBatch:
    """ENTRY records appended in bulk (:meth:`Journal.open_batch`). The caller appends each
    record's entry body to ``entry_bodies``, the record going at ``offset``, then advances its own
    copy of ``offset`` by the record's size (``journal_format.ENTRY_RECORD_OVERHEAD_BYTES`` + the
    body's), for records with ``offset + size <= end`` and ``size <= record_max``, and hands the
    final offset to :meth:`Journal.close_batch`, which adds the records' bytes. Nothing else may be
    appended to the journal in between."""

    __slots__ = ("end", "entry_bodies", "offset", "parts", "record_max", "segment_id")

    def __init__(self, parts: list[bytes], segment_id: int, offset: int, end: int, record_max: int) -> None:
        self.entry_bodies: list[bytes] = []
        self.parts = parts
        """The journal's run the records go to (the caller leaves it to :meth:`Journal.close_batch`)."""
        self.segment_id = segment_id
        self.offset = offset
        self.end = end
        self.record_max = record_max


_GROUP_HEADER_BYTES = fmt.GROUP_HEADER_BYTES

PREALLOCATE_BYTES = 16 * 1024 * 1024
"""Segments grow by preallocated steps (BookKeeper's journalPreAllocSizeMB): a size change, and so
a metadata sync, once per 16 MiB; and at most 16 MiB of zeros to scan at startup."""


class _Writer:
    """State touched only by the writer thread: open segment fds and their preallocated ends."""

    def __init__(
        self, fileio: FileIO, directory: str, segment_bytes: int, clock: Clock, mark_path: str | None
    ) -> None:
        self.fileio = fileio
        self.clock = clock
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.fds: dict[int, int] = {}
        self.allocated: dict[int, int] = {}
        self.sync_seconds = BucketHistogram(FSYNC_SECONDS_BOUNDS)  # observed here, read at scrape
        self.write_seconds = BucketHistogram(FSYNC_SECONDS_BOUNDS)  # the group's write(s), per group
        self.spare_error: OSError | None = None
        """The last failure to create the next segment ahead of time (None once one succeeded)."""
        self.spare_ready = 0
        """The last segment created ahead of time, once it is whole (one int: read by the loop)."""
        boot = fileio.boot_id() if mark_path is not None else None
        self._mark_boot = fmt.boot_digest(boot) if boot is not None else None
        """The synced mark's boot digest; None: no mark is kept (none asked, unknown boot, or it failed)."""
        self._mark_path = mark_path or ""
        self._mark_fd: int | None = None
        if mark_path is not None and boot is None:  # none kept: an older one must not stay behind
            with contextlib.suppress(FileNotFoundError):
                fileio.remove(mark_path)

    def _path(self, segment_id: int) -> str:
        return os.path.join(self.directory, fmt.segment_name(segment_id))

    def prepare(self, segment_id: int) -> int:
        """Open segment ``segment_id``, creating and preallocating it (directory fsynced)."""
        fd = self.fds.get(segment_id)
        if fd is not None:
            return fd
        fd = self.fileio.open_append(self._path(segment_id))
        self.fds[segment_id] = fd
        size = self.fileio.size(fd)
        step = min(PREALLOCATE_BYTES, self.segment_bytes)
        if size < step:
            self.fileio.preallocate(fd, size, step - size)
        self.allocated[segment_id] = max(size, step)
        # Also for a segment found on disk: its directory entry may not have been made durable
        # before a crash. Once per segment, so the cost does not matter.
        self.fileio.fsync(fd)
        self.fileio.fsync_dir(self.directory)
        return fd

    def _ensure_allocated(self, segment_id: int, fd: int, end: int) -> None:
        allocated = self.allocated[segment_id]
        if end > allocated:
            new_end = min(max(end, allocated + PREALLOCATE_BYTES), max(end, self.segment_bytes))
            self.fileio.preallocate(fd, allocated, new_end - allocated)
            self.allocated[segment_id] = new_end

    def write_group(self, runs: list[_Run], spare_segment_id: int, end: Position) -> None:
        last = len(runs) - 1
        synced = False
        for i, run in enumerate(runs):
            if not run.parts and run.offset != fmt.SEGMENT_HEADER_BYTES:
                if i != last:
                    self.close_segment(run.segment_id)
                continue
            fd = self.prepare(run.segment_id)
            if run.parts:  # the GROUP header, in the room append reserved for it
                length = run.end - run.offset - fmt.GROUP_HEADER_BYTES
                run.parts.insert(0, fmt.encode_group_header(run.segment_id, run.offset, length))
            if run.offset == fmt.SEGMENT_HEADER_BYTES:
                run.parts.insert(0, fmt.encode_segment_header(run.segment_id, run.previous_end))
                run.offset = 0
            data = b"".join(run.parts)
            self._ensure_allocated(run.segment_id, fd, run.offset + len(data))
            write_start_s = self.clock.monotonic()
            self.fileio.journal_write(fd, data, run.offset)
            sync_start_s = self.clock.monotonic()
            self.fileio.journal_sync(fd)
            self.sync_seconds.observe(self.clock.monotonic() - sync_start_s)
            self.write_seconds.observe(sync_start_s - write_start_s)
            synced = True
            if i != last:
                self.close_segment(run.segment_id)
        if synced:
            self.mark_synced(end)
        if spare_segment_id not in self.fds:
            self._prepare_spare(spare_segment_id)

    def mark_synced(self, end: Position) -> None:
        """Rewrite the synced mark (``journal_format``'s module doc) after a group's fdatasync and
        before any of its records is acknowledged: in this boot, everything before ``end`` is synced.
        Not synced itself: it is trusted only in the boot that wrote it (the page cache outlives a
        process crash). A mark is current or absent: one that cannot be written is removed, and
        the journal keeps none until it restarts (replay then assumes the worst, as without it)."""
        boot = self._mark_boot
        if boot is None:
            return
        try:
            if self._mark_fd is None:
                self._mark_fd = self.fileio.open_append(self._mark_path)
            self.fileio.pwrite(self._mark_fd, fmt.encode_synced_mark(boot, end), 0)
        except OSError as exc:
            self._mark_boot = None
            self._close_mark()
            # a stale mark would prove too much (bytes synced since would look unsynced): remove it
            # or fail the group (an unremovable file on a failing disk; the journal fails with it)
            with contextlib.suppress(FileNotFoundError):
                self.fileio.remove(self._mark_path)
            log.warning("journal.synced_mark_dropped", error=repr(exc))

    def _close_mark(self) -> None:
        fd, self._mark_fd = self._mark_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                self.fileio.close(fd)

    def _prepare_spare(self, segment_id: int) -> None:
        """Create the next segment ahead of time. The group before it is already synced, so a
        failure here (ENOSPC) must not fail that group or the journal: log it once, drop the
        half-made spare (its zeros replay as "never written"), retry with the next group; a roll
        into it prepares it again, and fails the journal only if the disk is still full then."""
        try:
            self.prepare(segment_id)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.close_segment(segment_id)
            if self.spare_error is None:
                log.warning("journal.spare_segment_failed", segment_id=segment_id, error=repr(exc))
            self.spare_error = exc
        else:
            self.spare_error = None
            self.spare_ready = segment_id

    def close_segment(self, segment_id: int) -> None:
        self.allocated.pop(segment_id, None)
        fd = self.fds.pop(segment_id, None)
        if fd is not None:
            self.fileio.close(fd)

    def close_all(self) -> None:
        for segment_id in list(self.fds):
            self.close_segment(segment_id)
        self._close_mark()


_Group = tuple[list[_Run], int, list["Callback"], "Position"]


def _ignore(error: BaseException | None) -> None:
    """A completion nobody waits for."""


class _WriterThread:
    """The one thread that does journal I/O: a :class:`bookie.threads.Worker` (a bare thread on a
    queue) with one ``call_soon_threadsafe`` back per group: a thread pool's futures and their
    chained callbacks cost more loop time per group and delay the wake-up."""

    def __init__(
        self,
        writer: _Writer,
        loop: asyncio.AbstractEventLoop,
        on_done: Callable[[_Group, BaseException | None], None],
        threads: Threads,
    ) -> None:
        self._writer = writer
        self._loop = loop
        self._on_done = on_done
        self._worker = threads.start_worker(self._write, "journal-writer")
        self.submit: Callable[[_Group], None] = self._worker.submit

    def _write(self, group: _Group) -> None:
        error: BaseException | None = None
        try:
            self._writer.write_group(group[0], group[1], group[3])
        except BaseException as exc:  # noqa: BLE001 (handed to the loop, which fails the journal)
            error = exc
        try:  # noqa: SIM105 (contextlib.suppress is an object and two calls per group)
            self._loop.call_soon_threadsafe(self._on_done, group, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def stop(self) -> None:
        """Finish what was submitted, then end the thread."""
        self._worker.stop()


class Journal:
    """Owner of the journal's writer thread; ``close()`` flushes, ``abort()`` drops."""

    # Slots: the add path reads a dozen of these per record, and slot loads stay specialised however
    # many attributes there are (instance-dict loads lose their fast path past 30 keys on 3.11:
    # adding a 30th attribute cost ~350 instructions per add, callgrind).
    __slots__ = (
        "_callbacks",
        "_clock",
        "_closing",
        "_config",
        "_failed",
        "_first_append_s",
        "_idle",
        "_inflight_bytes",
        "_inflight_callbacks",
        "_inflight_records",
        "_loop",
        "_offset",
        "_pending_bytes",
        "_pending_records",
        "_pressure",
        "_previous_end",
        "_record_bytes_max",
        "_refusing",
        "_runs",
        "_scheduled",
        "_segment_bytes",
        "_segment_id",
        "_synced",
        "_thread",
        "_writer",
        "bytes_written",
        "completion_seconds",
        "group_records",
        "groups_written",
        "on_pressure",
        "queue_wait_seconds",
        "records_written",
        "sync_seconds",
        "write_seconds",
    )

    def __init__(
        self,
        fileio: FileIO,
        directory: str,
        start: Position,
        config: JournalConfig,
        threads: Threads = OS_THREADS,
        clock: Clock = SYSTEM_CLOCK,
        synced_mark: str | None = None,
        start_format: int = fmt.SEGMENT_VERSION,
        previous_end: int = 0,
    ) -> None:
        """``synced_mark``: the path of the synced mark to keep (``journal_format``'s module doc);
        None keeps none. ``start_format``: the format version of the segment ``start`` is in; in a
        segment of an older one nothing more is appended, the journal goes on in the next.
        ``previous_end``: where the segment before ``start``'s ended (replay's
        :attr:`~bookie.replay.Recovered.previous_end`), recorded in that segment's header when
        ``start`` is just past it; 0 records none."""
        config.validate()
        self._config = config
        self._clock = clock
        # The hot path's limits as plain attributes (one load each instead of two).
        self._record_bytes_max = config.record_bytes_max
        self._segment_bytes = config.segment_bytes
        self._loop = asyncio.get_running_loop()
        self._writer = _Writer(fileio, directory, config.segment_bytes, clock, synced_mark)
        # Everything before ``start`` is durable (replay synced what it served): the mark says so
        # from now on, not where the last run left it (bytes replayed past it may be served now,
        # and a cut found at the old mark later is damage to them, not a write torn in flight).
        self._writer.mark_synced(start)
        self._segment_id, self._offset = start
        self._synced = start
        self._previous_end = previous_end
        self._runs: list[_Run] = [_Run(start.segment_id, start.offset, previous_end)]
        if start_format != fmt.SEGMENT_VERSION:
            self._roll()  # as a record that did not fit would: the first group writes the header
        self._callbacks: list[Callback] = []
        self._inflight_callbacks: list[Callback] | None = None
        self._pending_records = 0  # records in the gathering group (with or without a completion)
        self._inflight_records = 0
        self._pending_bytes = 0
        self._inflight_bytes = 0
        self._first_append_s = 0.0
        self._scheduled: asyncio.Handle | asyncio.TimerHandle | None = None
        self._failed: BaseException | None = None
        self._closing = False
        self._refusing = False
        """``_failed is not None or _closing``, as one flag for the add path."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._pressure = False
        self.on_pressure: Callable[[bool], None] | None = None
        self._thread = _WriterThread(self._writer, self._loop, self._on_group_done, threads)
        self.groups_written = 0
        self.records_written = 0
        self.bytes_written = 0
        self.group_records = BucketHistogram(GROUP_RECORDS_BOUNDS)
        self.sync_seconds = self._writer.sync_seconds
        self.write_seconds = self._writer.write_seconds
        # Where a group's time goes besides write + fdatasync, observed once per group on the loop:
        # gathering (its first record appended -> handed to the writer) and completion (the
        # callbacks: index updates and answers).
        self.queue_wait_seconds = BucketHistogram(FSYNC_SECONDS_BOUNDS)
        self.completion_seconds = BucketHistogram(FSYNC_SECONDS_BOUNDS)

    @property
    def synced_position(self) -> Position:
        """Everything before this position is durable."""
        return self._synced

    @property
    def failed(self) -> BaseException | None:
        return self._failed

    @property
    def queue_bytes(self) -> int:
        """Bytes appended but not yet durable (gathering + in the group being written)."""
        return self._pending_bytes + self._inflight_bytes

    @property
    def queue_records(self) -> int:
        """Records appended but not yet durable (gathering + in the group being written)."""
        return self._pending_records + self._inflight_records

    @property
    def under_pressure(self) -> bool:
        """True while the backlog is over ``queue_bytes_max`` (sockets are not being read)."""
        return self._pressure

    def append(self, parts: tuple[bytes, ...], callback: Callback | None) -> tuple[int, int]:
        """Queue one record (given as byte parts) and return ``(segment_id, offset)`` where it
        will live.

        ``callback(None)`` runs on the loop once the record is durable, ``callback(exc)`` if it
        never will be. Raises :class:`JournalError` when the journal is closed or failed, or the
        record is larger than ``record_bytes_max``.
        """
        size = 0
        for part in parts:
            size += len(part)
        if not 0 < size <= self._record_bytes_max:
            raise self._size_error(size)
        run_parts, segment_id, offset = self._place(size)
        run_parts.extend(parts)
        if callback is not None:
            self._callbacks.append(callback)
        self._appended(offset + size, 1)
        return segment_id, offset

    @property
    def last_callback(self) -> Callback | None:
        """The gathering group's last completion (a batch may take more records: :meth:`close_batch`)."""
        callbacks = self._callbacks
        return callbacks[-1] if callbacks else None

    def open_batch(self, size: int) -> RecordBatch:
        """Start appending records in bulk with room for one of ``size`` bytes at ``offset``,
        rolling to the next segment if needed (see :class:`RecordBatch`). Raises
        :class:`JournalError` when the journal is closed or failed or ``size`` is over
        ``record_bytes_max``."""
        if not 0 < size <= self._record_bytes_max:
            raise self._size_error(size)
        parts, segment_id, offset = self._place(size)
        return RecordBatch(parts, segment_id, offset, self._segment_bytes, self._record_bytes_max)

    def close_batch(self, batch: RecordBatch, offset: int, completion: Callback) -> None:
        """End what :meth:`open_batch` started: the records of ``batch.entry_bodies`` go in, ending
        at ``offset``. ``completion(error)`` runs once for all of them after the covering
        fdatasync; it is added to the group's callbacks unless it is already the last one (a
        completion may cover records of several batches, in order)."""
        bodies = batch.entry_bodies
        if not bodies:
            return
        assert batch.parts is self._runs[-1].parts, "another append came between open and close"
        batch.parts.extend(fmt.entry_record_parts(bodies))
        callbacks = self._callbacks
        if not callbacks or callbacks[-1] is not completion:
            callbacks.append(completion)
        self._appended(offset, len(bodies))

    def _size_error(self, size: int) -> JournalError:
        what = "empty" if size <= 0 else f"over the maximum of {self._record_bytes_max}"
        return JournalError(f"record of {size} bytes is {what}")

    def _place(self, size: int) -> tuple[list[bytes], int, int]:
        """Where the next record of ``size`` bytes goes: ``(the run's parts, segment_id, offset)``,
        after rolling to the next segment if it does not fit in this one. A run's first record
        leaves room for the GROUP header before it. Raises when the journal is closed or failed."""
        if self._refusing:
            raise JournalError("journal is not writable") from self._failed
        parts = self._runs[-1].parts
        offset = self._offset if parts else self._offset + _GROUP_HEADER_BYTES
        if offset + size > self._segment_bytes:
            self._roll()
            parts = self._runs[-1].parts
            offset = self._offset + _GROUP_HEADER_BYTES
        return parts, self._segment_id, offset

    def _appended(self, end: int, records: int) -> None:
        """Account for the ``records`` records just appended, up to ``end``."""
        size = end - self._offset
        self._offset = end
        self._pending_records += records
        if not self._pending_bytes:
            self._first_append_s = self._clock.monotonic()
        self._pending_bytes += size
        self._after_append()

    def sync(self, callback: Callback) -> None:
        """``callback`` once everything appended so far is durable (FORCE_LEDGER)."""
        if self._failed is not None:
            callback(JournalError("journal failed"))
        elif self._pending_bytes or self._callbacks:
            self._callbacks.append(callback)
        elif self._inflight_callbacks is not None:
            self._inflight_callbacks.append(callback)
        else:
            self._loop.call_soon(callback, None)

    @property
    def segment_id(self) -> int:
        """The segment the next record goes to."""
        return self._segment_id

    @property
    def next_segment_ready(self) -> bool:
        """Whether the segment after the current one was already created ahead of time (so rolling
        into it takes no disk space: it is preallocated)."""
        return self._writer.spare_ready == self._segment_id + 1

    def roll(self, callback: Callback) -> bool:
        """End the current segment here: the next record goes to the next segment (bookie GC, so
        compaction can judge a segment whose dead bytes would otherwise stay until it filled up).

        Only into a segment created ahead of time (:attr:`next_segment_ready`: no disk space is
        needed, a full disk cannot fail the journal through it) and only when the current segment
        holds a record; else False and nothing happens (but for an idle journal whose next segment
        is not there yet, e.g. just restarted: the writer is asked to create it, try again soon).
        Otherwise True, and ``callback(None)`` runs once the records before the roll and the next
        segment's header are durable and every completion before it ran: from then on
        :attr:`synced_position` is in the next segment, so nothing of the old one is pending. On
        disk this is a natural roll (a record that did not fit): the old segment ends in zeros,
        replay goes on with the next one. ``callback(exc)`` when the journal fails first. Raises
        :class:`JournalError` when closed or failed."""
        if self._refusing:
            raise JournalError("journal is not writable") from self._failed
        if self._offset <= fmt.SEGMENT_HEADER_BYTES:
            return False
        if not self.next_segment_ready:
            if self._inflight_callbacks is None and not self._pending_bytes and not self._callbacks:
                # a group of nothing: after it the writer creates the next segment ahead, as always
                self._callbacks.append(_ignore)
                self._after_append()
            return False
        self._roll()
        # a group of no record: its last run writes the new segment's header and syncs it
        self._callbacks.append(callback)
        self._after_append()
        return True

    def _roll(self) -> None:
        self._runs[-1].end = self._previous_end = self._offset
        self._segment_id += 1
        self._offset = fmt.SEGMENT_HEADER_BYTES
        self._runs.append(_Run(self._segment_id, self._offset, self._previous_end))

    def _after_append(self) -> None:
        if self._pending_bytes + self._inflight_bytes > self._config.queue_bytes_max:
            self._set_pressure(True)
        if self._inflight_callbacks is not None or self._scheduled is not None:
            return
        wait_ms = self._config.group_wait_ms
        if wait_ms <= 0 or self._pending_bytes >= self._config.group_bytes:
            self._scheduled = self._loop.call_soon(self._flush)
        else:
            self._scheduled = self._loop.call_later(wait_ms / 1000.0, self._flush)

    def _flush(self) -> None:
        self._scheduled = None
        if self._inflight_callbacks is not None or self._failed is not None:
            return
        if not self._pending_bytes and not self._callbacks:
            return
        runs, callbacks = self._runs, self._callbacks
        if self._pending_bytes:
            self.queue_wait_seconds.observe(self._clock.monotonic() - self._first_append_s)
        runs[-1].end = self._offset
        end = Position(self._segment_id, self._offset)
        self._runs = [_Run(self._segment_id, self._offset, self._previous_end)]
        self._callbacks = []
        acked_early = None
        if failpoints.switched(failpoints.BUG_ACK_BEFORE_SYNC):  # a planted bug (tests/simulation)
            acked_early, callbacks = callbacks, []
        self._inflight_callbacks = callbacks
        self._inflight_bytes, self._pending_bytes = self._pending_bytes, 0
        self._inflight_records, self._pending_records = self._pending_records, 0
        self._idle.clear()
        self._thread.submit((runs, self._segment_id + 1, callbacks, end))
        if acked_early is not None:
            self._run_callbacks(acked_early, None)

    def _on_group_done(self, group: _Group, error: BaseException | None) -> None:
        _, _, callbacks, end = group
        self._inflight_callbacks = None
        group_bytes, self._inflight_bytes = self._inflight_bytes, 0
        records, self._inflight_records = self._inflight_records, 0
        if error is not None:
            self._fail(error, callbacks)
            return
        self._synced = end
        self.groups_written += 1
        self.records_written += records
        self.bytes_written += group_bytes
        self.group_records.observe(records)
        completion_start_s = self._clock.monotonic()
        self._run_callbacks(callbacks, None)
        self.completion_seconds.observe(self._clock.monotonic() - completion_start_s)
        if self._pressure and self._pending_bytes <= self._config.queue_bytes_max // 2:
            self._set_pressure(False)
        if self._pending_bytes or self._callbacks:
            self._schedule_next()
        else:
            self._idle.set()

    def _schedule_next(self) -> None:
        wait_ms = self._config.group_wait_ms
        waited_ms = (self._clock.monotonic() - self._first_append_s) * 1000.0
        if wait_ms <= 0 or self._pending_bytes >= self._config.group_bytes or waited_ms >= wait_ms:
            self._flush()  # at once, not next tick: a tick of socket reads would delay the writer
        else:
            self._scheduled = self._loop.call_later((wait_ms - waited_ms) / 1000.0, self._flush)

    @staticmethod
    def _run_callbacks(callbacks: list[Callback], error: BaseException | None) -> None:
        remaining = iter(callbacks)
        while True:
            try:
                for callback in remaining:
                    callback(error)
                return
            except Exception:
                # One broken completion must not strand the acks of the later records in the group:
                # the iterator resumes after the one that raised.
                log.exception("journal.callback_failed")

    def _fail(self, error: BaseException, callbacks: list[Callback]) -> None:
        log.error("journal.failed", error=repr(error))
        self._failed = error
        self._refusing = True
        wrapped = JournalError(f"journal write failed: {error!r}")
        wrapped.__cause__ = error
        pending, self._callbacks = self._callbacks, []
        self._run_callbacks(callbacks + pending, wrapped)
        self._pending_bytes = 0
        self._pending_records = 0
        self._set_pressure(False)
        self._idle.set()

    def _set_pressure(self, high: bool) -> None:
        if high != self._pressure:
            self._pressure = high
            if self.on_pressure is not None:
                self.on_pressure(high)

    async def close(self) -> None:
        """Flush and sync everything appended, then stop the writer thread."""
        self._closing = True
        self._refusing = True
        if self._failed is None and (self._pending_bytes or self._callbacks):
            if self._scheduled is not None:
                self._scheduled.cancel()
                self._scheduled = None
            if self._inflight_callbacks is None:
                self._flush()
        while not self._idle.is_set():
            await self._idle.wait()
            if self._failed is None and self._pending_bytes and self._inflight_callbacks is None:
                self._flush()
        self._shutdown_thread()

    def abort(self) -> None:
        """Stop at once: pending records are dropped (never acknowledged)."""
        self._closing = True
        self._refusing = True
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        error = JournalError("journal aborted")
        pending, self._callbacks = self._callbacks, []
        self._pending_records = 0
        self._run_callbacks(pending, error)
        self._shutdown_thread()

    def _shutdown_thread(self) -> None:
        self._thread.stop()
        with contextlib.suppress(OSError):
            self._writer.close_all()
