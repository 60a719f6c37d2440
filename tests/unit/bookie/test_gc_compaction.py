"""Bookie GC, compaction: segments holding mostly deleted data are copied out and deleted, the disk
space really comes back, every remaining entry reads back (also after a restart), and a crash at
each step (a failpoint raising, then the process state dropped as a kill would) loses nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

from bookie import compaction, replay
from bookie import journal_format as fmt
from bookie.gc import GarbageCollector, GcConfig
from bookie.journal import Journal
from bookie.storage import EntryCorrupt, NoLedger, Storage, StorageConfig
from bookkeeper_aio.common import failpoints

from .test_gc import Catalog, Clock
from .test_storage import JOURNAL, KEY, body, config, start_add

LEDGERS = range(1, 21)
ENTRIES = 60
KEPT = {3, 11}


def payload(ledger_id: int, entry_id: int) -> bytes:
    return bytes([ledger_id % 251]) * (700 + (entry_id * 37) % 400)


def entry(ledger_id: int, entry_id: int) -> bytes:
    return body(ledger_id, entry_id, entry_id - 1, payload(ledger_id, entry_id))


async def fill(storage: Storage) -> None:
    """Every ledger gets ENTRIES entries, interleaved: each segment holds some of every ledger."""
    for entry_id in range(ENTRIES):
        await asyncio.gather(*(start_add(storage, i, entry_id, entry(i, entry_id)) for i in LEDGERS))


def segments_on_disk(path: Path) -> dict[int, int]:
    journal = path / replay.JOURNAL_DIR
    out = {}
    for name in os.listdir(journal):
        segment_id = fmt.parse_segment_name(name)
        if segment_id is not None:
            out[segment_id] = (journal / name).stat().st_size
    return out


async def assert_kept_read_back(storage: Storage, kept: set[int] = KEPT) -> None:
    for ledger_id in sorted(kept):
        for entry_id in range(ENTRIES):
            assert (await storage.read_entry(ledger_id, entry_id))[1] == entry(ledger_id, entry_id)


def collector(storage: Storage, **overrides: object) -> GarbageCollector:
    settings: dict[str, object] = {"deleted_ledger_grace_s": 0.0, "compaction_rate_bytes_per_s": 1 << 30}
    settings.update(overrides)
    return GarbageCollector(storage, GcConfig(**settings), Catalog(set(KEPT)), Clock())  # type: ignore[arg-type]


async def test_compaction_returns_the_space_of_deleted_ledgers(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await fill(storage)
    before = segments_on_disk(tmp_path)
    assert len(before) >= 6
    gc = collector(storage)
    report = await gc.run_once()
    assert report.error is None
    assert report.ledgers_collected == len(LEDGERS) - len(KEPT)
    assert report.segments_compacted >= 4
    assert report.entries_copied > 0
    after = segments_on_disk(tmp_path)
    assert report.segments_deleted == len(set(before) - set(after)) >= 4
    assert sum(after.values()) < sum(before.values()) / 2
    assert report.bytes_freed == sum(size for s, size in before.items() if s not in after)
    # Nothing the index needs is in a deleted segment, every kept entry reads back.
    for ledger_id in KEPT:
        for _, location in storage.ledger(ledger_id).index.items():
            assert location.segment_id in after
    await assert_kept_read_back(storage)
    with pytest.raises(NoLedger):
        await storage.read_entry(1, 0)
    await storage.close()

    reopened = await Storage.open(config(tmp_path))
    assert sorted(reopened.ledgers) == sorted(KEPT)
    await assert_kept_read_back(reopened)
    again = await collector(reopened).run_once()  # nothing left to do
    assert (again.ledgers_collected, again.segments_deleted, again.entries_copied) == (0, 0, 0)
    await assert_kept_read_back(reopened)
    await reopened.close()


async def test_adds_during_compaction_are_kept(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await fill(storage)
    gc = collector(storage, compaction_rate_bytes_per_s=2 * 1024 * 1024)  # slow: adds interleave
    run = asyncio.ensure_future(gc.run_once())
    extra = 0
    while not run.done():
        await start_add(storage, 3, ENTRIES + extra, entry(3, ENTRIES + extra))
        extra += 1
    report = run.result()
    assert report.error is None
    assert report.segments_deleted > 0
    assert extra > 0
    for entry_id in range(ENTRIES + extra):
        assert (await storage.read_entry(3, entry_id))[1] == entry(3, entry_id)
    await storage.close()


@pytest.mark.parametrize(
    "failpoint",
    [
        "gc.copied=count:1:eio",
        "gc.copied=count:3:eio",
        "gc.before_checkpoint=eio",
        "index.checkpoint=count:2:eio",
        "gc.before_delete=eio",
        "gc.after_delete=count:1:eio",
        "gc.after_delete=count:3:eio",
    ],
)
async def test_a_crash_at_each_compaction_step_loses_nothing(tmp_path: Path, failpoint: str) -> None:
    storage = await Storage.open(config(tmp_path))
    await fill(storage)
    failpoints.configure(failpoint)
    try:
        report = await collector(storage).run_once()
    finally:
        failpoints.configure(None)
    assert report.error is not None
    assert "injected EIO" in report.error
    storage.abort()  # the process dies here: only what is on disk counts

    reopened = await Storage.open(config(tmp_path))
    await assert_kept_read_back(reopened)
    finished = await collector(reopened).run_once()  # the next pass completes the work
    assert finished.error is None
    await assert_kept_read_back(reopened)
    assert sum(segments_on_disk(tmp_path).values()) < 3 * 256 * 1024 + 16 * 1024
    await reopened.close()
    final = await Storage.open(config(tmp_path))
    assert sorted(final.ledgers) == sorted(KEPT)
    await assert_kept_read_back(final)
    await final.close()


async def test_a_damaged_live_record_keeps_its_segment(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await fill(storage)
    location = storage.ledger(3).index.get(5)
    assert location is not None
    await storage.close()
    path = tmp_path / replay.JOURNAL_DIR / fmt.segment_name(location.segment_id)
    data = bytearray(path.read_bytes())
    data[location.offset + location.length - 3] ^= 0xFF  # a byte of the entry body: its CRC fails
    path.write_bytes(bytes(data))

    storage = await Storage.open(config(tmp_path))
    report = await collector(storage).run_once()
    assert report.error is None
    assert report.entries_corrupt == 1
    assert location.segment_id in segments_on_disk(tmp_path)  # kept: it still holds a live record
    assert storage.ledger(3).index.get(5) == location
    with pytest.raises(EntryCorrupt):  # still EIO, never "no such entry"
        await storage.read_entry(3, 5)
    for entry_id in range(ENTRIES):
        if entry_id != 5:
            assert (await storage.read_entry(3, entry_id))[1] == entry(3, entry_id)
    await storage.close()


async def test_a_segment_the_checkpoint_needs_must_exist(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await fill(storage)
    await storage.write_checkpoint()
    first = min(segments_on_disk(tmp_path))
    await storage.close()
    os.remove(tmp_path / replay.JOURNAL_DIR / fmt.segment_name(first))
    with pytest.raises(fmt.JournalCorrupt, match="which is gone"):
        await Storage.open(config(tmp_path))


async def test_read_only_skips_copies_but_still_deletes_dead_segments(tmp_path: Path) -> None:
    """On a full disk (read-only) copies would take space the journal needs: they are skipped, but
    wholly dead segments are deleted, which is what gives the space back."""
    storage = await Storage.open(config(tmp_path))
    await fill(storage)  # interleaved: every segment holds some of the kept ledgers
    for ledger_id in LEDGERS:  # then ledger 30 alone fills segments that will be wholly dead
        if ledger_id not in KEPT:
            storage.forget_ledger(ledger_id)
    for first in range(0, 1200, 100):
        await asyncio.gather(*(start_add(storage, 30, e, entry(30, e)) for e in range(first, first + 100)))
    await start_add(storage, 3, ENTRIES, entry(3, ENTRIES))  # the head moves on past them
    before = segments_on_disk(tmp_path)
    refused: list[str | None] = ["bookie is read-only: disk low"]
    gc = GarbageCollector(
        storage,
        GcConfig(deleted_ledger_grace_s=0.0, compaction_rate_bytes_per_s=1 << 30),
        Catalog(set(KEPT)),
        Clock(),
        copy_refused=lambda: refused[0],
    )
    report = await gc.run_once()
    assert report.error is None
    assert report.ledgers_collected == 1
    assert report.progress.skipped == "bookie is read-only: disk low"
    assert report.bytes_copied == 0
    assert report.segments_deleted >= 2
    after = segments_on_disk(tmp_path)
    assert report.bytes_freed == sum(size for s, size in before.items() if s not in after) > 0
    await assert_kept_read_back(storage)

    refused[0] = None  # writable again: the mixed segments are compacted too
    report = await gc.run_once()
    assert report.error is None
    assert report.bytes_copied > 0
    assert report.segments_deleted > 0
    await assert_kept_read_back(storage)
    await storage.close()


async def test_compaction_runs_when_the_metadata_listing_fails(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await fill(storage)
    for ledger_id in LEDGERS:  # collected by an earlier pass
        if ledger_id not in KEPT:
            storage.forget_ledger(ledger_id)
    gc = collector(storage)
    assert isinstance(gc.catalog, Catalog)
    gc.catalog.error = ConnectionError("etcd is down")
    report = await gc.run_once()
    assert report.error is not None
    assert "etcd is down" in report.error
    assert report.segments_compacted > 0
    assert report.segments_deleted > 0
    await assert_kept_read_back(storage)
    await storage.close()


async def test_reads_racing_the_switch_and_the_deletes_always_find_their_entry(tmp_path: Path) -> None:
    """Reads planned against a segment just before its entries move and it is deleted still read
    the entry (the delete runs behind them on the reader's executor), and reads after read the copy."""
    storage = await Storage.open(config(tmp_path))
    await fill(storage)
    gc = collector(storage)
    run = asyncio.ensure_future(gc.run_once())
    reads = 0
    while not run.done():
        batch = [storage.read_entry(ledger_id, e) for ledger_id in KEPT for e in range(ENTRIES)]
        batch += [storage.read_range(ledger_id, 0, ENTRIES, 1 << 20) for ledger_id in KEPT]
        results = await asyncio.gather(*batch)
        for (ledger_id, entry_id), result in zip(
            [(i, e) for i in KEPT for e in range(ENTRIES)], results[: len(KEPT) * ENTRIES], strict=True
        ):
            assert result == (entry_id, entry(ledger_id, entry_id))
        for ledger_id, bodies in zip(KEPT, results[len(KEPT) * ENTRIES :], strict=True):
            assert bodies == [entry(ledger_id, e) for e in range(ENTRIES)]
        reads += len(batch)
    report = run.result()
    assert report.error is None
    assert report.segments_deleted >= 4
    assert reads > 0
    await assert_kept_read_back(storage)
    await storage.close()


async def test_a_gap_after_the_checkpoint_still_refuses(tmp_path: Path) -> None:
    """GC's gaps are only ever before the checkpoint's segment; one in the replayed part is data
    lost, and the bookie refuses to start."""
    storage = await Storage.open(config(tmp_path))
    await start_add(storage, 1, 0, entry(1, 0))
    await storage.write_checkpoint()  # its position is in the first segment
    await fill(storage)  # later segments, replayed from the checkpoint
    storage.abort()  # no final checkpoint: the last one stays in the first segment
    segments = sorted(segments_on_disk(tmp_path))
    assert len(segments) >= 4
    os.remove(tmp_path / replay.JOURNAL_DIR / fmt.segment_name(segments[2]))
    with pytest.raises(fmt.JournalCorrupt, match="a segment is missing"):
        await Storage.open(config(tmp_path))


async def test_a_journal_that_is_never_idle_slows_compaction_but_cannot_stop_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = await Storage.open(config(tmp_path))
    await fill(storage)
    monkeypatch.setattr(compaction, "BACKLOG_WAIT_S_MAX", 0.1)
    monkeypatch.setattr(Journal, "under_pressure", property(lambda self: True))  # endless backlog
    gc = collector(storage)
    run = asyncio.ensure_future(gc.run_once())
    seen_paused = False
    while not run.done():
        if gc.running is not None and gc.running.progress.paused == "journal backlog":
            seen_paused = True
        await asyncio.sleep(0.01)
    report = run.result()
    assert seen_paused
    assert report.error is None
    assert report.bytes_copied > 0
    assert report.segments_deleted >= 4
    await assert_kept_read_back(storage)
    await storage.close()


BIG_SEGMENT = dataclasses.replace(JOURNAL, segment_bytes=64 * 1024 * 1024)


def big_segment_config(path: Path) -> StorageConfig:
    """Segments far larger than the data: everything lives in the journal's current segment."""
    return dataclasses.replace(config(path), journal=BIG_SEGMENT)


def roll_collector(storage: Storage) -> GarbageCollector:
    return collector(storage, compaction_roll_dead_bytes=64 * 1024)


async def test_the_current_segment_is_rolled_when_mostly_dead_and_then_compacted(tmp_path: Path) -> None:
    """Deleted ledgers whose records all lie in the segment being written: the pass rolls the
    journal (the next record goes to the segment created ahead), compacts the old segment and
    deletes it; the space comes back, everything kept reads back, also after a restart."""
    storage = await Storage.open(big_segment_config(tmp_path))
    await fill(storage)
    before = segments_on_disk(tmp_path)
    head = storage.journal.segment_id
    assert max(before) <= head + 1  # the current one and the one created ahead: never judged so far
    unrolled = await collector(storage, compaction_roll_dead_bytes=0).run_once()  # as it was
    assert (unrolled.segments_rolled, unrolled.segments_deleted) == (0, 0)
    assert unrolled.ledgers_collected == len(LEDGERS) - len(KEPT)

    report = await roll_collector(storage).run_once()
    assert report.error is None
    assert report.segments_rolled == 1
    assert report.progress.rolled == head
    assert report.entries_copied == len(KEPT) * ENTRIES
    assert report.segments_deleted == 1
    after = segments_on_disk(tmp_path)
    assert head not in after
    assert storage.journal.segment_id == head + 1
    await assert_kept_read_back(storage)
    for ledger_id in KEPT:
        for _, location in storage.ledger(ledger_id).index.items():
            assert location.segment_id == head + 1
    again = await roll_collector(storage).run_once()  # the new head is all live: left alone
    assert (again.segments_rolled, again.segments_deleted, again.entries_copied) == (0, 0, 0)
    await storage.close()

    reopened = await Storage.open(big_segment_config(tmp_path))
    assert sorted(reopened.ledgers) == sorted(KEPT)
    await assert_kept_read_back(reopened)
    await start_add(reopened, 3, ENTRIES, entry(3, ENTRIES))
    await reopened.close()


async def test_a_segment_of_deleted_ledgers_only_is_rolled_and_deleted_even_read_only(tmp_path: Path) -> None:
    """Read-only (a full disk): a current segment holding nothing live is rolled (into the segment
    created ahead: no space needed) and deleted without a copy; one holding live records is not
    rolled (its copies would need space)."""
    storage = await Storage.open(big_segment_config(tmp_path))
    await fill(storage)
    head = storage.journal.segment_id
    refused: list[str | None] = ["bookie is read-only: disk low"]
    catalog = Catalog(set(KEPT))
    settings = GcConfig(
        deleted_ledger_grace_s=0.0, compaction_rate_bytes_per_s=1 << 30, compaction_roll_dead_bytes=64 * 1024
    )
    gc = GarbageCollector(storage, settings, catalog, Clock(), copy_refused=lambda: refused[0])
    report = await gc.run_once()  # the kept ledgers live there: no roll
    assert (report.segments_rolled, report.segments_deleted) == (0, 0)
    catalog.ids = set()  # then every ledger is deleted
    report = await gc.run_once()
    assert report.error is None
    assert (report.segments_rolled, report.segments_deleted, report.bytes_copied) == (1, 1, 0)
    assert head not in segments_on_disk(tmp_path)
    await storage.close()
    reopened = await Storage.open(big_segment_config(tmp_path))
    assert not reopened.ledgers
    await reopened.close()


@pytest.mark.parametrize(
    "failpoint",
    [
        "gc.rolled=eio",
        "journal.before_fdatasync=count:1:eio",
        "gc.copied=count:1:eio",
        "gc.before_checkpoint=eio",
        "gc.before_delete=eio",
        "gc.after_delete=count:1:eio",
    ],
)
async def test_a_crash_at_each_step_of_compacting_a_rolled_segment_loses_nothing(
    tmp_path: Path, failpoint: str
) -> None:
    storage = await Storage.open(big_segment_config(tmp_path))
    await fill(storage)
    head = storage.journal.segment_id
    await collector(storage, compaction_roll_dead_bytes=0).run_once()  # collect, no roll yet
    failpoints.configure(failpoint)
    try:
        report = await roll_collector(storage).run_once()
    finally:
        failpoints.configure(None)
    assert report.error is not None
    storage.abort()  # the process dies here: only what is on disk counts

    reopened = await Storage.open(big_segment_config(tmp_path))
    assert sorted(reopened.ledgers) == sorted(KEPT)
    await assert_kept_read_back(reopened)
    await start_add(reopened, 3, ENTRIES, entry(3, ENTRIES))  # the journal goes on
    finished = await roll_collector(reopened).run_once()  # the next pass completes the work
    assert finished.error is None
    assert head not in segments_on_disk(tmp_path)
    await assert_kept_read_back(reopened)
    await reopened.close()
    final = await Storage.open(big_segment_config(tmp_path))
    await assert_kept_read_back(final)
    assert (await final.read_entry(3, ENTRIES))[1] == entry(3, ENTRIES)
    await final.close()


async def test_walks_skip_ledgers_without_entries_and_count_every_entry() -> None:
    """The index walks of a pass (live bytes per segment, the entries in judged segments) step over
    empty ledgers, share loop turns between small ones, and still see every entry: dense, in the
    overflow only, and in a ledger bigger than one step."""
    from bookie.index import DENSE_GAP_MAX
    from bookie.ledger_state import LedgerState

    ledgers: dict[int, LedgerState] = {i: LedgerState(i) for i in range(1, 2001)}  # empty
    ledgers[7].index.put(3, 2, 100, 50)
    ledgers[8].index.put(DENSE_GAP_MAX * 5, 3, 16, 70)
    ledgers[8].index.put(0, 4, 16, 30)  # far below the base: the overflow
    for entry_id in range(compaction.WALK_SLOTS_PER_STEP * 2 + 5):
        ledgers[9].index.put(entry_id, 2 + entry_id % 2, 200 + entry_id, 10)
    storage = type("S", (), {"ledgers": ledgers})()
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    counter = asyncio.get_running_loop().create_task(count_turns())
    usage = await compaction.segment_usage(storage)  # type: ignore[arg-type]
    live = await compaction._live_entries(storage, frozenset({3, 4}))  # type: ignore[arg-type]
    counter.cancel()
    steps = 2 * compaction.WALK_SLOTS_PER_STEP + 5
    assert usage == {2: 50 + (steps + 1) // 2 * 10, 3: 70 + steps // 2 * 10, 4: 30}
    assert [(lid, eid) for _, lid, eid, _ in live[4]] == [(8, 0)]
    assert len(live[3]) == 1 + steps // 2
    assert 2 <= turns < 20  # the big ledger yields; 2000 empty ledgers cost no turn each


def _write_format_2_journal(path: Path) -> int:
    """The journal ``fill`` makes, as a bookie of journal format 2 wrote it (version-2 segments,
    ENTRY records of type 1), over what a fresh start left in ``path``; returns its last segment."""
    journal = path / replay.JOURNAL_DIR
    for name in os.listdir(journal):
        os.remove(journal / name)
    records = [fmt.encode_master_key(i, KEY) for i in LEDGERS]
    records += [fmt.encode_entry_v2(i, e, entry(i, e)) for e in range(ENTRIES) for i in LEDGERS]
    segment_id, out = 1, bytearray()
    for start in range(0, len(records), 20):
        group = b"".join(records[start : start + 20])
        if out and len(out) + fmt.GROUP_HEADER_BYTES + len(group) > JOURNAL.segment_bytes:
            (journal / fmt.segment_name(segment_id)).write_bytes(bytes(out))
            segment_id, out = segment_id + 1, bytearray()
        if not out:
            out += fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, 2, segment_id)
        out += fmt.encode_group_header(segment_id, len(out), len(group)) + group
    (journal / fmt.segment_name(segment_id)).write_bytes(bytes(out))
    return segment_id


async def test_format_2_records_are_compacted_as_they_are(tmp_path: Path) -> None:
    """Compaction of a journal written in format 2: the live records are copied byte for byte into
    format-3 segments (a record says its own kind), the old segments go, and every kept entry reads
    back, before and after a restart."""
    storage = await Storage.open(config(tmp_path))
    storage.abort()
    last = _write_format_2_journal(tmp_path)
    assert last >= 5
    storage = await Storage.open(config(tmp_path))
    await assert_kept_read_back(storage)
    report = await collector(storage).run_once()
    assert report.error is None
    assert report.segments_deleted >= 4
    assert report.entries_copied > 0
    copies = [
        location
        for i in KEPT
        for _, location in storage.ledger(i).index.items()
        if location.segment_id > last
    ]
    assert copies
    await assert_kept_read_back(storage)
    await storage.close()
    kinds = set()
    for segment_id in sorted({c.segment_id for c in copies}):
        data = (tmp_path / replay.JOURNAL_DIR / fmt.segment_name(segment_id)).read_bytes()
        assert fmt.segment_format(data) == fmt.SEGMENT_VERSION
        kinds |= {r.type for r in fmt.scan(data, fmt.SEGMENT_HEADER_BYTES, segment_id).records}
    assert fmt.RecordType.ENTRY_V2 in kinds
    reopened = await Storage.open(config(tmp_path))
    assert sorted(reopened.ledgers) == sorted(KEPT)
    await assert_kept_read_back(reopened)
    await reopened.close()
