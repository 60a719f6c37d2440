"""Ledger-chain logs (docs/replication.md §7): a log is an ordered list of ledgers in metadata.

The log writer (open as leader: fence the last two ledgers, CAS the ledger list; roll to a new
ledger) and the log reader. Floor 4 (docs/internals.md): it uses the client
(:mod:`bookkeeper_aio.client`) and :mod:`metadata`, never :mod:`bookie`. Not done yet: truncation,
durable cursors, idempotent appends, CLI.
"""

from bookkeeper_aio.log.position import LogPosition, LogRecord
from bookkeeper_aio.log.reader import open_log_reader
from bookkeeper_aio.log.writer import LogWriter, open_log_writer

__all__ = ["LogPosition", "LogRecord", "LogWriter", "open_log_reader", "open_log_writer"]
