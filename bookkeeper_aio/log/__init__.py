"""Ledger-chain logs (docs/replication.md §7): a log is an ordered list of ledgers in metadata.

Home of the log writer (open as leader: fence the last two ledgers, CAS the ledger list; roll to a
new ledger; truncate), the log reader and durable cursors. Floor 4 (docs/internals.md): it uses
the client (:mod:`bookkeeper_aio.client`) and :mod:`metadata`, never :mod:`bookie`.
"""
