"""Operation codes, status codes, flags and the limits both sides of the wire agree on.

Values mirror BookKeeper's v3 protocol (``BookkeeperProtocol.proto``) where one exists, so that
operators reading a status number see the name they know. docs/protocol.md is the reference.
"""

from __future__ import annotations

import enum

PROTOCOL_VERSION = 1
"""Wire protocol version, exchanged in HELLO. A peer with another major version is refused."""

FRAME_BYTES_MAX = 5 * 1024 * 1024
"""Largest frame (length prefix excluded) either side accepts by default. An entry of up to ~4.9 MiB
fits; anything larger is refused before a byte of it is buffered (a hostile length prefix must not
make us allocate)."""

MASTER_KEY_BYTES_MAX = 64
"""Upper bound on a master key; ours are 32 bytes (SHA-256)."""

ID_MAX = (1 << 63) - 1
"""Ledger and entry ids are signed 64-bit on the wire (as in BookKeeper); ids are never negative
except the entry id -1 (``LAST_ENTRY``) where a request allows it."""

LAST_ENTRY = -1
"""READ_ENTRY of entry -1 means "the last entry this bookie has" (BookKeeper's LAST_ADD_CONFIRMED)."""

NO_ENTRY = -1
"""A LAC or last-entry value meaning "no entry yet"."""

LONG_POLL_TIMEOUT_MS_MAX = 60_000
"""A long-poll read waits at most this long; a client asking for more is refused (EBADREQ)."""

BATCH_READ_COUNT_MAX = 10_000
BATCH_READ_STEP_MAX = 64
"""BATCH_READ ``step``: at most the largest ensemble (a striped reader steps by E)."""
"""A BATCH_READ returns at most this many entries, whatever the request asks."""

REQUEST_ID_MAX = (1 << 64) - 1
"""Request ids are unsigned 64-bit, chosen by the client, unique among its in-flight requests."""

FEATURE_ADD_ACKS = 1
"""HELLO feature bit: successful ADD_ENTRY answers may come batched in one ADD_ACKS response."""

FEATURES_MAX = (1 << 32) - 1
"""HELLO ``features`` is a 32-bit mask; undefined bits are sent as 0 and ignored on receipt."""

AUTH_PAYLOAD_BYTES_MAX = 16 * 1024
"""An AUTH payload (a token, a challenge or its answer) is at most this long, either way."""

ADD_ACKS_IDS_MAX = 65_536
"""An ADD_ACKS response lists at most this many request ids (< 600 KiB: far below a frame)."""


class OpCode(enum.IntEnum):
    HELLO = 0
    ADD_ENTRY = 1
    READ_ENTRY = 2
    AUTH = 3
    """Authentication handshake (BookKeeper's v2 op 3): a provider name and an opaque payload."""
    READ_LAC = 4
    WRITE_LAC = 5
    GET_BOOKIE_INFO = 6
    FORCE_LEDGER = 8
    GET_LIST_OF_ENTRIES_OF_LEDGER = 9
    BATCH_READ = 10
    ADD_ACKS = 11
    """Response only: EOK answers of several ADD_ENTRY requests (after HELLO agreed on
    FEATURE_ADD_ACKS). A request with this op is unknown (EBADREQ)."""


class StatusCode(enum.IntEnum):
    EOK = 0
    ENOLEDGER = 402
    ENOENTRY = 403
    EBADREQ = 404
    EIO = 501
    EUA = 502
    EBADVERSION = 503
    EFENCED = 504
    EREADONLY = 505
    ETOOMANYREQUESTS = 506
    EUNKNOWNLEDGERSTATE = 507


class AddFlag(enum.IntFlag):
    NONE = 0
    RECOVERY_ADD = 1
    """An add from recovery or rereplication: accepted on a fenced ledger (and on a read-only
    bookie within its reserve)."""


class ReadFlag(enum.IntFlag):
    NONE = 0
    FENCE_LEDGER = 1
    """Fence the ledger durably before answering (recovery reads always carry it: BOOKKEEPER-2614)."""
    ENTRY_PIGGYBACK = 2
    """Long poll: with ``previous_lac`` set, also return entry ``previous_lac + 1`` when it exists."""
    LONG_POLL = 4
    """Wait until the bookie's LAC passes ``previous_lac`` or ``timeout_ms`` elapses."""


STATUS_VALUES = frozenset(int(s) for s in StatusCode)
OP_VALUES = frozenset(int(o) for o in OpCode)
