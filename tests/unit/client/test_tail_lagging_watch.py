"""A tailing reader whose metadata watch lags (down, retrying) takes a LAC from a long poll that
lies in a fragment it does not know yet: it reads those entries from the fragment that holds them
(re-reading the metadata), instead of failing on acknowledged entries."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper, RandomPlacement
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.client.conftest import FAST, ROOT, make_client


@pytest.mark.parametrize("how", ["killed", "read_only"])
async def test_a_tail_reads_past_a_fragment_its_watch_has_not_delivered(store: MemoryStore, how: str) -> None:
    async with FakeCluster(5, add_acks=True) as cluster:
        directory = StaticDirectory(cluster.ids)
        writer = make_client(LedgerManager(store, ROOT, rng=random.Random(1)), directory)
        reader_ledgers = LedgerManager(store, ROOT, rng=random.Random(2))

        async def lagging_watch(ledger_id: int) -> AsyncIterator[Any]:  # down: no event for now
            await asyncio.sleep(3600)
            yield None

        reader_ledgers.watch = lagging_watch  # type: ignore[method-assign,assignment]
        reader = BookKeeper(
            reader_ledgers, directory, config=FAST, placement=RandomPlacement(random.Random(3))
        )
        handle = await writer.create_ledger(ensemble=3, write_quorum=2, ack_quorum=2)
        got: list[int] = []
        tail: asyncio.Task[None] | None = None
        try:
            for i in range(6):
                await handle.append(b"e%d" % i)
            reading = await reader.open_ledger(handle.id)

            async def follow() -> None:
                async for entry in reading.tail(0):
                    got.append(entry.entry_id)

            tail = asyncio.get_running_loop().create_task(follow())
            for _ in range(1000):
                if len(got) >= 6:
                    break
                await asyncio.sleep(0.01)
            ensemble = handle.metadata.current_ensemble
            for bookie_id in ensemble[1:]:  # two of three replaced: entries 7, 8, ... move off them
                if how == "killed":
                    await cluster.by_id(bookie_id).kill()
                else:
                    cluster.by_id(bookie_id).script = lambda r: (
                        Reply.error(StatusCode.EREADONLY) if isinstance(r, m.AddEntryRequest) else None
                    )
            for i in range(6, 15):
                await handle.append(b"e%d" % i)
            assert len(handle.metadata.ensembles) > 1
            for _ in range(1000):
                if len(got) >= 14 or tail.done():  # the LAC the writer sent covers 13 at least
                    break
                await asyncio.sleep(0.01)
            assert not tail.done(), tail.exception()
            assert got[:14] == list(range(14))
        finally:
            if tail is not None:
                tail.cancel()
                await asyncio.gather(tail, return_exceptions=True)
            await writer.close()
            await reader.close()
