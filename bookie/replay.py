"""Startup recovery: load the checkpoint, replay the journal after it, cut a torn tail.

Blocking; runs once before the bookie serves (in a worker thread). Follows the decision table of
:mod:`bookie.journal_format`: the final group, torn by a crash or a power loss (any subset of its
pages), is zeroed and synced (logged with its offset and size); damage followed by a later group, or
by a later segment holding bytes, refuses to start with :class:`~bookie.journal_format.JournalCorrupt`,
naming the segment and offset; so do a segment holding nothing before one holding bytes, and a
segment whose groups end short of where the next segment's header says its writer ended it.

A cut that zeroes anything is made under a durable limbo marker, written before the cut
(:mod:`bookie.limbo`): the final group may have been synced and acknowledged (bit rot looks like a
torn write), so the ledgers it may have held answer "unknown" until metadata settles them. Unless
the journal's synced mark, written in the boot still running, puts the cut exactly at the synced
end (:mod:`bookie.journal_format`): then a process crash tore a write never synced, so never
acknowledged, and the cut loses nothing anyone was told is durable.

What replay served is made durable before the bookie relies on it (:func:`_make_durable`): after a
process crash the page cache may hold whole groups never synced (their fdatasync failed, or never
ran); the bytes past this boot's synced mark are written again and every replayed segment synced.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
from dataclasses import dataclass, field

import structlog

from bookie import checkpoint
from bookie import journal_format as fmt
from bookie import limbo as limbo_marker
from bookie.fileio import FileIO
from bookie.journal_format import Position
from bookie.ledger_state import LedgerState
from bookie.threads import GilShare

log = structlog.get_logger(__name__)

JOURNAL_DIR = "journal"
INDEX_DIR = "index"
CHECKPOINT_FILE = "checkpoint"

# Enum members as module names: on Python 3.11 ``Enum.MEMBER`` is a slow attribute lookup (about a
# thousand instructions), and replay compares every record's type.
_ENTRY_TYPES = fmt.ENTRY_TYPES
_MASTER_KEY, _FENCE = fmt.RecordType.MASTER_KEY, fmt.RecordType.FENCE
_EXPLICIT_LAC, _REKEY = fmt.RecordType.EXPLICIT_LAC, fmt.RecordType.REKEY
_VALID, _ZERO = fmt.SegmentHeader.VALID, fmt.SegmentHeader.ZERO
_CLEAN, _CORRUPT = fmt.Tail.CLEAN, fmt.Tail.CORRUPT


@dataclass
class Recovered:
    ledgers: dict[int, LedgerState]
    start: Position  # where the journal continues appending
    start_format: int = fmt.SEGMENT_VERSION
    """The format version of the segment at ``start``: when it is an older one the journal goes on
    in the next segment (``journal_format``'s module doc), never adds records of this format to it."""
    replayed_from: Position | None = None
    """Where replay started: the position of the checkpoint on disk, or the journal's start when
    there is none. Everything after it is what a checkpoint has yet to cover."""
    records_replayed: int = 0
    torn_bytes_cut: int = 0
    segments: list[int] = field(default_factory=list)
    limbo: limbo_marker.Limbo | None = None
    """The ledgers in limbo (the marker on disk, this cut's included); None without a marker."""
    previous_end: int = 0
    """Where the segment before ``start``'s ended, for that segment's header when the journal
    writes it (``start`` just past it); 0 when unknown (gone, or behind the checkpoint)."""


def apply_record(ledgers: dict[int, LedgerState], segment_id: int, record: fmt.Record) -> None:
    """Apply one durable journal record to in-memory state (idempotent)."""
    body = record.body
    ledger_id = fmt.parse_ledger(body)
    state = ledgers.get(ledger_id)
    if state is None:
        state = ledgers[ledger_id] = LedgerState(ledger_id)
    state.row = None  # the checkpoint row kept from the file no longer says it all
    if record.type in _ENTRY_TYPES:
        _, entry_id = fmt.parse_ledger_entry(body)
        state.index.put(entry_id, segment_id, record.offset, record.length)
        entry = fmt.entry_of(record)
        if len(entry) >= 24:
            state.advance_piggyback(int.from_bytes(entry[16:24], "big", signed=True))
    elif record.type == _MASTER_KEY:
        if state.master_key is None:
            state.master_key = bytes(body[8:])
    elif record.type == _FENCE:
        state.fenced = True
        state.fence_durable = True
    elif record.type == _EXPLICIT_LAC:
        _, lac = fmt.parse_ledger_entry(body)
        state.advance_explicit(lac, bytes(body[16:]))
    elif record.type == _REKEY:  # what came before was a squatter's: start anew
        state.rekey(bytes(body[8:]))


def segment_ids(fileio: FileIO, journal_dir: str) -> list[int]:
    """The journal segments on disk, in order."""
    ids = []
    for name in fileio.listdir(journal_dir):
        segment_id = fmt.parse_segment_name(name)
        if segment_id is not None:
            ids.append(segment_id)
    return sorted(ids)


def _check_consecutive(ids: list[int]) -> None:
    """Segments that replay reads must all be there: a gap means journal data is gone. (Below the
    checkpoint's segment gaps are normal: bookie GC deletes segments nothing needs any more.)"""
    for before, after in itertools.pairwise(ids):
        if after != before + 1:
            raise fmt.JournalCorrupt(f"journal segments {before:016x} -> {after:016x}: a segment is missing")


def _check_indexed_segments(ledgers: dict[int, LedgerState], ids: list[int]) -> None:
    """Every segment the checkpoint's index points into must exist (GC deletes a segment only once
    a durable checkpoint no longer points into it): otherwise entries would read as EIO."""
    present = set(ids)
    tick = GilShare().tick
    for state in ledgers.values():
        tick()
        if not state.index.count:
            continue
        missing = sorted(state.index.segment_ids() - present)
        if missing:
            raise fmt.JournalCorrupt(
                f"the index checkpoint points ledger {state.ledger_id} into journal segment "
                f"{missing[0]:016x}, which is gone: refusing to start (entries would be lost). "
                "Restore the segment, or wipe the bookie and let re-replication rebuild it."
            )


def load_checkpoint(
    fileio: FileIO, data_dir: str, row_cache_bytes_max: int = 0
) -> tuple[Position | None, dict[int, LedgerState]]:
    path = os.path.join(data_dir, INDEX_DIR, CHECKPOINT_FILE)
    if not fileio.exists(path):
        return None, {}
    position, ledgers = checkpoint.decode(fileio.read_file(path), row_cache_bytes_max)
    return position, ledgers


def recover(
    fileio: FileIO, data_dir: str, row_cache_bytes_max: int = 0, *, limbo_after_cut: bool = True
) -> Recovered:
    """Rebuild in-memory state from checkpoint + journal. Raises JournalCorrupt / CheckpointCorrupt.
    Checkpoint rows up to ``row_cache_bytes_max`` are kept for the next checkpoint
    (:func:`bookie.checkpoint.decode`); replay drops the row of every ledger it changes. A cut that
    zeroes anything is made under a durable limbo marker unless ``limbo_after_cut`` is off."""
    journal_dir = os.path.join(data_dir, JOURNAL_DIR)
    index_dir = os.path.join(data_dir, INDEX_DIR)
    if not (fileio.exists(journal_dir) and fileio.exists(index_dir)):
        fileio.makedirs(journal_dir)
        fileio.makedirs(index_dir)
        fileio.fsync_dir(data_dir)  # the directories outlive a power cut, as the files in them
    position, ledgers = load_checkpoint(fileio, data_dir, row_cache_bytes_max)
    ids = segment_ids(fileio, journal_dir)
    if position is None:
        if ids and ids[0] != 1:
            raise fmt.JournalCorrupt(
                f"no index checkpoint, and the journal starts at segment {ids[0]:016x}: segments "
                "before it were deleted (bookie GC deletes one only once a checkpoint covers it), so "
                "the checkpoint was lost: refusing to start (ledgers would be missing). Restore "
                f"{INDEX_DIR}/{CHECKPOINT_FILE}, or wipe the bookie and let re-replication rebuild it."
            )
        _check_consecutive(ids)
        position = Position(ids[0] if ids else 1, fmt.SEGMENT_HEADER_BYTES)
    elif position.segment_id not in ids:
        raise fmt.JournalCorrupt(
            f"checkpoint points into journal segment {position.segment_id:016x}, which is gone"
        )
    else:
        _check_consecutive([i for i in ids if i >= position.segment_id])
        _check_indexed_segments(ledgers, ids)
    # a journal whose segment holds nothing yet starts just past the header its first group writes
    start = Position(position.segment_id, max(position.offset, fmt.SEGMENT_HEADER_BYTES))
    result = Recovered(ledgers, start, replayed_from=position, segments=ids)
    damaged: tuple[int, int] | None = None  # segment and offset of the damage found so far
    torn: tuple[int, int, int] | None = None
    empty: int | None = None  # the first segment found holding nothing
    replayed: dict[int, int] = {}  # segment -> the end of its whole groups replayed
    ends: dict[int, int] = {}  # segment -> where its whole groups end, as scanned
    recorded: dict[int, int] = {}  # segment -> where its header says the segment before it ended
    for segment_id in (i for i in ids if i >= position.segment_id):
        path = os.path.join(journal_dir, fmt.segment_name(segment_id))
        data = fileio.map_read(path)
        if data is None:
            _check_not_behind_checkpoint(segment_id, 0, position)
            empty = segment_id if empty is None else empty
            continue  # created, never written (or its bytes are gone: a later segment says which)
        try:
            scanned = _scan_segment(data, segment_id, position)
            if scanned is None:
                empty = segment_id if empty is None else empty
                continue  # created ahead of time, never written (or zeroed: as above)
            scan, recorded[segment_id] = scanned
            if damaged is not None:
                # any byte of a later segment, its header alone included (a roll: bookie GC), was
                # written after the damaged one's last group was synced: the damage is to synced data
                bad_id, bad_at = damaged
                raise fmt.JournalCorrupt(
                    f"journal segment {bad_id:016x} is damaged at offset {bad_at} but later segment "
                    f"{segment_id:016x} holds data: refusing to start (no silent truncation)"
                )
            if empty is not None:
                # the writer writes a segment's header (with its first group) before any later
                # segment gets a byte: a segment holding nothing before this one lost all it held
                raise fmt.JournalCorrupt(
                    f"journal segment {empty:016x} holds nothing (empty or all zeros) but later "
                    f"segment {segment_id:016x} holds data: the records it held are gone; refusing "
                    "to start (no silent truncation). Restore the segment, or wipe the bookie and "
                    "let re-replication rebuild it."
                )
            _check_previous_end(segment_id, recorded[segment_id], ends)
            tick = GilShare().tick
            for record in scan.records:
                tick()
                apply_record(ledgers, segment_id, record)
            result.records_replayed += len(scan.records)
            ends[segment_id] = scan.end
            if scan.end > 0:
                replayed[segment_id] = scan.end
            if scan.groups or segment_id == position.segment_id or scan.end > 0:
                # a segment with its header alone (a roll) is where the journal went on; a cut from
                # offset 0 (torn segment header) appends just past the header to come
                result.start = Position(segment_id, scan.end or fmt.SEGMENT_HEADER_BYTES)
                # a cut from offset 0 leaves the segment to be written anew, header first
                result.start_format = fmt.segment_format(data) if scan.end else fmt.SEGMENT_VERSION
            if scan.tail is not _CLEAN:
                damaged = (segment_id, scan.bad)
                torn = (segment_id, scan.end, scan.garbage_end)
            del scan
        finally:
            with contextlib.suppress(BufferError):  # a lingering view: the map is freed with it
                data.close()
    synced = _synced_mark(fileio, data_dir)
    if torn is not None:
        segment_id, end, garbage_end = torn
        never_synced = _never_synced(synced, Position(segment_id, end))
        # the marker is durable before the cut: a crash between keeps it
        if garbage_end > end and limbo_after_cut and not never_synced:
            where = f"journal segment {segment_id:016x} offset {end}, {garbage_end - end} bytes"
            limbo_marker.enter_blocking(fileio, data_dir, f"torn tail cut at {where}")
        result.torn_bytes_cut = _cut_torn_tail(fileio, journal_dir, *torn, never_synced=never_synced)
    _make_durable(fileio, journal_dir, replayed, synced)  # the journal then marks its start synced
    result.limbo = limbo_marker.load_blocking(fileio, data_dir)
    segment_id = result.start.segment_id
    result.previous_end = recorded.get(segment_id) or ends.get(segment_id - 1, 0)
    return result


def _check_previous_end(segment_id: int, previous_end: int, ends: dict[int, int]) -> None:
    """The segment before ``segment_id``, when it was replayed, must end exactly where its writer
    ended it (``previous_end``, recorded in ``segment_id``'s header; 0: nothing recorded). Short of
    it, its last groups were lost (zeros look like space never written): synced, acknowledged data."""
    end = ends.get(segment_id - 1)
    if previous_end and end is not None and end != previous_end:
        raise fmt.JournalCorrupt(
            f"journal segment {segment_id - 1:016x}: its groups end at offset {end} but the writer "
            f"ended it at offset {previous_end} (recorded in segment {segment_id:016x}): the records "
            "in between are gone; refusing to start (no silent truncation). Inspect the segment; "
            "the bookie's data on this disk cannot be trusted as is."
        )


def _scan_segment(data: mmap.mmap, segment_id: int, position: Position) -> tuple[fmt.ScanResult, int] | None:
    """Scan one segment: its scan and where its header says the segment before it ended (0: not
    recorded); None when it was never written. A zero or garbled segment header over non-zero bytes
    is the start of a torn final group (scanned from offset 0: everything is cut) unless a group
    header after it, or the checkpoint, says the segment was synced."""
    header = fmt.check_segment_header(data, segment_id)
    if header is not _VALID:
        if header is _ZERO and fmt.is_all_zero(data):
            _check_not_behind_checkpoint(segment_id, 0, position)
            return None
        if segment_id == position.segment_id and position.offset > fmt.SEGMENT_HEADER_BYTES:
            raise fmt.JournalCorrupt(
                f"journal segment {segment_id:016x}: its header is {header.value} but the index "
                f"checkpoint covers offset {position.offset} in it: refusing to start"
            )
        scan = fmt.scan(data, 0, segment_id)  # no group header can be at 0: nothing is whole
        if scan.tail is _CORRUPT:
            raise fmt.JournalCorrupt(
                f"journal segment {segment_id:016x}: its header is {header.value} but a group at "
                f"offset {scan.evidence} follows: refusing to start (no silent truncation). Inspect "
                "the segment; the bookie's data on this disk cannot be trusted as is."
            )
        return scan, 0
    _check_not_behind_checkpoint(segment_id, len(data), position)
    first_group, previous_end = fmt.segment_layout(data)
    start = first_group
    if segment_id == position.segment_id and position.offset > fmt.SEGMENT_HEADER_BYTES:
        start = position.offset  # no group ends before the header's end: less is the first group
    scan = fmt.scan(data, start, segment_id)
    if scan.tail is _CORRUPT:
        raise fmt.JournalCorrupt(
            f"journal segment {segment_id:016x}: damage at offset {scan.bad} (in the group at offset "
            f"{scan.end}) and a later group's data at offset {scan.evidence}: refusing to start (no "
            "silent truncation; the later group was written after the damaged one was synced). "
            "Inspect the segment; the bookie's data on this disk cannot be trusted as is."
        )
    return scan, previous_end


def _check_not_behind_checkpoint(segment_id: int, size: int, position: Position) -> None:
    """The checkpoint's segment must still hold everything the checkpoint indexed."""
    if segment_id == position.segment_id and position.offset > max(size, fmt.SEGMENT_HEADER_BYTES):
        raise fmt.JournalCorrupt(
            f"journal segment {segment_id:016x} holds {size} bytes but the index checkpoint covers "
            f"{position.offset}: journal data the index points at is gone; refusing to start"
        )


def _synced_mark(fileio: FileIO, data_dir: str) -> Position | None:
    """Where the synced mark says the synced bytes end, when it was written in the boot still
    running (a process crash keeps what it wrote); None for a mark from another boot, a missing or
    damaged one, or a boot id that cannot be read."""
    boot = fileio.boot_id()
    path = os.path.join(data_dir, fmt.SYNCED_MARK_FILE)
    if boot is None or not fileio.exists(path):
        return None
    mark = fmt.decode_synced_mark(fileio.read_file(path))
    if mark is None or mark.boot != fmt.boot_digest(boot):
        return None
    return mark.position


def _never_synced(synced: Position | None, cut: Position) -> bool:
    """Whether the bytes from ``cut`` on were never synced, so never acknowledged: ``synced``, this
    boot's synced mark (:func:`_synced_mark`), says the synced bytes end exactly where the cut
    starts, as the one group in flight did (or at the start of the next segment, for a group whose
    older run was synced before its newer one was written). A cut anywhere else, or no mark of this
    boot: not proven."""
    if synced is None:
        return False
    return cut == synced or (
        cut.segment_id == synced.segment_id + 1 and cut.offset <= fmt.SEGMENT_HEADER_BYTES
    )


def _make_durable(
    fileio: FileIO, journal_dir: str, replayed: dict[int, int], synced: Position | None
) -> None:
    """Make every journal byte replay served durable before anything relies on it (a checkpoint
    points into it; appends go on after it). After a process crash the page cache may hold a group
    whose fdatasync failed, or never ran: replayed as is, then checkpointed, a later power cut
    would drop it from under the checkpoint, a record that fails its checksum for good. Bytes past
    this boot's synced mark are written again first (a page whose writeback failed may be marked
    clean, and a sync alone would not write it), then every replayed segment is synced (nothing
    to write for the clean ones). A mark at or before its segment's header end does not cover the
    header: a journal starts there (its mark too) with the header unwritten, and its first group
    writes the header with its records, so a failed sync of theirs was the header's too: that
    segment is written again from its start."""
    for segment_id, end in sorted(replayed.items()):
        path = os.path.join(journal_dir, fmt.segment_name(segment_id))
        fd = fileio.open_append(path)
        try:
            if synced is not None and segment_id >= synced.segment_id:
                start = synced.offset if segment_id == synced.segment_id else 0
                if start <= fmt.SEGMENT_HEADER_BYTES:
                    start = 0
                if end > start:
                    fileio.pwrite(fd, fileio.pread(fd, end - start, start), start)
                    log.info(
                        "journal.unsynced_replayed_made_durable",
                        segment=f"{segment_id:016x}",
                        offset=start,
                        bytes=end - start,
                    )
            fileio.fsync(fd)
        finally:
            fileio.close(fd)


def _cut_torn_tail(
    fileio: FileIO, journal_dir: str, segment_id: int, end: int, garbage_end: int, *, never_synced: bool
) -> int:
    """Zero the torn bytes after the last whole record and make that durable."""
    size = garbage_end - end
    path = os.path.join(journal_dir, fmt.segment_name(segment_id))
    fd = fileio.open_append(path)
    try:
        fileio.pwrite(fd, bytes(size), end)
        fileio.fsync(fd)
    finally:
        fileio.close(fd)
    log.warning(
        "journal.torn_tail_cut",
        segment=f"{segment_id:016x}",
        offset=end,
        bytes=size,
        never_synced=never_synced,
    )
    return size
