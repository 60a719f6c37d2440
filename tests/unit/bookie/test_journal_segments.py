"""Records lost at the end of a journal segment that is not the last one: real segment files written
by the journal, damaged on disk between a crash and a restart (bookie/replay.py, the segment chain of
bookie/journal_format.py). Zeros there used to read as space never written: the bookie started
without the records and answered "no such entry" for acknowledged entries."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bookie import journal_format as fmt
from bookie.journal import JournalConfig
from bookie.storage import Storage, StorageConfig

from .test_storage import KEY, _roll, add, body, patch

SMALL = JournalConfig(segment_bytes=32 * 1024, record_bytes_max=8192)
PAYLOAD = b"p" * 3000  # about ten entries per segment, each in a group of its own


def config(path: Path) -> StorageConfig:
    return StorageConfig(data_dir=str(path), bookie_id="bookie-1", journal=SMALL, checkpoint_interval_s=3600)


def segment_file(path: Path, segment_id: int) -> Path:
    return path / "journal" / fmt.segment_name(segment_id)


async def write_segments(path: Path, segments: int) -> dict[int, tuple[int, int]]:
    """Entries of ledger 1 until ``segments`` segments hold some; then a crash (no checkpoint):
    entry id -> (segment, offset of its record)."""
    storage = await Storage.open(config(path))
    entry_id = 0
    while storage.journal.segment_id < segments or entry_id % 10 < 5:  # a few in the last one
        await add(storage, 1, entry_id, payload=PAYLOAD)
        entry_id += 1
    located = {e: (loc.segment_id, loc.offset) for e, loc in storage.ledger(1).index.items()}
    storage.abort()
    return located


async def read_all(path: Path, entries: int) -> None:
    storage = await Storage.open(config(path))
    try:
        for entry_id in range(entries):
            assert (await storage.read_entry(1, entry_id))[1] == body(1, entry_id, entry_id - 1, PAYLOAD)
    finally:
        storage.abort()


def last_group(located: dict[int, tuple[int, int]], segment_id: int) -> int:
    """Where the last group of ``segment_id`` starts (its one entry's record follows its header)."""
    last = max(offset for segment, offset in located.values() if segment == segment_id)
    return last - fmt.GROUP_HEADER_BYTES


@pytest.mark.parametrize(
    "damage", ["last group zeroed", "last group cut off", "segment zeroed", "segment emptied"]
)
async def test_records_lost_at_the_end_of_a_middle_segment_refuse_to_start(
    tmp_path: Path, damage: str
) -> None:
    origin = tmp_path / "origin"
    located = await write_segments(origin, 3)
    assert {segment for segment, _ in located.values()} == {1, 2, 3}
    work = tmp_path / "work"
    shutil.copytree(origin, work)
    await read_all(work, len(located))  # undamaged, the same journal starts and reads back whole
    shutil.rmtree(work)
    shutil.copytree(origin, work)
    middle = segment_file(work, 2)
    size = middle.stat().st_size
    if damage == "last group zeroed":  # its pages lost (a lost write, a zeroed extent)
        start = last_group(located, 2)
        patch(middle, start, bytes(size - start))
    elif damage == "last group cut off":
        os.truncate(middle, last_group(located, 2))
    elif damage == "segment zeroed":
        patch(middle, 0, bytes(size))
    else:
        os.truncate(middle, 0)
    with pytest.raises(fmt.JournalCorrupt, match="refusing to start") as refused:
        await Storage.open(config(work))
    assert fmt.segment_name(2)[8:24] in str(refused.value)


async def test_a_segment_header_written_again_after_a_restart_records_the_previous_end(
    tmp_path: Path,
) -> None:
    """GC rolls the journal, the bookie crashes with the new segment holding its header alone,
    restarts there and writes that header again with its first group: it must record where the
    segment before ended as the first one did (from replay), or a later loss there goes unseen."""
    storage = await Storage.open(config(tmp_path))
    for entry_id in range(3):
        await add(storage, 1, entry_id, payload=PAYLOAD)
    await _roll(storage)
    last = storage.ledger(1).index.get(2)
    assert last is not None
    assert last.segment_id == 1
    storage.abort()
    storage = await Storage.open(config(tmp_path))
    assert storage.journal.segment_id == 2
    await add(storage, 1, 3, payload=PAYLOAD)
    storage.abort()
    header = segment_file(tmp_path, 2).read_bytes()[: fmt.SEGMENT_HEADER_BYTES]
    assert fmt.segment_layout(header) == (fmt.SEGMENT_HEADER_BYTES, last.offset + last.length)
    # replay from the journal's start, as before the checkpoint the restart wrote at segment 2
    (tmp_path / "index" / "checkpoint").unlink()
    start = last.offset - fmt.GROUP_HEADER_BYTES
    patch(segment_file(tmp_path, 1), start, bytes(segment_file(tmp_path, 1).stat().st_size - start))
    with pytest.raises(fmt.JournalCorrupt, match="the writer ended it at offset"):
        await Storage.open(config(tmp_path))


def version_2_segment(segment_id: int, groups: list[list[bytes]]) -> bytes:
    """A segment as a bookie of journal format version 2 wrote it: the 16-byte header, then groups."""
    out = fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, 2, segment_id)
    for records in groups:
        out += fmt.encode_group_header(segment_id, len(out), sum(len(r) for r in records))
        out += b"".join(records)
    return out + bytes(4096)


async def test_a_version_2_journal_is_read_and_chained_from_the_first_new_segment(tmp_path: Path) -> None:
    """A bookie upgraded over a journal of 16-byte headers goes on in a new segment, whose header
    records where the last old one ended: a loss at its end is found like any other."""
    storage = await Storage.open(config(tmp_path))  # the cookie
    storage.abort()
    shutil.rmtree(tmp_path / "journal")
    (tmp_path / "journal").mkdir()
    entries = [[fmt.encode_entry_v2(1, e, body(1, e, e - 1, PAYLOAD))] for e in range(8)]
    first = version_2_segment(1, [[fmt.encode_master_key(1, KEY), *entries[0]], *entries[1:4]])
    segment_file(tmp_path, 1).write_bytes(first)
    segment_file(tmp_path, 2).write_bytes(version_2_segment(2, entries[4:]))
    storage = await Storage.open(config(tmp_path))
    for entry_id in range(8, 20):
        await add(storage, 1, entry_id, payload=PAYLOAD)
    assert storage.ledger(1).index.get(8).segment_id == 3  # type: ignore[union-attr]
    storage.abort()
    shutil.copytree(tmp_path, tmp_path / "copy", ignore=shutil.ignore_patterns("copy"))
    await read_all(tmp_path / "copy", 20)
    middle = segment_file(tmp_path, 2).read_bytes()
    assert fmt.check_segment_header(middle, 2) is fmt.SegmentHeader.VALID
    assert fmt.segment_layout(middle)[0] == fmt.SHORT_SEGMENT_HEADER_BYTES
    scan = fmt.scan(middle, fmt.SHORT_SEGMENT_HEADER_BYTES, 2)
    assert fmt.segment_layout(segment_file(tmp_path, 3).read_bytes()) == (fmt.SEGMENT_HEADER_BYTES, scan.end)
    start = scan.records[-1].offset - fmt.GROUP_HEADER_BYTES  # its last group, zeroed
    patch(segment_file(tmp_path, 2), start, bytes(len(middle) - start))
    # replay from the journal's start, as before the checkpoint the restart wrote past segment 2
    (tmp_path / "index" / "checkpoint").unlink()
    with pytest.raises(fmt.JournalCorrupt, match="the writer ended it at offset"):
        await Storage.open(config(tmp_path))


@pytest.mark.parametrize("version", [3, fmt.SEGMENT_VERSION])
async def test_a_torn_first_header_of_any_version_is_written_anew_not_left_empty(
    tmp_path: Path, version: int
) -> None:
    """A segment whose header write was torn (its first bytes kept, then zeros) is cut whole; the
    journal writes it anew with its first group, whatever version the torn bytes named: going on in
    the next segment instead would leave this one empty before one holding data, which the next
    start refuses as lost records."""
    storage = await Storage.open(config(tmp_path))
    storage.abort()
    torn = fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, version, 1)[:12]
    segment_file(tmp_path, 1).write_bytes(torn + bytes(4096))
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0, payload=PAYLOAD)
    assert storage.ledger(1).index.get(0).segment_id == 1  # type: ignore[union-attr]
    storage.abort()
    await read_all(tmp_path, 1)
