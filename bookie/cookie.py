"""The data directory guard: a cookie names the bookie a data directory belongs to.

``<data-dir>/COOKIE`` (JSON: bookie_id, instance_id, layout_version) is written atomically the first
time a bookie starts on an empty directory. A later start with another bookie id, or on a directory
that holds a journal but no cookie (copied or half-wiped), refuses: serving another bookie's data
under our name would make the cluster believe entries are where they are not.

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
from bookie.journal_format import parse_segment_name
from bookie.replay import JOURNAL_DIR

COOKIE_FILE = "COOKIE"
LOCK_FILE = "LOCK"
LAYOUT_VERSION = 1
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class CookieMismatch(Exception):
    """The data directory belongs to another bookie or is in an unknown state."""


def ensure_cookie(fileio: FileIO, data_dir: str, bookie_id: str, has_data: bool) -> str:
    """Check or create the cookie; returns the instance id. Raises :class:`CookieMismatch`."""
    path = os.path.join(data_dir, COOKIE_FILE)
    if not fileio.exists(path):
        if has_data:
            raise CookieMismatch(
                f"data dir {data_dir} holds a journal but no {COOKIE_FILE}: refusing to adopt it "
                "(restore the cookie, or wipe the directory if its data is truly unwanted)"
            )
        instance_id = uuid.uuid4().hex
        body = {"bookie_id": bookie_id, "instance_id": instance_id, "layout_version": LAYOUT_VERSION}
        fileio.write_file_atomic(path, json.dumps(body, sort_keys=True).encode())
        return instance_id
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
    return str(instance_id)


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
    """Whether the data dir has journal segments (entries, fences: anything a reader may rely on)."""
    journal_dir = os.path.join(data_dir, JOURNAL_DIR)
    return fileio.exists(journal_dir) and any(
        parse_segment_name(name) is not None for name in fileio.listdir(journal_dir)
    )


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
