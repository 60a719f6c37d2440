"""The storage's threads, executors and clock come from the seams passed in (bookie.threads,
common.clock): a twin sees every thread and executor the storage makes, and the journal's timed
group commit reads the clock it was given."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from bookie.fileio import FileIO
from bookie.journal import JournalConfig
from bookie.storage import Storage, StorageConfig
from bookie.threads import OsThreads, Thread
from bookkeeper_aio.common.clock import ManualClock

from .test_storage import add


class RecordingThreads(OsThreads):
    """Real threads, with the names of those asked for."""

    __slots__ = ("names",)

    def __init__(self) -> None:
        self.names: list[str] = []

    def start_thread(self, target: Callable[[], None], name: str) -> Thread:
        self.names.append(name)
        return super().start_thread(target, name)

    def executor(self, name: str) -> Executor:
        self.names.append(name)
        return super().executor(name)


async def test_storage_makes_its_threads_and_reads_time_through_the_seams(tmp_path: Path) -> None:
    threads = RecordingThreads()
    clock = ManualClock(1000.0)
    journal = JournalConfig(group_wait_ms=1.0)  # the timed policy: it reads the clock
    config = StorageConfig(str(tmp_path), "b", journal=journal, checkpoint_interval_s=3600)
    storage = await Storage.open(config, threads=threads, clock=clock)
    await add(storage, 1, 0)
    await add(storage, 1, 1)
    assert sorted(threads.names) == ["journal-writer", "storage-cold", "storage-reader", "storage-recovery"]
    # Each group's fdatasync was timed by the manual clock (which never moves): 0 s each.
    assert sum(storage.journal.sync_seconds.counts) == 2
    assert storage.journal.sync_seconds.sum == 0.0
    await storage.close()


def test_pread_nowait_gives_cached_bytes_or_none(tmp_path: Path) -> None:
    """The one read the event loop makes itself: the bytes when the page cache holds them all (a
    file just written and read), None past the end, never a short read. Where the platform or
    filesystem cannot tell, it is None (and reads go to the reader thread)."""
    path = tmp_path / "segment"
    path.write_bytes(bytes(range(256)) * 64)
    fileio = FileIO()
    fd = fileio.open_read(str(path))
    try:
        assert fileio.pread(fd, 100, 1000) == (bytes(range(256)) * 64)[1000:1100]
        got = fileio.pread_nowait(fd, 100, 1000)
        if got is not None:
            assert bytes(got) == (bytes(range(256)) * 64)[1000:1100]
        assert fileio.pread_nowait(fd, 100, len(bytes(range(256)) * 64) - 50) is None
    finally:
        fileio.close(fd)
