"""The data directory guard: a cookie names the bookie a data directory belongs to.

``<data-dir>/COOKIE`` (JSON: bookie_id, instance_id, layout_version) is written atomically the first
time a bookie starts on an empty directory. A later start with another bookie id, or on a directory
that holds a journal but no cookie (copied or half-wiped), refuses: serving another bookie's data
under our name would make the cluster believe entries are where they are not.

The COOKIE also says the bookie's journal was created here (``journal_created``): from the first
start on, ``journal/`` holds at least one segment and ``index/`` exists (an empty first segment is
made with them, before the field is written). A later start that finds either gone refuses
(:class:`DataDirWiped`): the data was wiped or lost, and a bookie that came back empty under its old
identity would answer "no such entry" for entries it acknowledged (docs/protocol.md, the absence
rule). A COOKIE written before the field existed gets it at its next start.

Once the bookie registered with a cluster, the COOKIE also names that cluster
(``cluster_instance_id``, :func:`bind_cluster`): a later start against another cluster (a wrong
metadata root, a re-initialised or restored etcd) is refused by the registration, before the
bookie's GC could take its ledgers for deleted ones.
"""

from __future__ import annotations

import json
import os
import uuid

from bookie.fileio import FileIO
from bookie.journal_format import parse_segment_name, segment_name
from bookie.replay import INDEX_DIR, JOURNAL_DIR

COOKIE_FILE = "COOKIE"
LOCK_FILE = "LOCK"
LAYOUT_VERSION = 1
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
JOURNAL_CREATED = "journal_created"
"""The COOKIE's field saying ``journal/`` (with a segment) and ``index/`` were created (the module doc)."""


class CookieMismatch(Exception):
    """The data directory belongs to another bookie or is in an unknown state."""


class DataDirWiped(CookieMismatch):
    """The COOKIE says the bookie's journal was created here, but the journal or the index is gone."""


def ensure_cookie(fileio: FileIO, data_dir: str, bookie_id: str) -> str:
    """Check or create the cookie, and the journal and index directories it vouches for; returns
    the instance id. Raises :class:`CookieMismatch` (:class:`DataDirWiped` among them)."""
    path = os.path.join(data_dir, COOKIE_FILE)
    if not fileio.exists(path):
        if holds_data(fileio, data_dir):  # asked only here: it opens every journal segment
            raise CookieMismatch(
                f"data dir {data_dir} holds a journal but no {COOKIE_FILE}: refusing to adopt it "
                "(restore the cookie, or wipe the directory if its data is truly unwanted)"
            )
        instance_id = uuid.uuid4().hex
        cookie = {"bookie_id": bookie_id, "instance_id": instance_id, "layout_version": LAYOUT_VERSION}
        fileio.write_file_atomic(path, json.dumps(cookie, sort_keys=True).encode())
    else:
        try:
            cookie = json.loads(fileio.read_file(path))
            found, instance_id, layout = cookie["bookie_id"], cookie["instance_id"], cookie["layout_version"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CookieMismatch(f"{path} is unreadable: {exc}") from exc
        if found != bookie_id:
            raise CookieMismatch(
                f"data dir {data_dir} belongs to bookie {found!r}, not {bookie_id!r}: refusing to start"
            )
        if layout != LAYOUT_VERSION:
            raise CookieMismatch(
                f"data dir {data_dir} has layout version {layout}, this bookie reads {LAYOUT_VERSION}"
            )
    if cookie.get(JOURNAL_CREATED) is True:
        _check_journal_kept(fileio, data_dir, bookie_id)
    else:  # a first start (or a cookie from before the field): the directories first, then the field
        _create_journal(fileio, data_dir)
        cookie[JOURNAL_CREATED] = True
        fileio.write_file_atomic(path, json.dumps(cookie, sort_keys=True).encode())
    return str(instance_id)


def _segments(fileio: FileIO, journal_dir: str) -> list[str]:
    return [name for name in fileio.listdir(journal_dir) if parse_segment_name(name) is not None]


def _create_journal(fileio: FileIO, data_dir: str) -> None:
    """Make ``journal/`` with a segment (an empty first one when it has none) and ``index/``, durably."""
    journal_dir = os.path.join(data_dir, JOURNAL_DIR)
    fileio.makedirs(journal_dir)
    fileio.makedirs(os.path.join(data_dir, INDEX_DIR))
    if not _segments(fileio, journal_dir):
        fileio.close(fileio.open_append(os.path.join(journal_dir, segment_name(1))))
        fileio.fsync_dir(journal_dir)
    fileio.fsync_dir(data_dir)


def _check_journal_kept(fileio: FileIO, data_dir: str, bookie_id: str) -> None:
    """Raise :class:`DataDirWiped` unless ``journal/`` still holds a segment and ``index/`` exists
    (bookie GC never deletes the segment the checkpoint points into, nor a later one)."""
    journal_dir = os.path.join(data_dir, JOURNAL_DIR)
    if not fileio.exists(journal_dir):
        gone = f"its {JOURNAL_DIR}/ directory"
    elif not _segments(fileio, journal_dir):
        gone = f"every segment of its {JOURNAL_DIR}/"
    elif not fileio.exists(os.path.join(data_dir, INDEX_DIR)):
        gone = f"its {INDEX_DIR}/ directory"
    else:
        return
    raise DataDirWiped(
        f"data dir {data_dir}: its {COOKIE_FILE} says bookie {bookie_id!r} created its journal here, "
        f"but {gone} is gone: the data it held (and acknowledged) was wiped or lost. Refusing to "
        "start under its old identity: it would answer 'no such entry' for entries it held, and a "
        "ledger recovery could take that as proof they never existed. Restore the directory if you "
        f"can. Otherwise wipe the whole data dir ({COOKIE_FILE} included) and bring the bookie back as "
        f"a new one: retire the old id first (`bkaio decommission {bookie_id}` re-replicates its "
        f"ledgers; `bkaio bookie format {bookie_id}` frees the id once they are re-replicated; "
        "docs/operations.md)"
    )


def read_cluster_binding(fileio: FileIO, data_dir: str) -> str | None:
    """The instance id of the cluster this data dir was registered with (None: never, or a cookie
    written before bookies recorded it)."""
    try:
        cookie = json.loads(fileio.read_file(os.path.join(data_dir, COOKIE_FILE)))
    except (OSError, ValueError) as exc:
        raise CookieMismatch(f"{data_dir}/{COOKIE_FILE} is unreadable: {exc}") from exc
    bound = cookie.get("cluster_instance_id") if isinstance(cookie, dict) else None
    return bound if isinstance(bound, str) else None


def bind_cluster(fileio: FileIO, data_dir: str, cluster_instance_id: str) -> None:
    """Record in the COOKIE (atomically) the cluster this data dir belongs to from now on."""
    path = os.path.join(data_dir, COOKIE_FILE)
    try:
        cookie = json.loads(fileio.read_file(path))
    except (OSError, ValueError) as exc:
        raise CookieMismatch(f"{path} is unreadable: {exc}") from exc
    cookie["cluster_instance_id"] = cluster_instance_id
    fileio.write_file_atomic(path, json.dumps(cookie, sort_keys=True).encode())


def holds_data(fileio: FileIO, data_dir: str) -> bool:
    """Whether the data dir has journal segments holding bytes (entries, fences: anything a reader
    may rely on; not the empty first segment :func:`ensure_cookie` makes)."""
    journal_dir = os.path.join(data_dir, JOURNAL_DIR)
    if not fileio.exists(journal_dir):
        return False
    for name in _segments(fileio, journal_dir):
        fd = fileio.open_read(os.path.join(journal_dir, name))
        try:
            if fileio.size(fd) > 0:
                return True
        finally:
            fileio.close(fd)
    return False


def read_instance_id(fileio: FileIO, data_dir: str) -> str:
    """The instance id of an existing cookie (after :func:`ensure_cookie` accepted the dir)."""
    try:
        return str(json.loads(fileio.read_file(os.path.join(data_dir, COOKIE_FILE)))["instance_id"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CookieMismatch(f"{data_dir}/{COOKIE_FILE} is unreadable: {exc}") from exc


def lock_identity(data_dir: str, boot_id_path: str = BOOT_ID_PATH) -> str:
    """Which lock file, on which running kernel, guards ``data_dir``: ``<boot id>:<device>:<inode>``.

    Two processes that saw the same identity locked the very same file on the same machine since its
    last boot, and ``flock`` lets only one hold it at a time (the kernel releases it when the holder
    dies, kill -9 included). A copy of the directory, another machine or a reboot gives another
    identity. Empty when the kernel has no boot id (not Linux): then nothing can be proven by it.
    """
    try:
        with open(boot_id_path, encoding="ascii") as handle:
            boot_id = handle.read().strip()
        status = os.stat(os.path.join(data_dir, LOCK_FILE))
    except OSError:
        return ""
    return f"{boot_id}:{status.st_dev}:{status.st_ino}" if boot_id else ""
