"""Named failpoints on every durability step: the one engine, and every failpoint name, of the project.

It is on the ground floor (docs/internals.md) so the bookie, the metadata package and the client
share it without importing each other. The names of all failpoints are the constants below.

Enabled only through the environment variable ``BKAIO_FAILPOINTS``, a comma-separated list of
``name=action`` pairs, read once at import (tests that start subprocesses set it in their env;
in-process tests call :func:`configure`). Actions:

- ``kill``                the process dies at once (``os._exit``), like a power cut for its state;
- ``sleep:<ms>``          block the calling thread that long (a stall inside the step);
- ``stop``                the process stops itself (SIGSTOP) until someone sends SIGCONT: a pause of
                          any length at that step (leases expire meanwhile, as for a VM frozen for days);
- ``eio`` / ``enospc``    raise ``OSError`` with that errno, as the disk would;
- ``partial:<n>``         the step writes only its first ``n`` bytes, then the process dies;
- ``unavailable``         raise `MetadataUnavailable` (before a metadata write: nothing applied);
- ``unknown``             raise `CasResultUnknown` (after a metadata write: applied, answer lost);
                          (these two raise what the metadata package registered with
                          :func:`register_error`: this floor does not know its error classes)
- ``count:<k>:<action>``  the action fires on the k-th hit only (1-based); earlier hits pass;
- ``on``                  a switch, read with :func:`switched` (the ``bug.*`` names below).

The ``bug.*`` switches plant a known protocol bug in the production code, for the deterministic
simulation to prove it finds each one (tests/simulation): never set them anywhere else.

    BKAIO_FAILPOINTS="metadata.cas_after=count:3:kill" python -m ...   # die right after the 3rd CAS

With nothing enabled :func:`hit` is one truth test of an empty dict.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable

ENV_VAR = "BKAIO_FAILPOINTS"

# ---------------------------------------------------------------- every failpoint name
JOURNAL_WRITE = "journal.write"
JOURNAL_BEFORE_SYNC = "journal.before_fdatasync"
JOURNAL_AFTER_SYNC = "journal.after_fdatasync"
BEFORE_ACK = "bookie.before_ack"
FENCE_PERSIST = "bookie.fence_persist"
INDEX_CHECKPOINT = "index.checkpoint"
RENAME = "fileio.rename"
DIR_FSYNC = "fileio.dir_fsync"
GC_ROLLED = "gc.rolled"  # the journal's current segment was rolled (durable), nothing copied yet
GC_COPIED = "gc.copied"  # a batch of compaction copies is durable, the index not yet switched
GC_BEFORE_CHECKPOINT = "gc.before_checkpoint"  # compaction done, the checkpoint not yet written
GC_BEFORE_DELETE = "gc.before_delete"  # the checkpoint is durable, the dead segment still there
GC_AFTER_DELETE = "gc.after_delete"  # a segment is unlinked, its directory not yet fsynced
CAS_BEFORE = "metadata.cas_before"  # before a ledger create / CAS is sent
CAS_AFTER = "metadata.cas_after"  # after it was applied, before the caller learns it
METADATA_CAS_BEFORE = CAS_BEFORE
METADATA_CAS_AFTER = CAS_AFTER
# Planted bugs (action ``on``), for the simulation's power tests only:
BUG_ACK_BEFORE_SYNC = "bug.ack_before_fdatasync"  # a bookie acks adds before their fdatasync
BUG_RECOVERY_READ_WITHOUT_FENCE = "bug.recovery_read_without_fence"  # BOOKKEEPER #2614
BUG_RECOVERY_FROM_FENCED_LAC = "bug.recovery_from_fenced_lac"  # BOOKKEEPER #2615
# rereplication trusts a survivor's short batch read: the entries it lacked are not copied
BUG_COPY_TRUSTS_SHORT_BATCH = "bug.copy_trusts_short_batch"

ErrorFactory = Callable[[str, str], BaseException]
"""``(failpoint name, key) -> exception`` for an action a higher floor defines the error of."""

_ACTIONS = frozenset(
    {"kill", "sleep", "stop", "eio", "enospc", "partial", "unavailable", "unknown", "count", "on"}
)
_ERROR_ACTIONS = frozenset({"unavailable", "unknown"})
_active: dict[str, str] = {}
_hits: dict[str, int] = {}
_errors: dict[str, ErrorFactory] = {}


def register_error(action: str, factory: ErrorFactory) -> None:
    """Say what the ``unavailable`` / ``unknown`` actions raise (the metadata package does, at import)."""
    if action not in _ERROR_ACTIONS:
        raise FailpointError(f"{action!r} is not an error action (one of {sorted(_ERROR_ACTIONS)})")
    _errors[action] = factory


class FailpointError(ValueError):
    """A failpoint specification that cannot be parsed (a typo must not silently disable a fault)."""


def _parse(spec: str) -> dict[str, str]:
    table: dict[str, str] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, action = (part.strip() for part in item.partition("="))
        if not sep or not name or not action:
            raise FailpointError(f"failpoint {item!r}: expected name=action")
        kind = action.split(":", 1)[0]
        if kind not in _ACTIONS:
            raise FailpointError(f"failpoint {item!r}: unknown action {kind!r}")
        table[name] = action
    return table


def configure(spec: str | None) -> None:
    """Replace the active failpoints (``None`` or ``""`` disables all)."""
    table = _parse(spec) if spec else {}
    _active.clear()
    _hits.clear()
    _active.update(table)


def hit(name: str, data_len: int = 0, *, key: str = "") -> int | None:
    """Pass the failpoint ``name`` (``key``: what is being written, for error messages).

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
    return _fire(name, action, count, data_len, key)


def switched(name: str) -> bool:
    """Whether the switch ``name`` is ``on`` (one truth test of an empty dict when nothing is set)."""
    return bool(_active) and _active.get(name) == "on"


def _fire(name: str, action: str, count: int, data_len: int, key: str) -> int | None:
    kind, _, arg = action.partition(":")
    if kind == "count":
        wanted, _, inner = arg.partition(":")
        return _fire(name, inner, 1, data_len, key) if count == int(wanted) else None
    if kind == "kill":
        die()
    if kind == "sleep":
        time.sleep(float(arg or "1000") / 1000.0)
        return None
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        return None
    if kind in ("eio", "enospc"):
        code = errno.EIO if kind == "eio" else errno.ENOSPC
        raise OSError(code, f"failpoint {name}: injected {kind.upper()}")
    if kind == "on":
        return None  # a switch, not a step: read with switched()
    if kind == "partial":
        return min(int(arg or "0"), data_len)
    if kind in _ERROR_ACTIONS:
        factory = _errors.get(kind)
        if factory is None:
            raise FailpointError(f"failpoint {name}: action {kind!r} has no registered error in this process")
        raise factory(name, key)
    raise FailpointError(f"unknown failpoint action {action!r}")


def die() -> None:
    """End the process now, without flushing or cleanup (a crash)."""
    os._exit(137)


configure(os.environ.get(ENV_VAR))
