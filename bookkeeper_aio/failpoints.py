"""The failpoint names of the client and the bookie (DESIGN.md §9).

The engine — ``BKAIO_FAILPOINTS`` parsing, actions (kill, sleep, eio, enospc, partial, count, …),
:func:`hit`, :func:`configure` — is :mod:`metadata.failpoints`, shared by every package; see its
docstring for the syntax. This module re-exports it and names the steps it guards.
"""

from __future__ import annotations

from metadata.failpoints import CAS_AFTER, CAS_BEFORE, ENV_VAR, FailpointError, configure, die, hit

__all__ = ["ENV_VAR", "FailpointError", "configure", "die", "hit"]

JOURNAL_WRITE = "journal.write"
JOURNAL_BEFORE_SYNC = "journal.before_fdatasync"
JOURNAL_AFTER_SYNC = "journal.after_fdatasync"
BEFORE_ACK = "bookie.before_ack"
FENCE_PERSIST = "bookie.fence_persist"
INDEX_CHECKPOINT = "index.checkpoint"
RENAME = "fileio.rename"
DIR_FSYNC = "fileio.dir_fsync"
METADATA_CAS_BEFORE = CAS_BEFORE
METADATA_CAS_AFTER = CAS_AFTER
