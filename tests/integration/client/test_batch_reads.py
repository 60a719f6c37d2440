"""Range reads in BATCH_READs against real bookie processes and a real etcd: consecutive batches
(Qw == E) and stepped stripes (Qw < E)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper
from bookkeeper_aio.protocol import messages as m
from tests.integration.client.conftest import Cluster

pytestmark = pytest.mark.etcd

ENTRIES = 3_000


def _count_requests(bk: BookKeeper) -> collections.Counter[str]:
    """Count the requests ``bk`` sends, by type (a spy on the pool)."""
    counts: collections.Counter[str] = collections.Counter()
    pool = bk.context.pool
    send = pool.request_with_callback

    def spy(bookie_id: str, make: Callable[[int], m.Request], *args: Any) -> int:
        def counted(rid: int) -> m.Request:
            request = make(rid)
            counts[type(request).__name__] += 1
            return request

        return send(bookie_id, counted, *args)

    pool.request_with_callback = spy  # type: ignore[method-assign,assignment]
    return counts


async def _closed_ledger(bk: BookKeeper, shape: tuple[int, int, int] = (3, 3, 2)) -> tuple[int, list[bytes]]:
    lh = await bk.create_ledger(*shape, password=b"pw")
    payloads = [b"%06d" % i + b"x" * (i % 700) for i in range(ENTRIES)]
    futures = [await lh.append_async(p) for p in payloads]
    await asyncio.gather(*futures)
    await lh.close()
    return lh.id, payloads


async def _read_all(bk: BookKeeper, ledger_id: int) -> list[bytes]:
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    assert rh.last_add_confirmed == ENTRIES - 1
    got: list[bytes] = []
    async for entry in rh.read():
        assert entry.entry_id == len(got)
        got.append(entry.payload)
    return got


async def test_batch_read__closed_e3_qw3_ledger_reads_back_identical_through_batches(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    ledger_id, payloads = await _closed_ledger(bk)
    async with BookKeeper.connect(cluster.url) as reader:
        counts = _count_requests(reader)
        assert await _read_all(reader, ledger_id) == payloads
    assert counts["ReadEntryRequest"] == 0
    assert ENTRIES // 1000 <= counts["BatchReadRequest"] <= ENTRIES // 10


async def test_batch_read__killed_bookie_fails_over_to_the_other_replicas(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    ledger_id, payloads = await _closed_ledger(bk)
    md = (await bk.open_ledger(ledger_id, password=b"pw")).metadata
    await cluster.kill(md.ensembles[0][1][0])
    async with BookKeeper.connect(cluster.url) as reader:
        counts = _count_requests(reader)
        assert await _read_all(reader, ledger_id) == payloads
    assert counts["ReadEntryRequest"] == 0


@pytest.mark.parametrize(("bookies", "shape"), [(3, (3, 2, 2)), (5, (5, 2, 2))])
async def test_batch_read__striped_ledger_reads_back_identical_through_stepped_batches(
    cluster: Cluster, bk: BookKeeper, bookies: int, shape: tuple[int, int, int]
) -> None:
    await cluster.start(bookies)
    ledger_id, payloads = await _closed_ledger(bk, shape)
    async with BookKeeper.connect(cluster.url) as reader:
        counts = _count_requests(reader)
        assert await _read_all(reader, ledger_id) == payloads
    assert counts["ReadEntryRequest"] == 0
    # E stripes per run of consecutive entries, each stripe one request (one per entry before)
    assert counts["BatchReadRequest"] <= ENTRIES // 10


async def test_batch_read__striped_ledger_fails_over_when_a_bookie_is_killed(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    ledger_id, payloads = await _closed_ledger(bk, (3, 2, 2))
    md = (await bk.open_ledger(ledger_id, password=b"pw")).metadata
    await cluster.kill(md.ensembles[0][1][1])
    async with BookKeeper.connect(cluster.url) as reader:
        counts = _count_requests(reader)
        assert await _read_all(reader, ledger_id) == payloads
    assert counts["ReadEntryRequest"] == 0
