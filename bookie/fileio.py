"""The only door from the bookie to the disk.

Every byte the bookie persists or reads back goes through a :class:`FileIO`: the journal's hot path
(append, fdatasync), cold paths (index checkpoints and the cookie: write a temp file, fsync, rename,
fsync the directory) and reads (pread). Production uses :class:`OsFileIO`; tests pass a twin that
injects faults at this seam (docs/internals.md §2). The named failpoints of the durability steps
(bookkeeper_aio/common/failpoints.py) are hit here, so enabling ``journal.write=partial:100`` tears
a journal write exactly as a crash would.

Everything here blocks: callers run it on the journal's writer thread or a cold-path executor,
never on the event loop (the exceptions: startup, before the server accepts anything, and
:meth:`FileIO.pread_nowait`, which never waits for the disk).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Sequence

import structlog

from bookkeeper_aio.common import failpoints

log = structlog.get_logger(__name__)

_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_O_NOATIME: int = getattr(os, "O_NOATIME", 0)
FILE_MODE = 0o600
"""Every file the bookie creates: the journal, checkpoints and the synced mark hold ledgers' master
keys (with them anyone reads, fences and adds to those ledgers), so only the bookie's user reads them."""
DIR_MODE = 0o700
"""Every directory the bookie creates (the data dir, its journal and index dirs)."""


class FileIO:
    """Blocking file operations on file descriptors; subclass to inject faults."""

    reads_nowait: bool = _RWF_NOWAIT is not None
    """Whether :meth:`pread_nowait` can ever find cached bytes. False (a platform without
    ``RWF_NOWAIT``, a twin that cannot tell): the storage does not ask it before each read."""

    def open_append(self, path: str) -> int:
        """Open (creating if needed) ``path`` for positional writes."""
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)

    def open_read(self, path: str) -> int:
        """Open for reads. Without updating the access time where allowed (``O_NOATIME``): a read
        after each journal write would otherwise have to update it, which ``pread_nowait``
        refuses to wait for."""
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_NOATIME)
        except PermissionError:  # O_NOATIME needs the file's owner (or CAP_FOWNER)
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def close(self, fd: int) -> None:
        os.close(fd)

    def preallocate(self, fd: int, offset: int, length: int) -> None:
        """Reserve ``[offset, offset + length)`` so appends there do not change the file's size
        (and so its metadata) on every sync."""
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as exc:  # filesystems without fallocate (tmpfs on old kernels) still work
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise

    def journal_write(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (failpoint ``journal.write``, may tear the write)."""
        partial = failpoints.hit(failpoints.JOURNAL_WRITE, len(data))
        if partial is not None:
            self._pwrite_all(fd, memoryview(data)[:partial], offset)
            failpoints.die()
        self._pwrite_all(fd, data, offset)

    def pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> None:
        self._pwrite_all(fd, data, offset)

    @staticmethod
    def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view = view[written:]
            offset += written

    def journal_sync(self, fd: int) -> None:
        """fdatasync for the journal (failpoints before and after the sync)."""
        failpoints.hit(failpoints.JOURNAL_BEFORE_SYNC)
        os.fdatasync(fd)
        failpoints.hit(failpoints.JOURNAL_AFTER_SYNC)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def pread(self, fd: int, length: int, offset: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``; raises ``OSError(EIO)`` on a short read."""
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(errno.EIO, f"short read: {len(data)} of {length} bytes at offset {offset}")
        return data

    def pread_nowait(self, fd: int, length: int, offset: int) -> bytearray | None:
        """Exactly ``length`` bytes at ``offset`` if the page cache holds them all (``preadv``
        with ``RWF_NOWAIT``), else None: it never waits for the disk, so the event loop may call it
        (a read of recently written entries skips the reader thread). A twin that cannot tell
        returns None, and so does a platform or filesystem without it."""
        if _RWF_NOWAIT is None:
            return None
        buf = bytearray(length)
        try:
            got = os.preadv(fd, (buf,), offset, _RWF_NOWAIT)
        except OSError:  # EAGAIN: not all of it cached; EOPNOTSUPP; anything else: the thread's read says
            return None
        return buf if got == length else None

    def map_read(self, path: str) -> mmap.mmap | None:
        """A read-only map of the whole file (None when it is empty); the caller closes it."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size == 0:
                return None
            return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def makedirs(self, path: str) -> None:
        """Create ``path`` (mode 0700; missing parents get the umask's default) if missing. A
        directory already there that its group or others may enter is kept as it is, with a warning
        that says how to close it: the files in it hold ledgers' master keys."""
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            log.warning(
                "fileio.dir_not_private",
                path=path,
                mode=oct(mode),
                why="its files hold ledgers' master keys: any local user who reads them can read, "
                "fence and add to those ledgers",
                fix=f"chmod -R go-rwx {path}",
            )

    def remove(self, path: str) -> None:
        os.remove(path)

    def rename(self, src: str, dst: str) -> None:
        failpoints.hit(failpoints.RENAME)
        os.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        """Make a directory's entries (a new or renamed file) durable."""
        failpoints.hit(failpoints.DIR_FSYNC)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_file_atomic(
        self, path: str, data: bytes | Sequence[bytes], failpoint: str | None = None
    ) -> None:
        """Replace ``path`` with ``data`` (bytes, or consecutive parts) so that a crash leaves the
        old or the new file, whole.

        Temp file, write, fsync, rename over ``path``, fsync the directory. ``failpoint`` (e.g.
        ``index.checkpoint``) is hit after the temp file is durable and before the rename.
        """
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # a temp copy a crash left behind keeps its old mode otherwise
            offset = 0
            for part in (data,) if isinstance(data, bytes) else data:
                self._pwrite_all(fd, part, offset)
                offset += len(part)
            os.fsync(fd)
        except BaseException:
            # a half-written copy (ENOSPC, EIO) must not keep its space: on a full disk it would eat
            # the reserve the journal needs, and it is retried whole anyway
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        if failpoint is not None:
            failpoints.hit(failpoint)
        try:
            self.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):  # as above: a failed rename leaves no copy behind
                os.unlink(tmp)
            raise
        self.fsync_dir(os.path.dirname(path) or ".")

    def boot_id(self) -> bytes | None:
        """What identifies the machine's current boot (Linux's ``boot_id``), or None where unknown.

        Bytes written (not synced) before a process crash are still read back after it in the same
        boot: the page cache outlives the process. A power cut or a reboot changes the id. The
        journal's synced mark relies on it (:mod:`bookie.replay`); None makes replay assume the worst.
        """
        try:
            with open(_BOOT_ID_PATH, "rb") as handle:
                boot = handle.read().strip()
        except OSError:
            return None
        return boot or None

    def lock_dir(self, path: str) -> int:
        """Take an exclusive lock on ``path``/LOCK for this process's lifetime; returns the fd.

        Raises ``BlockingIOError`` when another process holds it.
        """
        fd = os.open(os.path.join(path, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        return fd


OS_FILE_IO = FileIO()
"""The real disk; the default everywhere."""
