"""Range reads in BATCH_READs (Qw == E): order, fragment boundaries, short and corrupt batches,
failover, speculation, bounds; Qw < E in stripes with a step (and on bookies that ignore it)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from bookkeeper_aio import BookKeeper, DigestError, LedgerEntry, NoSuchEntry
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from metadata.ledger_manager import LedgerManager
from tests.harness.fake_bookie import FakeBookie, FakeCluster, Reply
from tests.unit.client.conftest import FAST, make_client

BATCHED = dataclasses.replace(FAST, read_window_max=64, batch_read_count_max=16)
"""Batches of 16 entries, 4 in flight."""


def _payload(i: int) -> bytes:
    return b"entry-%05d" % i


async def _write(bk: BookKeeper, n: int, e: int = 3, qw: int = 3, qa: int = 2, close: bool = True) -> int:
    lh = await bk.create_ledger(e, qw, qa, password=b"pw")
    futures = [await lh.append_async(_payload(i)) for i in range(n)]
    await asyncio.gather(*futures)
    if close:
        await lh.close()
    return lh.id


@pytest.fixture
async def reader(ledgers: LedgerManager, directory: StaticDirectory) -> AsyncIterator[BookKeeper]:
    client = make_client(ledgers, directory, BATCHED)
    yield client
    await client.close()


def _batches(bookie: FakeBookie, ledger_id: int) -> list[m.BatchReadRequest]:
    return [r for r in bookie.requests if isinstance(r, m.BatchReadRequest) and r.ledger_id == ledger_id]


def _all_batches(cluster: FakeCluster, ledger_id: int) -> list[m.BatchReadRequest]:
    return [r for b in cluster.bookies for r in _batches(b, ledger_id)]


def _single_reads(cluster: FakeCluster, ledger_id: int) -> int:
    return sum(
        isinstance(r, m.ReadEntryRequest) and r.ledger_id == ledger_id
        for b in cluster.bookies
        for r in b.requests
    )


def _clear_requests(cluster: FakeCluster) -> None:
    for bookie in cluster.bookies:
        bookie.requests.clear()


async def _read_all(
    reader: BookKeeper, ledger_id: int, first: int = 0, last: int | None = None
) -> list[bytes]:
    rh = await reader.open_ledger(ledger_id, password=b"pw")
    got = []
    expected_id = first
    async for entry in rh.read(first, last):
        assert entry.entry_id == expected_id
        expected_id += 1
        got.append(entry.payload)
    return got


async def _collect(entries: AsyncIterator[LedgerEntry], into: list[bytes]) -> None:
    async for entry in entries:
        into.append(entry.payload)


async def test_batch__qw_equals_e_reads_in_order_in_batches_across_a_fragment_boundary(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    lh = await bk.create_ledger(3, 3, 2, password=b"pw")
    for i in range(100):
        await lh.append(_payload(i))
    victim = cluster.by_id(lh.metadata.current_ensemble[1])
    victim.script = lambda req: Reply.error(StatusCode.EIO) if isinstance(req, m.AddEntryRequest) else None
    futures = [await lh.append_async(_payload(i)) for i in range(100, 250)]
    await asyncio.gather(*futures)
    await lh.close()
    assert lh.ensemble_changes == 1
    boundary = lh.metadata.ensembles[1][0]
    assert boundary == 100
    _clear_requests(cluster)

    assert await _read_all(reader, lh.id) == [_payload(i) for i in range(250)]

    batches = _all_batches(cluster, lh.id)
    assert _single_reads(cluster, lh.id) == 0
    assert len(batches) >= 250 // 16
    for request in batches:
        end = request.start_entry_id + request.max_count - 1
        assert end <= 249
        assert end < boundary or request.start_entry_id >= boundary, request  # never across fragments
        assert request.max_count <= 16
    # each fragment is read from its own ensemble
    second = set(lh.metadata.ensembles[1][1])
    for bookie in cluster.bookies:
        if bookie.id not in second:
            assert all(r.start_entry_id < boundary for r in _batches(bookie, lh.id))


async def test_batch__short_batches_have_the_rest_read_again(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 100)
    for bookie in cluster.bookies:
        bookie.batch_read_limit = 5
    _clear_requests(cluster)
    assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(100)]
    starts = sorted(r.start_entry_id for r in _all_batches(cluster, ledger_id))
    assert len(starts) >= 100 // 5
    assert {0, 5, 10, 15} <= set(starts)  # batch [0, 15] answered 5 at a time
    assert _single_reads(cluster, ledger_id) == 0


async def test_batch__byte_budget_is_split_between_batches_in_flight(
    bk: BookKeeper, ledgers: LedgerManager, directory: StaticDirectory, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 80)
    _clear_requests(cluster)
    config = dataclasses.replace(BATCHED, batch_read_bytes_max=400)
    client = make_client(ledgers, directory, config)
    try:
        assert await _read_all(client, ledger_id) == [_payload(i) for i in range(80)]
    finally:
        await client.close()
    batches = _all_batches(cluster, ledger_id)
    assert {r.max_bytes for r in batches} == {100}  # 400 bytes over 4 batches in flight
    assert len(batches) >= 40  # a 46-byte body each: 2 per answer at most


async def test_batch__corrupt_body_mid_batch_is_read_from_another_replica(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 48)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    ensemble = rh.metadata.ensembles[0][1]
    first, second = cluster.by_id(ensemble[0]), cluster.by_id(ensemble[1])  # batch [0, 15]: 0, 1, 2
    first.corrupt_reads.add((ledger_id, 5))
    _clear_requests(cluster)
    with capture_logs() as logs:
        assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(48)]
    assert [r.start_entry_id for r in _batches(first, ledger_id)][:1] == [0]
    retry = [r for r in _batches(second, ledger_id) if r.start_entry_id == 5]
    assert len(retry) == 1
    assert retry[0].max_count == 11  # entries 5..15 from the next replica
    corrupt = [e for e in logs if e["event"] == "read.corrupt_replica"]
    assert [(e["entry_id"], e["bookie"]) for e in corrupt] == [(5, first.id)]


async def test_batch__entry_corrupt_on_every_replica_raises_digest_error_after_the_good_ones(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 40)
    for bookie in cluster.bookies:
        bookie.corrupt_reads.add((ledger_id, 21))
    rh = await reader.open_ledger(ledger_id, password=b"pw")
    got: list[bytes] = []
    with pytest.raises(DigestError):
        await _collect(rh.read(), got)
    assert got == [_payload(i) for i in range(21)]


async def test_batch__entry_missing_everywhere_raises_no_such_entry_after_the_good_ones(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 40)
    for bookie in cluster.bookies:
        if ledger_id in bookie.ledgers:
            bookie.ledgers[ledger_id].entries.pop(30)
    rh = await reader.open_ledger(ledger_id, password=b"pw")
    got: list[bytes] = []
    with pytest.raises(NoSuchEntry):
        await _collect(rh.read(), got)
    assert got == [_payload(i) for i in range(30)]


async def test_batch__entry_missing_on_one_replica_is_read_from_another(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 40)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    lacking = cluster.by_id(rh.metadata.ensembles[0][1][0])
    for entry_id in (3, 4, 20):
        lacking.ledgers[ledger_id].entries.pop(entry_id)
    assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(40)]


async def test_batch__bookie_failing_batches_fails_over(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 64)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    ensemble = rh.metadata.ensembles[0][1]
    failing = cluster.by_id(ensemble[0])
    failing.script = lambda req: Reply.error(StatusCode.EIO) if isinstance(req, m.BatchReadRequest) else None
    _clear_requests(cluster)
    assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(64)]
    failed_starts = {r.start_entry_id for r in _batches(failing, ledger_id)}
    assert failed_starts  # it was asked first for some batches...
    answered = {r.start_entry_id for b in cluster.bookies if b is not failing for r in _batches(b, ledger_id)}
    assert failed_starts <= answered  # ...and each of them was asked of another replica
    assert _single_reads(cluster, ledger_id) == 0


async def test_batch__dead_bookie_fails_over(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 64)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    await cluster.by_id(rh.metadata.ensembles[0][1][0]).kill()
    assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(64)]


async def test_batch__slow_bookie_triggers_a_speculative_batch(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 48)
    rh = await bk.open_ledger(ledger_id, password=b"pw")
    slow = cluster.by_id(rh.metadata.ensembles[0][1][0])  # first replica of batch [0, 15]
    slow.script = lambda req: Reply.delay(0.8) if isinstance(req, m.BatchReadRequest) else None
    await _read_all(reader, ledger_id, 47, 47)  # connections up before the clock starts
    started = time.monotonic()
    assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(48)]
    assert time.monotonic() - started < 0.5  # speculative delay is 50 ms, the slow answer 800 ms
    assert _single_reads(cluster, ledger_id) == 0
    await asyncio.sleep(0.9)  # the late answers arrive and are ignored
    assert await _read_all(reader, ledger_id, 10, 12) == [_payload(i) for i in range(10, 13)]


async def test_batch__never_asks_beyond_the_range_nor_the_lac(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 100)
    _clear_requests(cluster)
    assert await _read_all(reader, ledger_id, 10, 37) == [_payload(i) for i in range(10, 38)]
    for request in _all_batches(cluster, ledger_id):
        assert request.start_entry_id >= 10
        assert request.start_entry_id + request.max_count - 1 <= 37

    open_id = await _write(bk, 30, close=False)  # open ledger: readable up to its LAC
    await asyncio.sleep(0.2)  # explicit LAC reaches the bookies
    rh = await reader.open_ledger(open_id, password=b"pw")
    lac = rh.last_add_confirmed
    assert lac >= 0
    _clear_requests(cluster)
    assert [e.payload async for e in rh.read()] == [_payload(i) for i in range(lac + 1)]
    for request in _all_batches(cluster, open_id):
        assert request.start_entry_id + request.max_count - 1 <= lac


async def test_batch__iteration_can_stop_early(bk: BookKeeper, reader: BookKeeper) -> None:
    ledger_id = await _write(bk, 200)
    rh = await reader.open_ledger(ledger_id, password=b"pw")
    got = []
    async for entry in rh.read():
        got.append(entry.entry_id)
        if entry.entry_id == 20:
            break
    assert got == list(range(21))
    assert [e.entry_id async for e in rh.read(150, 199)] == list(range(150, 200))


async def test_batch__striped_ledger_reads_stripes_with_a_step(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 60, e=3, qw=2, qa=2)
    _clear_requests(cluster)
    assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(60)]
    batches = _all_batches(cluster, ledger_id)
    assert {b.step for b in batches} == {3}
    # every entry asked once, in stripes of every 3rd entry
    assert sorted(
        e for b in batches for e in range(b.start_entry_id, b.start_entry_id + b.max_count * 3, 3)
    ) == list(range(60))
    # window 64 / 4 in flight / 3 stripes: 6 entries per stripe batch, runs of 18: 4 runs x 3 stripes
    assert len(batches) == 12
    assert _single_reads(cluster, ledger_id) == 0


async def test_batch__striped_ledger_on_bookies_that_ignore_the_step_is_read_one_entry_per_answer(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 60, e=3, qw=2, qa=2)
    for bookie in cluster.bookies:
        bookie.batch_step = False  # older bookies: consecutive entries, no step echoed
    _clear_requests(cluster)
    with capture_logs() as logs:
        assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(60)]
    assert not [log for log in logs if log["event"] == "read.corrupt_replica"]
    assert len(_all_batches(cluster, ledger_id)) == 60  # one entry taken per answer
    assert _single_reads(cluster, ledger_id) == 0


async def test_batch__striped_ledger_with_a_stripe_cut_short_asks_again_in_order(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 60, e=3, qw=2, qa=2)
    for bookie in cluster.bookies:
        bookie.batch_read_limit = 2
    _clear_requests(cluster)
    assert await _read_all(reader, ledger_id) == [_payload(i) for i in range(60)]
    assert _single_reads(cluster, ledger_id) == 0


async def test_batch__fencing_read_of_a_striped_ledger_keeps_single_reads(
    bk: BookKeeper, reader: BookKeeper, cluster: FakeCluster
) -> None:
    ledger_id = await _write(bk, 60, e=3, qw=2, qa=2, close=False)
    _clear_requests(cluster)
    rh = await reader.open_ledger(ledger_id, password=b"pw", recovery=True)
    assert rh.last_add_confirmed == 59
    assert all(b.step == 1 for b in _all_batches(cluster, ledger_id))
