"""bookkeeper-aio: asyncio-native BookKeeper client.

Public API (see docs/api.md)::

    async with BookKeeper.connect("etcd://127.0.0.1:2379/bookkeeper/default") as bk:
        lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"pw")
        entry_id = await lh.append(b"payload")
        future = await lh.append_async(b"payload")     # pipelining; waits only for a window slot
        await lh.close()
        rh = await bk.open_ledger(lh.id, password=b"pw")
        async for entry in rh.read(0, rh.last_add_confirmed): ...
        await bk.delete_ledger(lh.id)
"""

import structlog as _structlog

from bookkeeper_aio.logs import configure_logging as _configure_logging

if not _structlog.is_configured():
    # structlog's unconfigured default prints every level to stdout; a library must not write to
    # an application's stdout. Warnings and errors go to stderr until the application configures
    # structlog itself (or calls bookkeeper_aio.logs.configure_logging).
    _configure_logging(level="warning")

from bookkeeper_aio.client import BookKeeper, password_hash
from bookkeeper_aio.config import ClientConfig
from bookkeeper_aio.errors import (
    BadRequest,
    BKError,
    BKIllegalOperation,
    BKInterfaceError,
    BKInternalError,
    BKTimeout,
    BookieConnectionLost,
    BookieIOError,
    BookieReadOnly,
    DigestError,
    LedgerClosed,
    LedgerFenced,
    LedgerRecoveryError,
    MetadataConflict,
    NoSuchEntry,
    NoSuchLedger,
    NotEnoughBookies,
    ProtocolVersionMismatch,
    TooManyRequests,
    Unauthorized,
    UnknownLedgerState,
)
from bookkeeper_aio.ledger import HandleState, LedgerHandle
from bookkeeper_aio.metrics import ClientMetrics, PrometheusClientMetrics
from bookkeeper_aio.placement import PlacementPolicy, RackAwarePlacement, RandomPlacement
from bookkeeper_aio.protocol.digest import DigestType
from bookkeeper_aio.read_handle import LedgerEntry, ReadHandle

__all__ = [
    "BKError",
    "BKIllegalOperation",
    "BKInterfaceError",
    "BKInternalError",
    "BKTimeout",
    "BadRequest",
    "BookKeeper",
    "BookieConnectionLost",
    "BookieIOError",
    "BookieReadOnly",
    "ClientConfig",
    "ClientMetrics",
    "DigestError",
    "DigestType",
    "HandleState",
    "LedgerClosed",
    "LedgerEntry",
    "LedgerFenced",
    "LedgerHandle",
    "LedgerRecoveryError",
    "MetadataConflict",
    "NoSuchEntry",
    "NoSuchLedger",
    "NotEnoughBookies",
    "PlacementPolicy",
    "PrometheusClientMetrics",
    "ProtocolVersionMismatch",
    "RackAwarePlacement",
    "RandomPlacement",
    "ReadHandle",
    "TooManyRequests",
    "Unauthorized",
    "UnknownLedgerState",
    "password_hash",
]
