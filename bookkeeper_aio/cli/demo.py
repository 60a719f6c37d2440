"""The sandbox demo: one writer, one tailing reader, live progress, throughput and latency.

The writer appends ``entries`` entries of ``entry_bytes`` with up to ``window`` in flight on an
E3/Qw2/Qa2 ledger (fewer bookies: E=Qw=Qa=bookies). A second client opens the ledger without
recovery and follows the LAC while the writer runs, reading each new entry as it is confirmed. At
the end the reader checks it saw every entry, in order, byte-identical.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import metadata
from bookkeeper_aio.cli.output import Progress
from bookkeeper_aio.client import BookKeeper
from bookkeeper_aio.ledger import LedgerHandle

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
    ensemble, write_quorum, ack_quorum = await _quorums(url)
    print(f"demo: ledger E{ensemble}/Qw{write_quorum}/Qa{ack_quorum}, {entries} entries of {entry_bytes} B")
    async with BookKeeper.connect(url) as writer_bk, BookKeeper.connect(url) as reader_bk:
        handle = await writer_bk.create_ledger(
            ensemble,
            write_quorum,
            ack_quorum,
            password=DEMO_PASSWORD,
            custom_metadata={"app": b"sandbox-demo"},
        )
        reader = asyncio.create_task(_tail(reader_bk, handle.id, entries, entry_bytes))
        try:
            latencies_ms, elapsed_s = await _write(handle, entries, entry_bytes)
            await handle.close()
            seen = await reader
        finally:
            reader.cancel()
    lat = sorted(latencies_ms)
    summary = {
        "entries": float(entries),
        "entries_per_s": entries / elapsed_s,
        "p50_ms": lat[len(lat) // 2],
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "reader_entries": float(seen),
    }
    print(
        f"demo: wrote {entries} entries in {elapsed_s:.2f} s = {summary['entries_per_s']:,.0f} entries/s, "
        f"add latency p50 {summary['p50_ms']:.2f} ms p99 {summary['p99_ms']:.2f} ms "
        f"(mean {statistics.fmean(lat):.2f} ms)"
    )
    print(f"demo: tailing reader saw {seen} entries, in order and byte-identical; ledger {handle.id} closed")
    return summary


async def _write(handle: LedgerHandle, entries: int, entry_bytes: int) -> tuple[list[float], float]:
    """Pipelined appends (the client's window bounds what is in flight); per-add latency in ms."""
    latencies_ms: list[float] = []
    progress = Progress("write", entries)
    clock = time.perf_counter

    def timed(future: asyncio.Future[int], sent: float) -> None:
        future.add_done_callback(lambda _f: latencies_ms.append((clock() - sent) * 1e3))

    start = clock()
    futures = []
    for entry_id in range(entries):
        sent = clock()
        future = await handle.append_async(payload_for(entry_id, entry_bytes))
        timed(future, sent)
        futures.append(future)
        if entry_id % 256 == 0:
            progress.update(len(latencies_ms))
    await asyncio.gather(*futures)
    elapsed = clock() - start
    progress.finish()
    return latencies_ms, elapsed


async def _tail(bk: BookKeeper, ledger_id: int, entries: int, entry_bytes: int) -> int:
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
    return next_entry
