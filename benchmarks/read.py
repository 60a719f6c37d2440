"""Range-read benchmark: entries/s of ``ReadHandle.read()`` over a closed ledger.

Real bookie processes, 3 bookies. One client writes ``--entries`` entries of ``--size`` bytes
(pipelined) and closes the ledger; a second client (cold: new connections) opens it and iterates
``read()`` over the whole ledger. With ``Qw == E`` (default E3/Qw3/Qa2) the client reads in
BATCH_READs, with ``Qw < E`` in pipelined single reads. ``--batch-count-max 1`` approximates the
single-read path on a ``Qw == E`` ledger for comparison. Each run also gives the CPU per entry
read of the client process and of the bookies together (from /proc), the figures to read on a
shared machine; ``--bookies 5 --ensemble 5 --qw 2`` reads E5 stripes.

Prints one JSON line per run and a summary (medians over ``--reps``).

    python -m benchmarks.read --reps 5
    python -m benchmarks.read --reps 5 --qw 2
    python -m benchmarks.read --reps 5 --bookies 5 --ensemble 5 --qw 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

from benchmarks import _cluster
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.cli.bench.stats import thread_cpu_s
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from tests.harness.bookie_proc import BookieProcess

_DEFAULTS = ClientConfig()


def _client(procs: list[BookieProcess], ledgers: LedgerManager, config: ClientConfig) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory([p.bookie_id for p in procs]),
        config=config,
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )


async def write_ledger(procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager) -> int:
    writer = _client(procs, ledgers, ClientConfig())
    try:
        lh = await writer.create_ledger(args.ensemble, args.qw, args.qa, password=b"bench")
        payload = os.urandom(args.size)
        futures = [await lh.append_async(payload) for _ in range(args.entries)]
        await asyncio.gather(*futures)
        await lh.close()
        return lh.id
    finally:
        await writer.close()


async def one_run(
    procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager, ledger_id: int
) -> dict[str, Any]:
    config = ClientConfig(batch_read_count_max=args.batch_count_max, read_window_max=args.window)
    reader = _client(procs, ledgers, config)
    try:
        rh = await reader.open_ledger(ledger_id, password=b"bench")
        bookies0, cpu0, started = _bookies_cpu_s(procs), time.process_time(), time.perf_counter()
        count = 0
        async for _entry in rh.read():
            count += 1
        elapsed = time.perf_counter() - started
        cpu_s, bookies_s = time.process_time() - cpu0, _bookies_cpu_s(procs) - bookies0
        assert count == args.entries
        return {
            "entries": count,
            "seconds": round(elapsed, 4),
            "entries_per_s": round(count / elapsed),
            "client_cpu_us_per_entry": round(cpu_s / count * 1e6, 2),
            "bookies_cpu_us_per_entry": round(bookies_s / count * 1e6, 2),
        }
    finally:
        await reader.close()


def _bookies_cpu_s(procs: list[BookieProcess]) -> float:
    total = 0.0
    for proc in procs:
        assert proc.proc is not None
        times = thread_cpu_s(proc.proc.pid)
        total += 0.0 if times is None else sum(times)
    return total


def main() -> None:
    parser = _cluster.parser(__doc__)
    parser.add_argument("--entries", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=_DEFAULTS.read_window_max)
    parser.add_argument("--batch-count-max", type=int, default=_DEFAULTS.batch_read_count_max)
    args = parser.parse_args()
    runs = _cluster.run_reps("read", args, one_run, prepare=write_ledger)
    summary: dict[str, Any] = {
        "bench": "read",
        "shape": _cluster.shape(args),
        "entries": args.entries,
        "window": args.window,
        "batch_count_max": args.batch_count_max,
        "reps": len(runs),
        "entries_per_s_median": round(statistics.median(r["entries_per_s"] for r in runs)),
        "client_cpu_us_per_entry_median": statistics.median(r["client_cpu_us_per_entry"] for r in runs),
        "bookies_cpu_us_per_entry_median": statistics.median(r["bookies_cpu_us_per_entry"] for r in runs),
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
