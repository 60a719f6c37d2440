"""The sandbox demo: one writer, one tailing reader, live progress, throughput and latency.

The writer appends to an E3/Qw2/Qa2 ledger (fewer bookies: E=Qw=Qa=bookies): first as fast as it
can with a bounded number in flight (throughput), then — once the reader has caught up — at a fixed
rate (latency). A second client opens the ledger without recovery and follows the LAC while the
writer runs, reading each new entry as it is confirmed. At the end the reader checks it saw every
entry, in order, byte-identical.
"""

from __future__ import annotations

import asyncio
import time

import metadata
from bookkeeper_aio.cli.output import Progress
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.ledger import LedgerHandle

DEMO_PASSWORD = b"sandbox-demo"


def payload_for(entry_id: int, size: int) -> bytes:
    stamp = f"demo entry {entry_id:08d} ".encode()
    return (stamp * (size // len(stamp) + 1))[:size]


async def _quorums(url: str) -> tuple[int, int, int]:
    async with metadata.connect(url) as meta:
        count = len((await metadata.list_bookies(meta.store, meta.root)).writable)
    ensemble = min(3, count)
    quorum = min(2, ensemble)
    return ensemble, quorum, quorum


async def run_demo(url: str, entries: int = 20_000, entry_bytes: int = 1024) -> dict[str, float]:
    """Throughput phase (``entries`` pipelined, <= ``IN_FLIGHT_MAX`` in flight), then a latency
    phase (a tenth as many at ``RATE_PER_S``), while a second client tails the ledger."""
    rate_entries = max(100, entries // 10)
    ensemble, write_quorum, ack_quorum = await _quorums(url)
    total = entries + rate_entries
    print(f"demo: ledger E{ensemble}/Qw{write_quorum}/Qa{ack_quorum}, {total} entries of {entry_bytes} B")
    async with BookKeeper.connect(url) as writer_bk, BookKeeper.connect(url) as reader_bk:
        handle = await writer_bk.create_ledger(
            ensemble,
            write_quorum,
            ack_quorum,
            password=DEMO_PASSWORD,
            custom_metadata={"app": b"sandbox-demo"},
        )
        caught_up = asyncio.Event()
        reader = asyncio.create_task(_tail(reader_bk, handle.id, total, entry_bytes, (entries, caught_up)))
        try:
            elapsed_s = await _write_pipelined(handle, entries, entry_bytes)
            # measure latency on a quiet cluster, not behind the reader's catch-up
            waiter = asyncio.ensure_future(caught_up.wait())
            await asyncio.wait([reader, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            latencies_ms = await _write_at_rate(handle, entries, rate_entries, entry_bytes)
            await handle.close()
            seen = await reader
        finally:
            reader.cancel()
    lat = sorted(latencies_ms)
    summary = {
        "entries_per_s": entries / elapsed_s,
        "p50_ms": lat[len(lat) // 2],
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "reader_entries": float(seen),
    }
    print(
        f"demo: throughput {summary['entries_per_s']:,.0f} entries/s ({IN_FLIGHT_MAX} in flight); "
        f"add latency at {RATE_PER_S}/s: p50 {summary['p50_ms']:.2f} ms, p99 {summary['p99_ms']:.2f} ms"
    )
    print(f"demo: tailing reader saw {seen} entries, in order and byte-identical; ledger {handle.id} closed")
    return summary


IN_FLIGHT_MAX = 1_000
RATE_PER_S = 2_000


async def _write_pipelined(handle: LedgerHandle, entries: int, entry_bytes: int) -> float:
    """``entries`` appends with at most ``IN_FLIGHT_MAX`` outstanding; returns the seconds taken."""
    progress = Progress("write", entries)
    slots = asyncio.Semaphore(IN_FLIGHT_MAX)
    done = 0

    def release(_future: asyncio.Future[int]) -> None:
        nonlocal done
        done += 1
        slots.release()

    start = time.perf_counter()
    futures = []
    for entry_id in range(entries):
        await slots.acquire()
        future = await handle.append_async(payload_for(entry_id, entry_bytes))
        future.add_done_callback(release)
        futures.append(future)
        if entry_id % 256 == 0:
            progress.update(done)
    await asyncio.gather(*futures)
    elapsed = time.perf_counter() - start
    progress.update(done)
    progress.finish()
    return elapsed


async def _write_at_rate(handle: LedgerHandle, first: int, count: int, entry_bytes: int) -> list[float]:
    """``count`` appends at ``RATE_PER_S`` (open loop); each add's latency in ms."""
    latencies_ms: list[float] = []
    clock = time.perf_counter

    def timed(future: asyncio.Future[int], sent: float) -> None:
        future.add_done_callback(lambda _f: latencies_ms.append((clock() - sent) * 1e3))

    start = clock()
    futures = []
    for index in range(count):
        delay = start + index / RATE_PER_S - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = clock()
        future = await handle.append_async(payload_for(first + index, entry_bytes))
        timed(future, sent)
        futures.append(future)
    await asyncio.gather(*futures)
    return latencies_ms


async def _tail(
    bk: BookKeeper, ledger_id: int, entries: int, entry_bytes: int, signal: tuple[int, asyncio.Event]
) -> int:
    """Follow the writer through LAC reads; returns how many entries were read and checked."""
    handle = await bk.open_ledger(ledger_id, password=DEMO_PASSWORD)
    next_entry = 0
    while next_entry < entries:
        lac = await handle.refresh_lac()
        if lac < next_entry:
            await asyncio.sleep(0.005)
            continue
        async for entry in handle.read(next_entry, lac):
            if entry.entry_id != next_entry or entry.payload != payload_for(next_entry, entry_bytes):
                raise RuntimeError(f"demo reader: entry {entry.entry_id} is not what was written")
            next_entry += 1
            if next_entry == signal[0]:
                signal[1].set()
    return next_entry
