"""Metadata: ledger metadata, bookie registration and id generation on a versioned CAS store.

Entry points: `connect(url)` -> `MetadataConnection` (store + cluster root); `LedgerManager` for
ledger metadata; `BookieRegistration` / `list_bookies` / `watch_bookies` for bookies; `Election`.
The package imports nothing from ``bookkeeper_aio`` or ``bookie``. See docs/metadata.md.
"""

from metadata.bookies import (
    BookieInfo,
    BookieRegistration,
    BookieSet,
    BookieState,
    Cookie,
    delete_cookie,
    list_bookies,
    read_cookie,
    watch_bookies,
    write_cookie,
)
from metadata.cluster import (
    ClusterInfo,
    MetadataConnection,
    MetadataUrl,
    connect,
    describe_ledger,
    ensure_cluster,
    init_cluster,
    list_ledgers,
    parse_url,
    read_cluster_info,
    show_bookies,
    show_ledger,
)
from metadata.election import Election
from metadata.errors import (
    BadVersion,
    CasResultUnknown,
    GuardFailed,
    InvalidMetadata,
    InvalidUrl,
    LeaseExpired,
    MetadataError,
    MetadataFormatError,
    MetadataUnavailable,
    NodeExists,
    NoNode,
    NoSuchLedger,
    UpdateRetriesExhausted,
    WatchCompacted,
)
from metadata.etcd import EtcdConfig, EtcdStore
from metadata.idgen import IdGenerator
from metadata.keys import ClusterKeys
from metadata.ledger_manager import UNCHANGED, LedgerIdPage, LedgerManager, VersionedLedger
from metadata.ledger_metadata import LedgerMetadata, LedgerState
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogLedger, LogLedgerState, LogMetadata
from metadata.memory import MemoryStore
from metadata.store import EventKind, Guard, KeyValue, MetadataStore, Page, WatchEvent

__all__ = [
    "UNCHANGED",
    "BadVersion",
    "BookieInfo",
    "BookieRegistration",
    "BookieSet",
    "BookieState",
    "CasResultUnknown",
    "ClusterInfo",
    "ClusterKeys",
    "Cookie",
    "Election",
    "EtcdConfig",
    "EtcdStore",
    "EventKind",
    "Guard",
    "GuardFailed",
    "IdGenerator",
    "InvalidMetadata",
    "InvalidUrl",
    "KeyValue",
    "LeaseExpired",
    "LedgerIdPage",
    "LedgerManager",
    "LedgerMetadata",
    "LedgerState",
    "LogLedger",
    "LogLedgerState",
    "LogManager",
    "LogMetadata",
    "MemoryStore",
    "MetadataConnection",
    "MetadataError",
    "MetadataFormatError",
    "MetadataStore",
    "MetadataUnavailable",
    "MetadataUrl",
    "NoNode",
    "NoSuchLedger",
    "NodeExists",
    "Page",
    "UpdateRetriesExhausted",
    "VersionedLedger",
    "VersionedLog",
    "WatchCompacted",
    "WatchEvent",
    "connect",
    "delete_cookie",
    "describe_ledger",
    "ensure_cluster",
    "init_cluster",
    "list_bookies",
    "list_ledgers",
    "parse_url",
    "read_cluster_info",
    "read_cookie",
    "show_bookies",
    "show_ledger",
    "watch_bookies",
    "write_cookie",
]
