"""Read path: failover, corrupt replicas skipped, speculative reads, every replica failing."""

from __future__ import annotations

import asyncio
import time

import pytest

from bookkeeper_aio import BookKeeper, DigestError, NoSuchEntry
from bookkeeper_aio.protocol import messages as m
from tests.harness.fake_bookie import FakeCluster, Reply


async def _closed_ledger(bk: BookKeeper, n: int, e: int = 3, qw: int = 2) -> int:
    lh = await bk.create_ledger(e, qw, 2, password=b"pw")
    for i in range(n):
        await lh.append(b"%d" % i)
    await lh.close()
    return lh.id


def _reads(bookie) -> int:  # type: ignore[no-untyped-def]
    return sum(isinstance(r, m.ReadEntryRequest) for r in bookie.requests)


async def test_read__corrupt_replica_is_skipped_never_returned(bk: BookKeeper, cluster: FakeCluster) -> None:
    ledger_id = await _closed_ledger(bk, 10)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    first_replica = cluster.by_id(rh.metadata.ensembles[0][1][4 % 3])
    first_replica.corrupt_reads.add((ledger_id, 4))
    entry = await rh.read_entry(4)
    assert entry.payload == b"4"
    assert [e.payload async for e in rh.read()] == [b"%d" % i for i in range(10)]


async def test_read__every_replica_corrupt_raises_digest_error(bk: BookKeeper, cluster: FakeCluster) -> None:
    ledger_id = await _closed_ledger(bk, 3)
    for bookie in cluster.bookies:
        bookie.corrupt_reads.add((ledger_id, 1))
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    with pytest.raises(DigestError):
        await rh.read_entry(1)


async def test_read__dead_replica_fails_over(bk: BookKeeper, cluster: FakeCluster) -> None:
    ledger_id = await _closed_ledger(bk, 30)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    await cluster.by_id(rh.metadata.ensembles[0][1][0]).kill()
    assert [e.payload async for e in rh.read()] == [b"%d" % i for i in range(30)]


async def test_read__missing_everywhere_is_no_such_entry(bk: BookKeeper, cluster: FakeCluster) -> None:
    ledger_id = await _closed_ledger(bk, 3)
    for bookie in cluster.bookies:
        if ledger_id in bookie.ledgers:
            bookie.ledgers[ledger_id].entries.pop(2, None)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    with pytest.raises(NoSuchEntry):
        await rh.read_entry(2)


async def test_read__slow_replica_triggers_speculative_read(bk: BookKeeper, cluster: FakeCluster) -> None:
    ledger_id = await _closed_ledger(bk, 3, e=3, qw=3)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    slow = cluster.by_id(rh.metadata.ensembles[0][1][0])
    slow.script = lambda req: Reply.delay(0.8) if isinstance(req, m.ReadEntryRequest) else None
    started = time.monotonic()
    entry = await rh.read_entry(0)  # write set starts at the slow bookie
    assert entry.payload == b"0"
    assert time.monotonic() - started < 0.5  # speculative delay is 50 ms
    await asyncio.sleep(0)


async def test_read__range_iteration_can_stop_early(bk: BookKeeper) -> None:
    ledger_id = await _closed_ledger(bk, 100)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    got = []
    async for entry in rh.read():
        got.append(entry.entry_id)
        if entry.entry_id == 10:
            break
    assert got == list(range(11))
    assert (await rh.read_entry(99)).payload == b"99"


async def test_refresh_lac__follows_an_ensemble_change_made_after_open(
    bk: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    for i in range(5):
        await lh.append(b"%d" % i)
    rh = await bk.open_ledger(lh.id, password=b"pw")
    await cluster.by_id(lh.metadata.current_ensemble[0]).kill()
    for i in range(5, 20):
        await lh.append(b"%d" % i)
    assert lh.ensemble_changes == 1
    await asyncio.sleep(0.2)  # explicit LAC
    assert await rh.refresh_lac() == 19
    assert [e.payload async for e in rh.read(5)] == [b"%d" % i for i in range(5, 20)]
    await lh.close()
    assert await rh.refresh_lac() == 19
    assert rh.is_closed
