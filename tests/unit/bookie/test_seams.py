"""The storage's threads, executors and clock come from the seams passed in (bookie.threads,
common.clock): a twin sees every thread and executor the storage makes, and the journal's timed
group commit reads the clock it was given."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

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
