"""Shared by the log writer and reader: the `LogManager` of a client."""

from __future__ import annotations

from bookkeeper_aio.client.bookkeeper import BookKeeper
from metadata.log_manager import LogManager


def log_manager(bk: BookKeeper) -> LogManager:
    """A `LogManager` on the client's metadata store and cluster root."""
    ledgers = bk.context.ledgers
    return LogManager(ledgers.store, ledgers.keys.root)  # the store the client already uses
