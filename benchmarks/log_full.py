"""What a log writer spends while its ledger list is full (`LogFull`) and appends keep passing the
roll limit: its automatic rolls and spares are refused, each refusal encoding the ~1 MiB list.

In one process: fake bookies (tests/harness/fake_bookie.py), metadata in memory, a log whose list
holds as many closed ledgers as leave room for exactly one more (~29,900: written straight into the
list; the last two are real, closed ledgers, which the writer's takeover fences), then the writer's
own, so a roll no longer fits.
The writer (``roll_entries_max=1``) appends ``--rate`` records a second for ``--secs``; reported:
the process's CPU seconds per wall second, and that of the same appends to a small log without a
roll limit (the appends' own cost), per rep, with medians.

    python -m benchmarks.log_full --secs 30 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from bookkeeper_aio import BookKeeper, open_log_writer
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.common.logging_setup import configure_logging
from metadata.ledger_manager import LedgerManager
from metadata.log_manager import LogManager
from metadata.log_metadata import LogLedger, LogLedgerState, LogMetadata, has_room
from metadata.memory import MemoryStore
from tests.harness.fake_bookie import FakeCluster

ROOT = "/bookkeeper/log-full"


def _entries(count: int) -> list[LogLedger]:
    return [
        LogLedger(1 + i, LogLedgerState.CLOSED, 1000 * i, 999, 1_024_000, 1_764_000_000_000 + i)
        for i in range(count)
    ]


def fill_count() -> int:
    """The most entries a list may hold with two more ledgers and room for one roll after them."""
    low, high = 1, 40_000  # has_room(low + 2) holds, has_room(high + 2) does not
    while high - low > 1:
        middle = (low + high) // 2
        if has_room(LogMetadata("lg", tuple(_entries(middle + 2)), 0)):
            low = middle
        else:
            high = middle
    return low


async def _full_log(bk: BookKeeper, manager: LogManager, name: str, ledgers: int) -> None:
    """A list of ``ledgers`` closed ledgers (ids 1.., entries only) and two real closed ledgers."""
    entries = _entries(ledgers)
    for _ in range(2):
        handle = await bk.create_ledger(3, 2, 2, after_ledger_id=entries[-1].ledger_id)
        await handle.append(b"x")
        await handle.close()
        first = entries[-1].first_offset + 1000
        entries.append(LogLedger(handle.id, LogLedgerState.CLOSED, first, 0, 1, manager.now_ms()))
    created = await manager.create(name)
    await manager.write(LogMetadata(name, tuple(entries), created.metadata.ctime_ms), created.version)


async def _run(ledgers: int, rate: int, secs: float) -> float:
    """CPU seconds per wall second of ``secs`` of appends at ``rate`` (0 ledgers: a small log,
    never rolled)."""
    async with FakeCluster(4, add_acks=True) as cluster:
        store = MemoryStore()
        bk = BookKeeper(LedgerManager(store, ROOT), StaticDirectory(cluster.ids))
        try:
            manager = LogManager(store, ROOT)
            if ledgers:
                await _full_log(bk, manager, "lg", ledgers)
            writer = await open_log_writer(bk, "lg", roll_entries_max=1 if ledgers else None)
            if ledgers:
                assert not has_room((await manager.read("lg")).metadata), "not full: raise --ledgers"
            loop = asyncio.get_running_loop()
            start_cpu, start = time.process_time(), loop.time()
            for i in range(int(rate * secs)):
                await writer.append(b"r")
                await asyncio.sleep(max(0.0, start + (i + 1) / rate - loop.time()))
            cpu_share = (time.process_time() - start_cpu) / (loop.time() - start)
            await writer.close()
            return cpu_share
        finally:
            await bk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=100, help="appends per second")
    parser.add_argument("--secs", type=float, default=30.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    configure_logging("error")  # a log line per refused roll is not what is measured
    ledgers = fill_count()
    full, plain = [], []
    for rep in range(args.reps):
        full.append(asyncio.run(_run(ledgers, args.rate, args.secs)))
        plain.append(asyncio.run(_run(0, args.rate, args.secs)))
        print(
            json.dumps(
                {"rep": rep, "full_cpu_share": round(full[-1], 4), "plain_cpu_share": round(plain[-1], 4)}
            )
        )
    print(
        json.dumps(
            {
                "ledgers": ledgers + 3,
                "full_cpu_share_median": round(statistics.median(full), 4),
                "plain_cpu_share_median": round(statistics.median(plain), 4),
                "extra_ms_per_s": round(1000 * (statistics.median(full) - statistics.median(plain)), 1),
                "load_average": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
