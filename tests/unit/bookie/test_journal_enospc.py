"""ENOSPC while the journal creates its next segment ahead of time: the synced group before it is
acknowledged, the journal keeps working (the bookie's read-only mode takes over from the disk check),
and a roll into the segment while the disk is still full fails only then, with nothing acked that
was not synced. Replay then starts cleanly."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from bookie import journal_format as fmt
from bookie import replay
from bookie.fileio import FileIO
from bookie.journal import Journal, JournalConfig, JournalError
from bookie.journal_format import Position

SMALL = JournalConfig(segment_bytes=64 * 1024, record_bytes_max=4096)


class FullDisk(FileIO):
    """Real files; ``preallocate`` of any segment but the first fails with ENOSPC while ``full``."""

    def __init__(self) -> None:
        self.full = True
        self.failed_preallocations = 0

    def preallocate(self, fd: int, offset: int, length: int) -> None:
        if self.full and offset == 0 and self._segment_of(fd) != 1:
            self.failed_preallocations += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        super().preallocate(fd, offset, length)

    @staticmethod
    def _segment_of(fd: int) -> int | None:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        return fmt.parse_segment_name(name)


def _record(i: int, size: int = 1000) -> tuple[bytes, ...]:
    payload = fmt.LEDGER_ENTRY.pack(1, i) + bytes([i % 256]) * size
    return fmt.encode_entry_head(payload), payload


async def _append_and_wait(journal: Journal, first: int, count: int) -> list[BaseException | None]:
    results: list[BaseException | None] = []
    for i in range(first, first + count):
        journal.append(_record(i), results.append)
    done = journal._loop.create_future()
    journal.sync(lambda error: done.set_result(error))
    await done
    return results


async def test_spare_segment_enospc__synced_groups_acked_journal_keeps_going(tmp_path: Path) -> None:
    fileio = FullDisk()
    directory = tmp_path / replay.JOURNAL_DIR
    directory.mkdir()
    journal = Journal(fileio, str(directory), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    assert await _append_and_wait(journal, 0, 10) == [None] * 10
    assert await _append_and_wait(journal, 10, 10) == [None] * 10
    assert journal.failed is None
    assert fileio.failed_preallocations >= 2  # retried with each group
    assert isinstance(journal._writer.spare_error, OSError)
    # Free space comes back: the next group creates the spare, and a roll into it works.
    fileio.full = False
    assert await _append_and_wait(journal, 20, 80) == [None] * 80  # 100 KiB: rolls into segment 2
    assert journal.failed is None
    assert journal._writer.spare_error is None
    await journal.close()


async def test_roll_while_still_full__fails_then_not_before(tmp_path: Path) -> None:
    fileio = FullDisk()
    directory = tmp_path / replay.JOURNAL_DIR
    directory.mkdir()
    journal = Journal(fileio, str(directory), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    acked = await _append_and_wait(journal, 0, 50)
    assert acked == [None] * 50
    results = await _append_and_wait(journal, 50, 50)  # crosses into segment 2: cannot be created
    assert any(isinstance(r, JournalError) for r in results)
    assert journal.failed is not None
    await journal.close()
    # Everything acknowledged replays; the half-made segment 2 counts as never written.
    recovered = replay.recover(fileio, str(tmp_path))
    entries = recovered.ledgers[1].index.entry_ids()
    acked_ids = [i for i, r in enumerate(acked + results) if r is None]
    assert set(acked_ids) <= set(entries)
