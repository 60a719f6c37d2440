"""Named failpoints on every durability step (DESIGN.md §9).

Enabled only through the environment variable ``BKAIO_FAILPOINTS``, a comma-separated list of
``name=action`` pairs, read once at import (tests that start subprocesses set it in their env;
in-process tests call :func:`configure`). Actions:

- ``kill``            the process dies at once (``os._exit``), like a power cut for its own state;
- ``sleep:<ms>``      block the calling thread that long (a stall inside the step);
- ``eio`` / ``enospc`` raise ``OSError`` with that errno, as the disk would;
- ``partial:<n>``     the step writes only its first ``n`` bytes, then the process dies (torn write);
- ``count:<k>:<action>`` the action fires on the k-th hit only (1-based), the earlier hits pass.

With nothing enabled :func:`hit` is one dictionary lookup on an empty dict.
"""

from __future__ import annotations

import errno
import os
import time

ENV_VAR = "BKAIO_FAILPOINTS"

# The names, in one place so tests and docs can list them.
JOURNAL_WRITE = "journal.write"
JOURNAL_BEFORE_SYNC = "journal.before_fdatasync"
JOURNAL_AFTER_SYNC = "journal.after_fdatasync"
BEFORE_ACK = "bookie.before_ack"
FENCE_PERSIST = "bookie.fence_persist"
INDEX_CHECKPOINT = "index.checkpoint"
RENAME = "fileio.rename"
DIR_FSYNC = "fileio.dir_fsync"
METADATA_CAS_BEFORE = "metadata.cas_before"
METADATA_CAS_AFTER = "metadata.cas_after"

_active: dict[str, str] = {}
_hits: dict[str, int] = {}


class FailpointError(ValueError):
    """A failpoint specification that cannot be parsed."""


def _parse(spec: str) -> dict[str, str]:
    table: dict[str, str] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, action = item.partition("=")
        if not sep or not name or not action:
            raise FailpointError(f"failpoint {item!r}: expected name=action")
        table[name.strip()] = action.strip()
    return table


def configure(spec: str | None) -> None:
    """Replace the active failpoints (``None`` or ``""`` disables all)."""
    _active.clear()
    _hits.clear()
    if spec:
        _active.update(_parse(spec))


def hit(name: str, data_len: int = 0) -> int | None:
    """Pass the failpoint ``name``.

    Returns ``None`` normally; for a ``partial:<n>`` action returns how many bytes of a write of
    ``data_len`` bytes the caller must perform before calling :func:`die`.
    """
    if not _active:
        return None
    action = _active.get(name)
    if action is None:
        return None
    count = _hits.get(name, 0) + 1
    _hits[name] = count
    return _fire(action, count, data_len)


def _fire(action: str, count: int, data_len: int) -> int | None:
    kind, _, arg = action.partition(":")
    if kind == "count":
        wanted, _, inner = arg.partition(":")
        if count != int(wanted):
            return None
        return _fire(inner, 1, data_len)
    if kind == "kill":
        die()
    if kind == "sleep":
        time.sleep(float(arg or "1000") / 1000.0)
        return None
    if kind == "eio":
        raise OSError(errno.EIO, "failpoint: injected EIO")
    if kind == "enospc":
        raise OSError(errno.ENOSPC, "failpoint: injected ENOSPC")
    if kind == "partial":
        return min(int(arg or "0"), data_len)
    raise FailpointError(f"unknown failpoint action {action!r}")


def die() -> None:
    """End the process now, without flushing or cleanup (a crash)."""
    os._exit(137)


configure(os.environ.get(ENV_VAR))
