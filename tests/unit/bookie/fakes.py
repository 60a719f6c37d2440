"""A fault-injecting twin of the disk door (bookie.fileio.FileIO) for unit tests."""

from __future__ import annotations

import errno
import threading

from bookie.fileio import FileIO


class FaultyFileIO(FileIO):
    """Real files, plus: fail or block journal syncs on demand, and record which threads sync."""

    def __init__(self) -> None:
        self.fail_sync = False
        self.fail_write = False
        self.sync_gate: threading.Event | None = None
        self.sync_threads: set[str] = set()
        self.syncs = 0
        self.writes: list[int] = []

    def journal_write(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        if self.fail_write:
            raise OSError(errno.EIO, "injected write EIO")
        self.writes.append(len(data))
        super().journal_write(fd, data, offset)

    def journal_sync(self, fd: int) -> None:
        self.sync_threads.add(threading.current_thread().name)
        if self.sync_gate is not None:
            self.sync_gate.wait(10)
        if self.fail_sync:
            raise OSError(errno.EIO, "injected fdatasync EIO")
        self.syncs += 1
        super().journal_sync(fd)
