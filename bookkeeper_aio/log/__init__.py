"""Ledger-chain logs (docs/replication.md §7, docs/api.md "Logs"): a log is an ordered list of
ledgers in metadata.

The log writer (open as leader: fence the last two ledgers, CAS the ledger list; roll; retention),
the log reader (to the current end, or following), truncation, named cursors, and imports of
already-written ledgers. Floor 4 (docs/internals.md): it uses the client
(:mod:`bookkeeper_aio.client`) and :mod:`metadata`, never :mod:`bookie`.
"""

from bookkeeper_aio.log._common import LEDGER_LOG_KEY
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

__all__ = [
    "LEDGER_LOG_KEY",
    "LogInfo",
    "LogLedgerInfo",
    "LogPosition",
    "LogRecord",
    "LogWriter",
    "append_ledgers",
    "commit_cursor",
    "committed_batch",
    "delete_cursor",
    "delete_log",
    "describe_log",
    "list_logs",
    "open_log_reader",
    "open_log_writer",
    "read_cursors",
    "truncate_log",
]
