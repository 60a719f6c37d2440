"""Recovery fixtures: fake bookies, in-memory metadata, and a builder for scripted ledger states.

:class:`World` writes ledger metadata and entry bodies straight into the store and the fake
bookies, so a trace starts from exactly the state it describes (which bookie holds which entry,
which fragments exist) instead of whatever a writer happened to leave behind.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator, Sequence

import pytest

from bookkeeper_aio import BookKeeper, ClientConfig, RandomPlacement, password_hash
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol.digest import DigestType, EntryCodec, master_key
from metadata.ledger_manager import LedgerManager, VersionedLedger
from metadata.ledger_metadata import LedgerMetadata, LedgerState
from metadata.memory import MemoryStore
from tests.harness.fake_bookie import FakeCluster
from tests.harness.fake_bookie import LedgerState as BookieLedger
from tests.unit.client.conftest import FAST as CLIENT_FAST

ROOT = "/bookkeeper/recovery-test"
PASSWORD = b"pw"

# The client tests' fast timeouts, with a shorter explicit-LAC interval for recovery traces.
FAST = dataclasses.replace(CLIENT_FAST, explicit_lac_interval_ms=20)


def payload(entry_id: int) -> bytes:
    return b"entry-%d" % entry_id


class World:
    def __init__(self, cluster: FakeCluster, ledgers: LedgerManager, directory: StaticDirectory) -> None:
        self.cluster = cluster
        self.ledgers = ledgers
        self.directory = directory
        self.codec = EntryCodec(DigestType.CRC32C, PASSWORD)
        self.key = master_key(PASSWORD)
        self.clients: list[BookKeeper] = []

    def client(self, config: ClientConfig = FAST, seed: int = 7) -> BookKeeper:
        bk = BookKeeper(
            self.ledgers, self.directory, config=config, placement=RandomPlacement(random.Random(seed))
        )
        self.clients.append(bk)
        return bk

    def body(self, ledger_id: int, entry_id: int, lac: int | None = None) -> bytes:
        """Entry ``entry_id`` as a writer appending ``payload(i)`` would have made it (header LAC
        defaults to ``entry_id - 1``: the previous entry was acked before this one was sent)."""
        length = sum(len(payload(i)) for i in range(entry_id + 1))
        return self.codec.encode(
            ledger_id, entry_id, entry_id - 1 if lac is None else lac, length, payload(entry_id)
        )

    async def ledger(
        self,
        fragments: Sequence[tuple[int, Sequence[int]]],
        write_quorum: int,
        ack_quorum: int,
        holdings: dict[int, Sequence[int]],
        *,
        ledger_id: int = 77,
        lacs: dict[int, int] | None = None,
        in_flight_from: int | None = None,
    ) -> VersionedLedger:
        """An OPEN ledger whose fragments name fake bookies by index, and ``holdings``: bookie
        index -> entry ids it stores (bookie LAC = max header LAC unless ``lacs`` says otherwise).
        Entries from ``in_flight_from`` on were pipelined: their header LAC is ``in_flight_from - 1``."""
        ids = self.cluster.ids
        md = LedgerMetadata(
            ledger_id=ledger_id,
            ensemble_size=len(fragments[0][1]),
            write_quorum=write_quorum,
            ack_quorum=ack_quorum,
            state=LedgerState.OPEN,
            ensembles=tuple((first, tuple(ids[i] for i in bookies)) for first, bookies in fragments),
            password_hash=password_hash(PASSWORD),
        )
        versioned = await self.ledgers.create_metadata(md)
        for index, entry_ids in holdings.items():
            state = self.cluster.bookies[index].ledgers.setdefault(ledger_id, BookieLedger())
            state.master_key = self.key
            for entry_id in entry_ids:
                lac = entry_id - 1
                if in_flight_from is not None and entry_id >= in_flight_from:
                    lac = in_flight_from - 1
                state.entries[entry_id] = self.body(ledger_id, entry_id, lac)
                state.lac = max(state.lac, lac)
            if lacs and index in lacs:
                state.lac = lacs[index]
        return versioned

    async def close(self) -> None:
        for bk in self.clients:
            await bk.close()


@pytest.fixture
async def cluster() -> AsyncIterator[FakeCluster]:
    async with FakeCluster(6) as fakes:
        yield fakes


@pytest.fixture
async def world(cluster: FakeCluster) -> AsyncIterator[World]:
    ledgers = LedgerManager(MemoryStore(), ROOT, rng=random.Random(1))
    w = World(cluster, ledgers, StaticDirectory(cluster.ids))
    yield w
    await w.close()
