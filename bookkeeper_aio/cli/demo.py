"""The sandbox demo: one writer, one tailing reader, live progress, throughput and latency.

The writer appends to an E3/Qw2/Qa2 ledger (fewer bookies: E=Qw=Qa=bookies): first as fast as it
can with a bounded number in flight (throughput), then — once the reader has caught up — at a fixed
rate (latency). A second client opens the ledger without recovery and follows the LAC while the
writer runs, reading each new entry as it is confirmed. At the end the reader checks it saw every
entry, in order, byte-identical.

Every demo ledger carries the custom metadata ``app=sandbox-demo`` and the password
``sandbox-demo`` (:data:`DEMO_PASSWORD`). Before writing, the demo deletes the demo ledgers of
earlier runs (and says which): one run's ledger is kept to look at, not one per run.

Then the log demo (`run_log_demo`): a log, :data:`DEMO_LOG`, of JSON order records, rolled every
quarter of them, written while a following reader tails it across the rolls; the previous run's log
is deleted first.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from dataclasses import dataclass

import metadata
from bookkeeper_aio.cli.output import Progress
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.errors import NoSuchLog
from bookkeeper_aio.log import (
    LogPosition,
    LogRecord,
    delete_log,
    describe_log,
    open_log_reader,
    open_log_writer,
)
from metadata.idgen import BLOCK_SIZE_DEFAULT as ID_BLOCK_SIZE

DEMO_PASSWORD = b"sandbox-demo"
DEMO_APP = b"sandbox-demo"
DEMO_LOG = "demo-orders"
"""The ``app`` custom metadata value that marks a ledger as the demo's own."""


@dataclass(frozen=True, slots=True)
class DemoResult:
    ledger_id: int
    entries_per_s: float
    p50_ms: float
    p99_ms: float
    reader_entries: int


def payload_for(entry_id: int, size: int) -> bytes:
    stamp = f"demo entry {entry_id:08d} ".encode()
    return (stamp * (size // len(stamp) + 1))[:size]


async def _quorums(url: str) -> tuple[int, int, int]:
    async with metadata.connect(url) as meta:
        count = len((await metadata.list_bookies(meta.store, meta.root)).writable)
    ensemble = min(3, count)
    quorum = min(2, ensemble)
    return ensemble, quorum, quorum


async def previous_demo_ledgers(url: str) -> list[int]:
    """Ids of the ledgers an earlier demo wrote (custom metadata ``app=sandbox-demo``)."""
    found: list[int] = []
    async with metadata.connect(url) as meta:
        manager = meta.ledger_manager()
        after: int | None = None
        while True:
            page = await manager.list_page(start_after=after, limit=1000)
            for ledger_id in page.ledger_ids:
                try:
                    current = await manager.read(ledger_id)
                except metadata.NoSuchLedger:
                    continue  # deleted meanwhile
                if current.metadata.custom_metadata.get("app") == DEMO_APP:
                    found.append(ledger_id)
            if not page.more or not page.ledger_ids:
                return found
            after = page.ledger_ids[-1]


async def run_demo(url: str, entries: int = 20_000, entry_bytes: int = 1024) -> DemoResult:
    """Throughput phase (``entries`` pipelined, <= ``IN_FLIGHT_MAX`` in flight), then a latency
    phase (a tenth as many at ``RATE_PER_S``), while a second client tails the ledger."""
    rate_entries = max(100, entries // 10)
    ensemble, write_quorum, ack_quorum = await _quorums(url)
    total = entries + rate_entries
    async with BookKeeper.connect(url) as writer_bk, BookKeeper.connect(url) as reader_bk:
        old = await previous_demo_ledgers(url)
        for ledger_id in old:
            await writer_bk.delete_ledger(ledger_id, password=DEMO_PASSWORD)
        if old:
            print(f"demo: deleted the previous demo ledger{'s' if len(old) > 1 else ''} {_ids(old)}")
        handle = await writer_bk.create_ledger(
            ensemble,
            write_quorum,
            ack_quorum,
            password=DEMO_PASSWORD,
            custom_metadata={"app": DEMO_APP},
        )
        print(
            f"demo: ledger {handle.id} (E{ensemble}/Qw{write_quorum}/Qa{ack_quorum}, password "
            f"{DEMO_PASSWORD.decode()}), {total:,} entries of {entry_bytes} B: {entries:,} as fast as "
            f"possible, then {rate_entries:,} at {RATE_PER_S:,}/s"
        )
        if handle.id > 1:
            print(
                "demo: (ledger ids come in blocks of "
                f"{ID_BLOCK_SIZE:,}: each client claims a block for the ledgers it "
                "creates, so a new client's first id is the next block's)"
            )
        caught_up = asyncio.Event()
        reader = asyncio.create_task(_tail(reader_bk, handle.id, total, entry_bytes, (entries, caught_up)))
        try:
            progress = Progress("write", total)
            elapsed_s = await _write_pipelined(handle, entries, entry_bytes, progress)
            # measure latency on a quiet cluster, not behind the reader's catch-up
            waiter = asyncio.ensure_future(caught_up.wait())
            await asyncio.wait([reader, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            latencies_ms = await _write_at_rate(handle, entries, rate_entries, entry_bytes, progress)
            progress.finish()
            await handle.close()
            seen = await reader
        finally:
            reader.cancel()
    lat = sorted(latencies_ms)
    result = DemoResult(
        ledger_id=handle.id,
        entries_per_s=entries / elapsed_s,
        p50_ms=lat[len(lat) // 2],
        p99_ms=lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        reader_entries=seen,
    )
    print(
        f"demo: throughput {result.entries_per_s:,.0f} entries/s ({IN_FLIGHT_MAX} in flight); "
        f"add latency at {RATE_PER_S}/s: p50 {result.p50_ms:.2f} ms, p99 {result.p99_ms:.2f} ms"
    )
    print(f"demo: tailing reader saw {seen} entries, in order and byte-identical; ledger {handle.id} closed")
    return result


def _ids(ids: list[int]) -> str:
    return ", ".join(str(i) for i in ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")


IN_FLIGHT_MAX = 1_000
RATE_PER_S = 2_000


async def _write_pipelined(handle: LedgerHandle, entries: int, entry_bytes: int, progress: Progress) -> float:
    """``entries`` appends with at most ``IN_FLIGHT_MAX`` outstanding; returns the seconds taken.
    ``progress`` counts both phases (as the header does)."""
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
    return elapsed


async def _write_at_rate(
    handle: LedgerHandle, first: int, count: int, entry_bytes: int, progress: Progress
) -> list[float]:
    """``count`` appends at ``RATE_PER_S`` (open loop); each add's latency in ms. ``progress`` goes
    on from ``first``."""
    latencies_ms: list[float] = []
    clock = time.perf_counter

    def timed(future: asyncio.Future[int], sent: float) -> None:
        def done(_future: asyncio.Future[int]) -> None:
            latencies_ms.append((clock() - sent) * 1e3)
            progress.update(first + len(latencies_ms))

        future.add_done_callback(done)

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
    progress.update(first + len(latencies_ms))
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


def order_record(index: int) -> bytes:
    """The log demo's records: small JSON orders (the Spark example aggregates them)."""
    order = {"order": index, "customer": f"c{index % 17:02d}", "amount_cents": 100 + (index * 37) % 9_900}
    return json.dumps(order, separators=(",", ":")).encode()


LOG_DEMO_IN_FLIGHT = 20
"""Appends in flight at once: rolls take effect within this many records of their trigger."""


async def run_log_demo(url: str, records: int = 1_000) -> int:
    """Write ``records`` orders into :data:`DEMO_LOG` with a roll every quarter, while a second
    client follows the log; check it saw each record once, in order. Returns the ledger count."""
    ensemble, write_quorum, ack_quorum = await _quorums(url)
    async with BookKeeper.connect(url) as writer_bk, BookKeeper.connect(url) as reader_bk:
        with contextlib.suppress(NoSuchLog):
            await delete_log(writer_bk, DEMO_LOG, password=DEMO_PASSWORD)
            print(f"demo: deleted the previous demo log {DEMO_LOG!r}")
        writer = await open_log_writer(
            writer_bk,
            DEMO_LOG,
            ensemble=ensemble,
            write_quorum=write_quorum,
            ack_quorum=ack_quorum,
            password=DEMO_PASSWORD,
        )
        reader = await open_log_reader(reader_bk, DEMO_LOG, follow=True, password=DEMO_PASSWORD)
        seen: list[LogRecord] = []

        async def follow() -> None:
            async for record in reader:
                seen.append(record)
                if len(seen) == records:
                    return

        following = asyncio.create_task(follow())
        try:
            positions = []
            quarter = max(1, records // 4)
            next_roll = quarter
            for first in range(0, records, LOG_DEMO_IN_FLIGHT):  # a producer with a bounded window
                batch = range(first, min(records, first + LOG_DEMO_IN_FLIGHT))
                futures = [await writer.append_async(order_record(i)) for i in batch]
                positions += [await future for future in futures]
                if next_roll <= len(positions) < records:
                    await writer.roll()  # a new ledger every quarter (the reader follows it)
                    next_roll += quarter
            await writer.close()
            await asyncio.wait_for(following, 30)
        finally:
            following.cancel()
            await reader.aclose()
        info = await describe_log(writer_bk, DEMO_LOG)
    if [r.position for r in seen] != positions or [r.payload for r in seen] != [
        order_record(i) for i in range(records)
    ]:
        raise RuntimeError(f"demo log reader: what it read is not what was appended to {DEMO_LOG!r}")
    print(log_demo_line(records, positions, len(info.ledgers)))
    return len(info.ledgers)


def log_demo_line(records: int, positions: list[LogPosition | None], ledgers: int) -> str:
    """The log demo's summary: the records each ledger holds, as written (a roll lands at the end of
    the batch that crossed its quarter, so the counts are near, not at, a quarter each)."""
    per_ledger = collections.Counter(position.ledger_id for position in positions if position is not None)
    counts = "/".join(f"{per_ledger[ledger_id]:,}" for ledger_id in sorted(per_ledger))
    return (
        f"demo: log {DEMO_LOG!r}: {records:,} JSON orders in {ledgers} ledgers ({counts} records: "
        f"rolled after about every {max(1, records // 4):,}); a following reader saw each once, in "
        "order, across rolls"
    )
