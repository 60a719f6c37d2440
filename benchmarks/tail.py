"""Tail benchmark: how long after the writer's ack does a tailing reader hand out the entry?

Real bookie processes (fsync on), 3 bookies, E3/Qw3/Qa2 by default, 1 KiB entries. One writer
appends one entry at a time (``await append``: the write latency is the ack latency of a lone
add), optionally paced at ``--rate`` entries/s; a second client tails the ledger with
``ReadHandle.tail()`` in the same process. Per entry: write latency = ack - send, tail latency =
reader has it - ack. A reader learns of entry k when a bookie's LAC reaches k, i.e. when entry
k + 1 (which carries LAC k) is durable there, or when the writer's explicit LAC goes out after
``explicit_lac_interval_ms`` idle — so back to back, the tail latency is about one write latency.

Prints one JSON line per run and a summary (medians over ``--reps``).

    python -m benchmarks.tail --reps 5
    python -m benchmarks.tail --reps 3 --rate 500 --explicit-lac-ms 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

from hdrh.histogram import HdrHistogram

from benchmarks import _cluster
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from tests.harness.bookie_proc import BookieProcess

LATENCY_US_MAX = 60_000_000


def _client(procs: list[BookieProcess], ledgers: LedgerManager, explicit_lac_ms: int) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory([p.bookie_id for p in procs]),
        config=ClientConfig(explicit_lac_interval_ms=explicit_lac_ms),
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )


def _pct(hist: HdrHistogram, q: float) -> float:
    return round(float(hist.get_value_at_percentile(q)) / 1000, 3)


async def one_run(
    procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager
) -> dict[str, Any]:
    writer = _client(procs, ledgers, args.explicit_lac_ms)
    reader = _client(procs, ledgers, args.explicit_lac_ms)
    n = args.entries
    acked_at = [0.0] * n
    seen_at = [0.0] * n
    write_hist = HdrHistogram(1, LATENCY_US_MAX, 3)
    tail_hist = HdrHistogram(1, LATENCY_US_MAX, 3)
    try:
        lh = await writer.create_ledger(args.ensemble, args.qw, args.qa, password=b"bench")
        await lh.append(b"warm-up")  # entry 0: connections are up before the clock starts
        rh = await reader.open_ledger(lh.id, password=b"bench")

        async def follow() -> None:
            async for entry in rh.tail(1):
                seen_at[entry.entry_id - 1] = time.perf_counter()

        tail_task = asyncio.create_task(follow())
        await asyncio.sleep(0.05)
        payload = os.urandom(args.size)
        interval_s = 1 / args.rate if args.rate else 0.0
        next_at = time.perf_counter()
        for i in range(n):
            if interval_s:
                next_at += interval_s
                delay_s = next_at - time.perf_counter()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
            sent = time.perf_counter()
            await lh.append(payload)
            acked_at[i] = time.perf_counter()
            write_hist.record_value(max(1, int((acked_at[i] - sent) * 1e6)))
        await asyncio.sleep(0.3)  # the last entry arrives via the explicit LAC
        await lh.close()
        await asyncio.wait_for(tail_task, 10)
        negative = 0
        for i in range(n):
            delta_us = int((seen_at[i] - acked_at[i]) * 1e6)
            negative += delta_us < 0
            tail_hist.record_value(max(1, delta_us))
        # the last entry waits for the explicit LAC by design: reported separately
        last_ms = round((seen_at[-1] - acked_at[-1]) * 1000, 3)
        return {
            "entries": n,
            "rate": args.rate or "back-to-back",
            "write_p50_ms": _pct(write_hist, 50),
            "write_p99_ms": _pct(write_hist, 99),
            "tail_after_ack_p50_ms": _pct(tail_hist, 50),
            "tail_after_ack_p99_ms": _pct(tail_hist, 99),
            "last_entry_after_ack_ms": last_ms,
            "seen_before_writer_resumed": negative,
        }
    finally:
        await reader.close()
        await writer.close()


def main() -> None:
    parser = _cluster.parser(__doc__)
    parser.add_argument("--entries", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=0.0, help="entries/s; 0 = back to back")
    parser.add_argument("--explicit-lac-ms", type=int, default=100)
    args = parser.parse_args()
    runs = _cluster.run_reps("tail", args, one_run)
    keys = ("write_p50_ms", "write_p99_ms", "tail_after_ack_p50_ms", "tail_after_ack_p99_ms")
    summary: dict[str, Any] = {
        "bench": "tail",
        "shape": _cluster.shape(args),
        "explicit_lac_ms": args.explicit_lac_ms,
        "rate": args.rate or "back-to-back",
        "reps": len(runs),
    }
    for key in keys:
        summary[f"{key}_median"] = round(statistics.median(r[key] for r in runs), 3)
    summary["tail_minus_write_p50_ms_median"] = round(
        statistics.median(r["tail_after_ack_p50_ms"] - r["write_p50_ms"] for r in runs), 3
    )
    summary["loadavg"] = os.getloadavg()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
