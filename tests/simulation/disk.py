"""The simulated disk behind the bookie's file seam (bookie.fileio.FileIO): durable vs pending bytes.

Model (one :class:`Disk` per bookie; paths are plain strings, nothing touches the real filesystem):

- A file's content is what was synced plus the writes since (``pending``, in order). ``fsync`` /
  ``fdatasync`` makes them durable. Size changes (preallocate, truncate) are pending writes too.
- Names (create, rename, remove) are durable once their directory is fsynced; until then a crash
  may undo them (here: always does, the harshest legal outcome).
- :meth:`Disk.crash` is a power cut: every file keeps its synced content plus a random prefix of its
  pending writes, the last one of which may be torn at a random byte. The next incarnation of the
  bookie opens this image, in a new boot (:meth:`SimFileIO.boot_id`).
- A process kill (kill -9, the OOM killer) leaves the disk as it is: the page cache keeps every
  byte written, synced or not, and the boot goes on. Only the journal group in flight is cut, at a
  random step (:meth:`SimFileIO.kill_during`): a write there keeps a random prefix of its bytes,
  and nothing after it happens.
- Preallocated space is sparse: zeros past the written bytes cost no memory.
- :attr:`SimFileIO.fail_next` makes the next journal write or fdatasync fail with EIO or ENOSPC
  (the bookie must fail those adds and go read-only, never acknowledge them). A failed fdatasync
  leaves its file's unsynced writes readable but no longer pending, as Linux marks the pages of a
  failed writeback clean: a later sync does not write them, only writing them again does.

A bookie that acknowledges before fdatasync is caught by exactly this model: the acked bytes were
pending, and a crash drops them.
"""

from __future__ import annotations

import errno
import functools
import os
import random
from collections.abc import Iterable, Sequence

from bookie.fileio import FileIO
from bookie.metrics import DiskStatus
from bookkeeper_aio.common import failpoints

DISK_BYTES = 1 << 40


class ProcessKilled(BaseException):
    """Raised by the file seam at the step a process kill lands on (:meth:`SimFileIO.kill_during`):
    the journal writer does nothing after it. A BaseException, as the writer's OSError handlers
    (which remove the synced mark, for one) must not run in a dead process."""


class SimFile:
    """Synced content, plus the pending operations since the last sync."""

    __slots__ = ("data", "mapped", "pending", "synced")

    def __init__(self) -> None:
        self.data = bytearray()  # what reads see now
        self.synced = bytearray()  # what a crash keeps for sure
        self.pending: list[tuple[int, bytes | None]] = []  # (offset, bytes) or (new size, None)
        self.mapped: _Mapped | None = None
        """``data`` as :meth:`SimFileIO.map_read` last returned it, until a write or resize: each
        start of a bookie maps every journal segment, most of them unchanged since the last."""

    def write(self, offset: int, data: bytes) -> None:
        self.mapped = None
        if self.synced is self.data:  # shared since a crash (see crashed()): copied on first write
            self.synced = bytearray(self.data)
        self.pending.append((offset, data))
        _apply(self.data, offset, data)

    def resize(self, size: int) -> None:
        self.mapped = None
        if self.synced is self.data:
            self.synced = bytearray(self.data)
        self.pending.append((size, None))
        _resize(self.data, size)

    def sync(self) -> None:
        for offset, data in self.pending:
            if data is None:
                _resize(self.synced, offset)
            else:
                _apply(self.synced, offset, data)
        self.pending.clear()

    def crashed(self, rng: random.Random) -> SimFile:
        """What a power cut leaves: synced bytes plus a random, possibly torn, prefix of the rest."""
        after = SimFile()
        after.data = bytearray(self.synced)
        kept = rng.randint(0, len(self.pending))
        for index, (offset, data) in enumerate(self.pending[:kept]):
            if data is None:
                _resize(after.data, offset)
                continue
            if index == kept - 1 and len(data) > 1 and rng.random() < 0.5:
                data = data[: rng.randrange(1, len(data))]  # torn at a random byte
            _apply(after.data, offset, data)
        # All of it is synced: one buffer serves as both until the next write or resize copies it
        # (most files a crash leaves, old journal segments, are only read again).
        after.synced = after.data
        if self.synced is self.data:  # nothing written since the last crash: the same bytes
            after.mapped = self.mapped
        return after


_ZEROS = memoryview(bytes(1 << 20))
"""Zeros to grow a buffer with, without a temporary of the size each time."""


def _grow(buf: bytearray, size: int) -> None:
    """``buf`` zero-extended to ``size`` bytes (``size`` >= its length)."""
    missing = size - len(buf)
    if missing > len(_ZEROS):
        buf.extend(bytes(missing))
    elif missing > 0:
        buf += _ZEROS[:missing]


def _apply(buf: bytearray, offset: int, data: bytes) -> None:
    if offset == len(buf):  # an append, as most writes are
        buf += data
        return
    end = offset + len(data)
    if len(buf) < end:
        _grow(buf, end)
    buf[offset:end] = data


def _resize(buf: bytearray, size: int) -> None:
    if size < len(buf):
        del buf[size:]
    else:
        _grow(buf, size)


class Disk:
    """One bookie's disk: the live files and the names a crash would keep."""

    def __init__(self) -> None:
        self.files: dict[str, SimFile] = {}
        self.durable_names: dict[str, SimFile] = {}
        self.dirs: set[str] = set()
        self.rot: dict[str, set[int]] = {}
        """Bit rot: path -> byte offsets that ``pread`` returns flipped (a latent sector error that
        hands back garbage instead of EIO; replay's whole-file reads are not affected)."""
        self.boots = 0
        """Power cuts so far: each starts a new boot (:meth:`SimFileIO.boot_id`); a process kill does not."""
        self.rot_everywhere: dict[str, set[int]] = {}
        """Bit rot that every read returns flipped: ``pread`` and the whole-file reads of a
        restart (journal replay's ``map_read``, the index checkpoint's ``read_file``)."""

    def crash(self, rng: random.Random) -> None:
        """A power cut: only durable names survive, each with its crashed content."""
        survivors: dict[str, SimFile] = {}
        for path in sorted(self.durable_names):
            survivors[path] = self.durable_names[path].crashed(rng)
        self.files = survivors
        self.durable_names = dict(survivors)
        self.boots += 1

    def fsync_dir(self, path: str) -> None:
        prefix = path.rstrip("/") + "/"
        for name in [n for n in self.durable_names if _parent(n) == path.rstrip("/")]:
            if name not in self.files:
                del self.durable_names[name]
        for name, file in self.files.items():
            if name.startswith(prefix) and _parent(name) == path.rstrip("/"):
                self.durable_names[name] = file


_parent = functools.lru_cache(maxsize=4096)(os.path.dirname)
"""A path's directory: ``os.path.dirname`` for the few hundred paths of a seed, asked for every
file at each directory fsync and listing."""


class _Mapped(bytes):
    """What ``map_read`` returns: the file's bytes, with the ``close()`` of an mmap."""

    def close(self) -> None:
        pass


class SimFileIO(FileIO):
    """The bookie's file seam over a :class:`Disk`. File descriptors are small integers."""

    reads_nowait = False  # every read goes through the reader executor's twin (pread_nowait)

    def __init__(self, disk: Disk) -> None:
        self.disk = disk
        self._fds: dict[int, tuple[str, SimFile]] = {}
        self._next_fd = 3
        self.syncs_lost = False
        """Set by a crash that cuts a write in flight: its fsyncs never reach the disk."""
        self.fail_next: tuple[str, int] | None = None
        """(``"write"`` or ``"sync"``, errno): the next journal write or sync raises that error."""
        self.errors_raised = 0
        self._kill_in = 0
        """Steps left before a process kill lands (:meth:`kill_during`); 0: none armed, -1: landed."""
        self._kill_rng: random.Random | None = None
        self.kill_note = ""
        """What the process kill cut (for the trace), once it landed."""

    def kill_during(self, steps: int, rng: random.Random) -> None:
        """A process kill lands on the ``steps``-th step of what runs next (the journal group in
        flight, run at once by the crash): a write, fdatasync, fsync, preallocation or directory
        fsync. A write there keeps a random prefix of its bytes (a kill between two pages of one
        ``pwrite``); that step and every later one raise :class:`ProcessKilled`."""
        self._kill_in = steps
        self._kill_rng = rng
        self.kill_note = "after the whole group (before its completion)"

    def _killed(self, step: str, fd: int = -1, data: bytes | memoryview = b"", offset: int = 0) -> None:
        """Count one step toward an armed kill; at the kill's step keep a prefix of ``data`` and
        raise :class:`ProcessKilled` (as every step after it does)."""
        if self._kill_in > 0:
            self._kill_in -= 1
            if self._kill_in:
                return
            self._kill_in = -1
            assert self._kill_rng is not None
            kept = self._kill_rng.randint(0, len(data))
            if kept:
                self._file(fd).write(offset, bytes(data[:kept]))
            self.kill_note = f"at its {step}" + (f" ({kept} of {len(data)} bytes written)" if data else "")
        raise ProcessKilled(self.kill_note)

    def _open(self, path: str, create: bool) -> int:
        file = self.disk.files.get(path)
        if file is None:
            if not create:
                raise FileNotFoundError(errno.ENOENT, "no such file (simulated)", path)
            if _parent(path) not in self.disk.dirs:
                raise FileNotFoundError(errno.ENOENT, "no such directory (simulated)", path)
            file = self.disk.files[path] = SimFile()
        fd = self._next_fd
        self._next_fd += 1
        self._fds[fd] = (path, file)
        return fd

    def _file(self, fd: int) -> SimFile:
        entry = self._fds.get(fd)
        if entry is None:
            raise OSError(errno.EBADF, "bad file descriptor (simulated)")
        return entry[1]

    def open_append(self, path: str) -> int:
        return self._open(path, create=True)

    def open_read(self, path: str) -> int:
        return self._open(path, create=False)

    def close(self, fd: int) -> None:
        self._fds.pop(fd, None)

    def preallocate(self, fd: int, offset: int, length: int) -> None:
        if self._kill_in:
            self._killed("preallocation")
        file = self._file(fd)
        if offset + length > len(file.data):
            file.resize(offset + length)

    def _fault(self, step: str) -> None:
        if self.fail_next is not None and self.fail_next[0] == step:
            code = self.fail_next[1]
            self.fail_next = None
            self.errors_raised += 1
            raise OSError(code, f"{os.strerror(code)} (simulated, journal {step})")

    def journal_write(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        self._fault("write")
        if self._kill_in:
            self._killed("journal write", fd, data, offset)
        self._file(fd).write(offset, bytes(data))

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        if self._kill_in:
            self._killed(f"write of {self._fds[fd][0]}", fd, data, offset)
        self._file(fd).write(offset, bytes(data))

    def boot_id(self) -> bytes:
        """A new boot after each power cut (what was written but not synced may be gone); a
        process kill keeps the boot (and the page cache)."""
        return b"sim-boot-%d" % self.disk.boots

    def journal_sync(self, fd: int) -> None:
        try:
            self._fault("sync")
        except OSError:
            # Linux after a failed writeback: the dirty pages are marked clean and the error is
            # reported once. The bytes stay readable (the page cache), but no later sync writes
            # them (only writing them again does), and a power cut drops them.
            self._file(fd).pending.clear()
            raise
        if self._kill_in:
            self._killed("fdatasync")
        self._sync(fd)

    def fsync(self, fd: int) -> None:
        if self._kill_in:
            self._killed("fsync")
        self._sync(fd)

    def _sync(self, fd: int) -> None:
        if self.syncs_lost:
            return
        self._file(fd).sync()

    def pread(self, fd: int, length: int, offset: int) -> bytes:
        data = bytes(self._file(fd).data[offset : offset + length])
        if len(data) != length:
            raise OSError(errno.EIO, f"short read: {len(data)} of {length} bytes at offset {offset}")
        disk = self.disk
        if disk.rot or disk.rot_everywhere:
            path = self._fds[fd][0]
            data = _flip(data, offset, disk.rot.get(path, set()) | disk.rot_everywhere.get(path, set()))
        return data

    def pread_nowait(self, fd: int, length: int, offset: int) -> None:
        """Never says the bytes are cached: every read goes through the reader executor's twin, as
        the simulation schedules it."""
        return None

    def map_read(self, path: str) -> _Mapped | None:  # type: ignore[override]
        file = self.disk.files.get(path)
        if file is None:
            raise FileNotFoundError(errno.ENOENT, "no such file (simulated)", path)
        if not file.data:
            return None
        rotten = self.disk.rot_everywhere.get(path)
        if rotten:
            return _Mapped(_flip(bytes(file.data), 0, rotten))
        if file.mapped is None:
            file.mapped = _Mapped(file.data)
        return file.mapped

    def size(self, fd: int) -> int:
        return len(self._file(fd).data)

    def truncate(self, fd: int, length: int) -> None:
        self._file(fd).resize(length)

    def read_file(self, path: str) -> bytes:
        file = self.disk.files.get(path)
        if file is None:
            raise FileNotFoundError(errno.ENOENT, "no such file (simulated)", path)
        rotten = self.disk.rot_everywhere.get(path)
        return _flip(bytes(file.data), 0, rotten) if rotten else bytes(file.data)

    def listdir(self, path: str) -> list[str]:
        if path.rstrip("/") not in self.disk.dirs:
            raise FileNotFoundError(errno.ENOENT, "no such directory (simulated)", path)
        return sorted(os.path.basename(n) for n in self.disk.files if _parent(n) == path.rstrip("/"))

    def exists(self, path: str) -> bool:
        return path in self.disk.files or path.rstrip("/") in self.disk.dirs

    def makedirs(self, path: str) -> None:
        # Directories are durable at once (made once per data dir, before anything is written).
        path = path.rstrip("/")
        while path and path not in self.disk.dirs:
            self.disk.dirs.add(path)
            path = _parent(path)

    def remove(self, path: str) -> None:
        if self.disk.files.pop(path, None) is None:
            raise FileNotFoundError(errno.ENOENT, "no such file (simulated)", path)

    def rename(self, src: str, dst: str) -> None:
        file = self.disk.files.pop(src, None)
        if file is None:
            raise FileNotFoundError(errno.ENOENT, "no such file (simulated)", src)
        self.disk.files[dst] = file

    def fsync_dir(self, path: str) -> None:
        if self._kill_in:
            self._killed("directory fsync")
        if not self.syncs_lost:
            self.disk.fsync_dir(path)

    def write_file_atomic(
        self, path: str, data: bytes | Sequence[bytes], failpoint: str | None = None
    ) -> None:
        """As ``FileIO.write_file_atomic``: ``data`` is bytes or consecutive parts (the index
        checkpoint's; until the twin took parts, every checkpoint task of the simulation died on
        its first write, unseen: the end-of-seed collection now reports such a task)."""
        tmp = path + ".tmp"
        self.disk.files.pop(tmp, None)
        fd = self._open(tmp, create=True)
        try:
            self.pwrite(fd, data if isinstance(data, bytes) else b"".join(data), 0)
            self.fsync(fd)
        finally:
            self.close(fd)
        if failpoint is not None:
            failpoints.hit(failpoint)
        self.rename(tmp, path)
        self.fsync_dir(os.path.dirname(path) or ".")

    def lock_dir(self, path: str) -> int:
        return self._open_lock(path)

    def _open_lock(self, path: str) -> int:
        fd = self._next_fd
        self._next_fd += 1
        return fd

    def open_files(self) -> Iterable[str]:
        return sorted(path for path, _ in self._fds.values())


def _flip(data: bytes, offset: int, rotten: set[int]) -> bytes:
    """``data`` (read at ``offset``) with the bytes at the ``rotten`` offsets flipped."""
    inside = [at - offset for at in rotten if offset <= at < offset + len(data)]
    if not inside:
        return data
    flipped = bytearray(data)
    for at in inside:
        flipped[at] ^= 0x20
    return bytes(flipped)


def healthy_disk(path: str) -> DiskStatus:
    """The bookie's free-space probe in the simulation: a large, empty, writable disk."""
    return DiskStatus(DISK_BYTES, DISK_BYTES, False)
