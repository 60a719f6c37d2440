"""Issue 4 acceptance against real bookie processes and a real etcd."""

from __future__ import annotations

import asyncio
import time

import pytest

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    ClientConfig,
    ClientMetrics,
    LedgerHandle,
    NotEnoughBookies,
    Unauthorized,
)
from bookkeeper_aio.protocol.digest import master_key
from metadata.ledger_metadata import LedgerState
from tests.integration.client.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd


class EventLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.changed = asyncio.Event()

    def __call__(self, event: str, value: int) -> None:
        self.events.append((event, value))
        if event == "ensemble_change.finished":
            self.changed.set()

    def changes(self) -> list[tuple[int, int]]:
        """(LAC when the change started, first entry after it) for each change; asserts no add
        completed while a change was in flight."""
        out: list[tuple[int, int]] = []
        started: int | None = None
        for event, value in self.events:
            if event == "ensemble_change.started":
                started = value
            elif event == "ensemble_change.finished":
                assert started is not None
                out.append((started, value))
                started = None
            elif event == "add.completed":
                assert started is None, f"entry {value} completed during an ensemble change"
        return out


async def _write_and_verify(bk: BookKeeper, n: int) -> None:
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    payloads = [b"%08d" % i + b"." * 100 for i in range(n)]
    futures = [await lh.append_async(p) for p in payloads]
    assert await asyncio.gather(*futures) == list(range(n))
    await lh.close()
    rh = await bk.open_ledger(lh.id, password=b"pw")
    assert rh.last_add_confirmed == n - 1
    index = 0
    async for entry in rh.read():
        assert entry.entry_id == index
        assert entry.payload == payloads[index]
        index += 1
    assert index == n


async def test_write__pipelined_entries_read_back_identical(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    await _write_and_verify(bk, 5_000)


async def test_write__entry_sizes_from_empty_to_the_maximum(cluster: Cluster, bk: BookKeeper) -> None:
    """Empty, tiny, around the bookie's inline-decode size, and the largest entry the client
    allows, pipelined together, read back identical; one byte more is refused before anything is
    sent, and the ledger stays writable."""
    await cluster.start(3)
    limit = CONFIG.entry_bytes_max
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    sizes = [0, 1, 1023, 64 * 1024, 64 * 1024 + 1, 1 << 20, limit, 5]
    payloads = [bytes((i * 7 + j) & 0xFF for j in range(size)) for i, size in enumerate(sizes)]
    futures = [await lh.append_async(p) for p in payloads]
    assert await asyncio.gather(*futures) == list(range(len(sizes)))
    with pytest.raises(BKInterfaceError):
        await lh.append(b"x" * (limit + 1))
    assert await lh.append(b"after") == len(sizes)
    await lh.close()
    rh = await bk.open_ledger(lh.id, password=b"pw")
    read = [entry.payload async for entry in rh.read()]
    assert read == [*payloads, b"after"]


@pytest.mark.slow
async def test_write__100k_pipelined_entries_read_back_identical(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    await _write_and_verify(bk, 100_000)


async def test_kill9__writes_continue_after_ensemble_change(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(4)
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    events = EventLog()
    lh.set_event_listener(events)
    acked: list[int] = []
    stop = asyncio.Event()

    async def writer() -> None:
        i = 0
        while not stop.is_set():
            future = await lh.append_async(b"entry-%d" % i)
            future.add_done_callback(lambda f: acked.append(f.result()) if not f.exception() else None)
            i += 1
            if i % 100 == 0:
                await asyncio.sleep(0.001)

    task = asyncio.create_task(writer())
    await asyncio.sleep(0.5)
    victim = lh.metadata.current_ensemble[1]
    await cluster.kill(victim)
    async with asyncio.timeout(10):
        await events.changed.wait()
    await asyncio.sleep(0.5)
    stop.set()
    await task
    await lh.close()
    changes = events.changes()
    assert changes, "no ensemble change happened"
    md = lh.metadata
    assert md.state is LedgerState.CLOSED
    assert len(md.ensembles) == 2
    first, bookies = md.ensembles[1]
    assert first == changes[0][0] + 1  # new fragment at LAC+1
    assert victim not in bookies
    assert acked == list(range(len(acked)))
    assert md.last_entry_id is not None
    assert md.last_entry_id >= first  # writes continued on the new ensemble
    rh = await bk.open_ledger(lh.id, password=b"pw")
    seen = [(e.entry_id, e.payload) async for e in rh.read()]
    assert seen == [(i, b"entry-%d" % i) for i in range(md.last_entry_id + 1)]
    assert set(acked) <= {i for i, _ in seen}


@pytest.mark.slow
async def test_sigstop__late_answers_ignored_no_duplicates_or_reordering(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(4)
    lh = await bk.create_ledger(3, 2, 2, password=b"pw")
    events = EventLog()
    lh.set_event_listener(events)
    futures = [await lh.append_async(b"%d" % i) for i in range(2_000)]
    await asyncio.gather(*futures)
    stopped = cluster.proc(lh.metadata.current_ensemble[0])
    stopped.pause()
    try:
        started = time.monotonic()
        i = 2_000
        while time.monotonic() - started < 10:
            futures.append(await lh.append_async(b"%d" % i))
            i += 1
            if i % 50 == 0:
                await asyncio.sleep(0.01)
    finally:
        stopped.resume()
    await asyncio.gather(*futures)
    for j in range(i, i + 500):  # the stopped bookie's late answers arrive meanwhile
        futures.append(await lh.append_async(b"%d" % j))
    results = await asyncio.gather(*futures)
    assert results == list(range(i + 500))
    completed = [v for e, v in events.events if e == "add.completed"]
    assert completed == list(range(i + 500))
    assert events.changes(), "the stopped bookie was never replaced"
    assert stopped.bookie_id not in lh.metadata.current_ensemble
    await lh.close()
    rh = await bk.open_ledger(lh.id, password=b"pw")
    assert [e.payload async for e in rh.read()] == [b"%d" % k for k in range(i + 500)]


async def test_errors__wrong_password(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    lh = await bk.create_ledger(3, 2, 2, password=b"right")
    await lh.append(b"a")
    with pytest.raises(Unauthorized):
        await bk.open_ledger(lh.id, password=b"wrong")
    # A writer with the wrong key is refused by the bookies themselves (EUA).
    versioned = await bk.context.ledgers.read(lh.id)
    intruder = LedgerHandle(bk.context, versioned, b"wrong", master_key(b"wrong"))
    with pytest.raises(Unauthorized):
        await intruder.append(b"b")
    intruder.abort()
    await lh.close()


async def test_errors__quorums_checked_before_metadata_and_not_enough_bookies(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    with pytest.raises(BKInterfaceError):
        await bk.create_ledger(2, 3, 2)
    assert (await bk.context.ledgers.list_page()).ledger_ids == ()
    with pytest.raises(NotEnoughBookies):
        await bk.create_ledger(4, 2, 2)
    assert (await bk.context.ledgers.list_page()).ledger_ids == ()


async def test_explicit_lac__reader_sees_last_entry_without_next_write(cluster: Cluster) -> None:
    await cluster.start(3)
    config = ClientConfig(explicit_lac_interval_ms=50)
    async with BookKeeper.connect(cluster.url, config=config) as bk:
        lh = await bk.create_ledger(3, 3, 2, password=b"pw")
        for i in range(5):
            await lh.append(b"%d" % i)
        await asyncio.sleep(0.3)
        rh = await bk.open_ledger(lh.id, password=b"pw")
        assert rh.last_add_confirmed == 4
        assert (await rh.read_entry(4)).payload == b"4"
        await lh.close()


class _CountedLacs(ClientMetrics):
    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = 0

    def explicit_lac_sent(self, ledger_id: int) -> None:
        self.sent += 1


async def test_explicit_lac__slow_steady_writer_backs_off_and_an_idle_one_is_still_seen(
    cluster: Cluster,
) -> None:
    """A writer slower than the interval, but steady, is not idle: without the back-off every
    add (30 here) would be followed by a WRITE_LAC to each bookie. Its last entry is still seen
    without a next write, and a long pause brings the base interval back."""
    await cluster.start(3)
    config = ClientConfig(explicit_lac_interval_ms=50, explicit_lac_interval_max_ms=400)
    lacs = _CountedLacs()
    async with BookKeeper.connect(cluster.url, config=config, metrics=lacs) as bk:
        lh = await bk.create_ledger(3, 3, 2, password=b"pw")
        for i in range(30):
            await lh.append(b"%d" % i)
            await asyncio.sleep(0.08)  # slower than the 50 ms interval
        assert lacs.sent <= 10, lacs.sent
        slowed = lh._lac_interval_s
        assert slowed > 0.05
        await asyncio.sleep(slowed + 0.5)  # idle: the WRITE_LAC goes out after the slowed interval
        rh = await bk.open_ledger(lh.id, password=b"pw")
        assert rh.last_add_confirmed == 29
        assert (await rh.read_entry(29)).payload == b"29"
        await asyncio.sleep(5 * slowed)  # a pause: back to the base interval with the next add
        await lh.append(b"30")
        assert lh._lac_interval_s == 0.05
        await lh.close()
