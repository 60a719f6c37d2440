"""Running ``bkaio`` autorecovery commands in process, on the memory store (tests of recover and
decommission)."""

from __future__ import annotations

import argparse

import pytest

import metadata
from bookkeeper_aio.autorecovery.errors import NoPasswordForLedger
from bookkeeper_aio.autorecovery.worker import HealResult, ReplicationWorker
from bookkeeper_aio.cli import autorecovery_commands
from metadata.memory import MemoryStore
from metadata.underreplication import ReplicationLock, UnderReplicated


class KeptConnection(metadata.MetadataConnection):
    """The test's connection: the command's ``close`` leaves the store to the test."""

    async def close(self) -> None:
        pass


async def command_connection(
    monkeypatch: pytest.MonkeyPatch, root: str, bookie_id: str
) -> tuple[MemoryStore, metadata.MetadataConnection]:
    """A memory store with a cluster at ``root`` and ``bookie_id``'s cookie; the commands connect to it."""
    store = MemoryStore()
    await metadata.init_cluster(store, root)
    await metadata.write_cookie(store, root, metadata.Cookie(bookie_id, "disk-1", ("d",), ("d",)), None)
    connection = KeptConnection(store, root)

    async def connect(args: argparse.Namespace, *, daemon: bool = False) -> metadata.MetadataConnection:
        return connection

    monkeypatch.setattr(autorecovery_commands, "_connect", connect)
    return store, connection


def command_args(command: str, root: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    autorecovery_commands.add_commands(parser.add_subparsers())
    return parser.parse_args([command, *argv, "--metadata", f"memory://{root}"])


async def heal_without_password(
    self: ReplicationWorker, mark: UnderReplicated, lock: ReplicationLock | None = None
) -> HealResult:
    """A worker's ``heal`` that never has the ledger's password (patched onto ReplicationWorker)."""
    raise NoPasswordForLedger(f"ledger {mark.ledger_id}: no password of the daemon's matches")
