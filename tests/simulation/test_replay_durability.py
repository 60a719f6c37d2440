"""What the simulator's process kill found in the bookie's start, pinned without a seed (race seed
3419, tests/simulation/test_seeds.py, found it first): the real Storage over the disk twin.

A journal write whose fdatasync failed stays in the page cache; a process kill keeps it; the
restart replays it and checkpoints an index pointing into it; a power cut then drops the bytes the
checkpoint covers, and replay no longer scans them. The record must come back whole or not at
all, never as a record that fails its checksum for good (fixed in bookie/replay.py: replayed
segments are made durable before a checkpoint may point into them)."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import pytest

from bookie.storage import EntryCorrupt, NoEntry, Storage
from tests.simulation.disk import Disk, SimFileIO
from tests.unit.bookie.test_storage import add, body, config

DATA_DIR = Path("/bookie")


class _KeepNothing(random.Random):
    """A power cut's draws that keep none of a file's pending writes (the harshest legal one)."""

    def randint(self, a: int, b: int) -> int:
        return a


async def test_a_replayed_unsynced_record_is_whole_or_absent_after_a_power_cut() -> None:
    disk = Disk()
    fileio = SimFileIO(disk)
    storage = await Storage.open(config(DATA_DIR), fileio=fileio)
    for entry_id in range(4):
        await add(storage, 1, entry_id)
    fileio.fail_next = ("sync", errno.EIO)
    with pytest.raises(Exception, match="Input/output error"):
        await add(storage, 1, 4)  # written, its fdatasync failed: never acknowledged
    storage.abort()  # a process kill: the page cache (and entry 4's bytes) survive

    storage = await Storage.open(config(DATA_DIR), fileio=SimFileIO(disk))
    assert storage.ledger(1).index.get(4) is not None  # replayed from the page cache
    assert await storage.checkpoint()  # covers entry 4
    storage.abort()

    disk.crash(_KeepNothing())
    storage = await Storage.open(config(DATA_DIR), fileio=SimFileIO(disk))
    try:
        try:
            await storage.read_entry(1, 4)
        except NoEntry:
            pass  # never acknowledged, not durable: absent is a right answer
        except EntryCorrupt as error:
            pytest.fail(f"a record replay served was checkpointed unsynced and lost: {error}")
    finally:
        storage.abort()


async def test_a_fresh_journals_header_is_made_durable_when_its_first_sync_failed() -> None:
    """The same with the journal's FIRST group failing its sync: that group wrote the segment's
    header too, but the synced mark (at the header's end, where the journal started) said the
    header was synced, so replay rewrote only the bytes after it; the power cut then dropped the
    header and the next start refused (JournalCorrupt: header zero under the checkpoint)."""
    disk = Disk()
    fileio = SimFileIO(disk)
    storage = await Storage.open(config(DATA_DIR), fileio=fileio)
    fileio.fail_next = ("sync", errno.EIO)
    with pytest.raises(Exception, match="Input/output error"):
        await add(storage, 1, 0)  # the header and entry 0 written, their fdatasync failed
    storage.abort()

    storage = await Storage.open(config(DATA_DIR), fileio=SimFileIO(disk))
    assert storage.ledger(1).index.get(0) is not None
    assert await storage.checkpoint()
    storage.abort()

    disk.crash(_KeepNothing())
    storage = await Storage.open(config(DATA_DIR), fileio=SimFileIO(disk))  # no JournalCorrupt
    try:
        assert (await storage.read_entry(1, 0))[1] == body(1, 0, -1)  # made durable by the replay
    finally:
        storage.abort()
