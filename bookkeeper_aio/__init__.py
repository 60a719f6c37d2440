"""bookkeeper-aio: asyncio-native BookKeeper client.

Public API (see docs/api.md)::

    async with BookKeeper.connect("etcd://127.0.0.1:2379/bookkeeper/default") as bk:
        lh = await bk.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2, password=b"pw")
        entry_id = await lh.append(b"payload")
        future = await lh.append_async(b"payload")     # pipelining; waits only for a window slot
        await lh.close()
        rh = await bk.open_ledger(lh.id, password=b"pw")
        async for entry in rh.read(0, rh.last_add_confirmed): ...
        await bk.delete_ledger(lh.id, password=b"pw")

This module only re-exports, lazily (PEP 562): ``import bookkeeper_aio.protocol.codes`` (what the
bookie does) loads the wire codec and nothing else; the client, etcd and gRPC load on the first use
of a name below. The layers are in docs/internals.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        [
            "BKError",
            "BKIllegalOperation",
            "BKInterfaceError",
            "BKInternalError",
            "BKTimeout",
            "BadRequest",
            "BookieConnectionLost",
            "BookieIOError",
            "BookieReadOnly",
            "CommitTokenReused",
            "DigestError",
            "LedgerClosed",
            "LedgerFenced",
            "LedgerRecoveryError",
            "LogFenced",
            "LogFull",
            "LogTruncated",
            "MetadataConflict",
            "NoSuchEntry",
            "NoSuchLedger",
            "NoSuchLog",
            "NotEnoughBookies",
            "ProtocolVersionMismatch",
            "TooManyRequests",
            "Unauthorized",
            "UnknownLedgerState",
        ],
        "bookkeeper_aio.errors",
    ),
    "BookKeeper": "bookkeeper_aio.client.bookkeeper",
    "password_hash": "bookkeeper_aio.client.bookkeeper",
    "ClientConfig": "bookkeeper_aio.client.config",
    "HandleState": "bookkeeper_aio.client.ledger",
    "LedgerHandle": "bookkeeper_aio.client.ledger",
    "ClientMetrics": "bookkeeper_aio.client.metrics",
    "PrometheusClientMetrics": "bookkeeper_aio.client.metrics",
    "PlacementPolicy": "bookkeeper_aio.client.placement",
    "RackAwarePlacement": "bookkeeper_aio.client.placement",
    "RandomPlacement": "bookkeeper_aio.client.placement",
    "DigestType": "bookkeeper_aio.protocol.digest",
    "LedgerEntry": "bookkeeper_aio.client.read_handle",
    "ReadHandle": "bookkeeper_aio.client.read_handle",
    "NoClusterFound": "bookkeeper_aio.client.discovery",
    "LedgerState": "metadata.ledger_metadata",
    "LogPosition": "bookkeeper_aio.log.position",
    "LogRecord": "bookkeeper_aio.log.position",
    "LogWriter": "bookkeeper_aio.log.writer",
    "open_log_reader": "bookkeeper_aio.log.reader",
    "open_log_writer": "bookkeeper_aio.log.writer",
    "truncate_log": "bookkeeper_aio.log.truncation",
    **dict.fromkeys(
        [
            "LogInfo",
            "LogLedgerInfo",
            "append_ledgers",
            "commit_cursor",
            "committed_batch",
            "delete_cursor",
            "delete_log",
            "describe_log",
            "list_logs",
            "read_cursors",
        ],
        "bookkeeper_aio.log.admin",
    ),
    "LedgerMetadata": "metadata.ledger_metadata",
    "ReplacedBookie": "metadata.ledger_metadata",
    # what metadata operations raise (a BKError each): unreachable etcd, an unknown CAS outcome, garbage
    **dict.fromkeys(
        [
            "CasResultUnknown",
            "LedgerCreateUnknown",
            "MetadataError",
            "MetadataFormatError",
            "MetadataUnavailable",
        ],
        "metadata.errors",
    ),
}

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
    "CasResultUnknown",
    "ClientConfig",
    "ClientMetrics",
    "CommitTokenReused",
    "DigestError",
    "DigestType",
    "HandleState",
    "LedgerClosed",
    "LedgerCreateUnknown",
    "LedgerEntry",
    "LedgerFenced",
    "LedgerHandle",
    "LedgerMetadata",
    "LedgerRecoveryError",
    "LedgerState",
    "LogFenced",
    "LogFull",
    "LogInfo",
    "LogLedgerInfo",
    "LogPosition",
    "LogRecord",
    "LogTruncated",
    "LogWriter",
    "MetadataConflict",
    "MetadataError",
    "MetadataFormatError",
    "MetadataUnavailable",
    "NoClusterFound",
    "NoSuchEntry",
    "NoSuchLedger",
    "NoSuchLog",
    "NotEnoughBookies",
    "PlacementPolicy",
    "PrometheusClientMetrics",
    "ProtocolVersionMismatch",
    "RackAwarePlacement",
    "RandomPlacement",
    "ReadHandle",
    "ReplacedBookie",
    "TooManyRequests",
    "Unauthorized",
    "UnknownLedgerState",
    "append_ledgers",
    "commit_cursor",
    "committed_batch",
    "delete_cursor",
    "delete_log",
    "describe_log",
    "list_logs",
    "open_log_reader",
    "open_log_writer",
    "password_hash",
    "read_cursors",
    "truncate_log",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # the next lookup is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:
    from bookkeeper_aio.client.bookkeeper import BookKeeper, password_hash
    from bookkeeper_aio.client.config import ClientConfig
    from bookkeeper_aio.client.discovery import NoClusterFound
    from bookkeeper_aio.client.ledger import HandleState, LedgerHandle
    from bookkeeper_aio.client.metrics import ClientMetrics, PrometheusClientMetrics
    from bookkeeper_aio.client.placement import PlacementPolicy, RackAwarePlacement, RandomPlacement
    from bookkeeper_aio.client.read_handle import LedgerEntry, ReadHandle
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
        CommitTokenReused,
        DigestError,
        LedgerClosed,
        LedgerFenced,
        LedgerRecoveryError,
        LogFenced,
        LogFull,
        LogTruncated,
        MetadataConflict,
        NoSuchEntry,
        NoSuchLedger,
        NoSuchLog,
        NotEnoughBookies,
        ProtocolVersionMismatch,
        TooManyRequests,
        Unauthorized,
        UnknownLedgerState,
    )
    from bookkeeper_aio.log.admin import (
        LogInfo,
        LogLedgerInfo,
        append_ledgers,
        commit_cursor,
        committed_batch,
        delete_cursor,
        delete_log,
        describe_log,
        list_logs,
        read_cursors,
    )
    from bookkeeper_aio.log.position import LogPosition, LogRecord
    from bookkeeper_aio.log.reader import open_log_reader
    from bookkeeper_aio.log.truncation import truncate_log
    from bookkeeper_aio.log.writer import LogWriter, open_log_writer
    from bookkeeper_aio.protocol.digest import DigestType
    from metadata.errors import (
        CasResultUnknown,
        LedgerCreateUnknown,
        MetadataError,
        MetadataFormatError,
        MetadataUnavailable,
    )
    from metadata.ledger_metadata import LedgerMetadata, LedgerState, ReplacedBookie
