"""Autorecovery benchmark: the copy rate of healing a lost bookie, as a ratio of the cluster's
batch-read rate, and a foreground writer's latency during the heal against without.

Shape (issue 15): 4 real bookie processes (fsync on), ``--ledgers`` closed ledgers of
``--entries`` x ``--size`` written to b0, b1, b2 (E3/Qw3/Qa2 by default: every bookie holds every
entry, so reads are batch reads). Per run:

1. read every ledger through the client (batch reads): the cluster's read rate, MB/s of payload;
2. a foreground writer (its own ledger on b0, b1, b3) appends ``--rate`` entries/s for ``--seconds``
   alone: its add latency without a heal;
3. b2 is "lost" (no longer writable; the copy reads the survivors first), every ledger is marked
   and one replication worker heals them all (copy to b3 + CAS) while the same writer appends
   again: the heal's copy rate (MB/s of payload written to the replacement) and the writer's
   latency during the heal.

Prints one JSON line per run and a summary (medians). ``--copy-rate-mb`` limits the heal's copies.

    python -m benchmarks.autorecovery_heal --reps 3
    python -m benchmarks.autorecovery_heal --reps 3 --copy-rate-mb 8
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
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from metadata.underreplication import UnderReplicationManager
from tests.harness.bookie_proc import BookieProcess

PASSWORD = b"bench"


def _client(procs: list[BookieProcess], ledgers: LedgerManager, writable: list[str]) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory(writable),
        config=ClientConfig(add_window_max=2000),
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )


async def _paced_writer(bk: BookKeeper, args: argparse.Namespace, stop: asyncio.Event) -> list[float]:
    handle = await bk.create_ledger(3, 2, 2, password=PASSWORD)
    payload = os.urandom(args.size)
    latencies: list[float] = []
    interval = 1.0 / args.rate
    next_at = time.perf_counter()  # uvloop's loop.time() has millisecond resolution
    while not stop.is_set():
        started = time.perf_counter()
        await handle.append(payload)
        latencies.append(time.perf_counter() - started)
        next_at += interval
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    await handle.close()
    return latencies


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0


async def one_run(
    procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager
) -> dict[str, Any]:
    all_ids = [p.bookie_id for p in procs]
    writer_bk = _client(procs, ledgers, all_ids[:3])
    try:
        ids = []
        for _ in range(args.ledgers):
            handle = await writer_bk.create_ledger(args.ensemble, args.qw, args.qa, password=PASSWORD)
            payload = os.urandom(args.size)
            futures = [await handle.append_async(payload) for _ in range(args.entries)]
            await asyncio.gather(*futures)
            await handle.close()
            ids.append(handle.id)
    finally:
        await writer_bk.close()
    payload_bytes = args.ledgers * args.entries * args.size

    reader = _client(procs, ledgers, all_ids)
    started = time.perf_counter()
    for ledger_id in ids:
        rh = await reader.open_ledger(ledger_id, password=PASSWORD)
        async for _ in rh.read():
            pass
    read_s = time.perf_counter() - started
    await reader.close()

    survivors = [b for b in all_ids if b != "b2"]
    foreground = _client(procs, ledgers, survivors)
    healer = _client(procs, ledgers, survivors)
    try:
        stop = asyncio.Event()
        alone_task = asyncio.create_task(_paced_writer(foreground, args, stop))
        await asyncio.sleep(args.seconds)
        stop.set()
        alone = await alone_task

        urm = UnderReplicationManager(ledgers.store, ledgers.keys.root)
        config = AutorecoveryConfig(
            passwords=(PASSWORD,), copy_bytes_per_s=args.copy_rate_mb * 1e6, copy_window=args.copy_window
        )
        worker = ReplicationWorker(healer, urm, config, worker_id="bench")
        marks = [await urm.mark(ledger_id, ["b2"], reason="lost") for ledger_id in ids]
        stop = asyncio.Event()
        during_task = asyncio.create_task(_paced_writer(foreground, args, stop))
        started = time.perf_counter()
        for mark in marks:
            result = await worker.heal(mark)
            assert result.resolved, result
        heal_s = time.perf_counter() - started
        stop.set()
        during = await during_task
    finally:
        await foreground.close()
        await healer.close()
    read_mb_s = payload_bytes / read_s / 1e6
    heal_mb_s = payload_bytes / heal_s / 1e6
    return {
        "shape": _cluster.shape(args),
        "copy_rate_limit_mb_s": args.copy_rate_mb,
        "copy_window": args.copy_window,
        "payload_mb": round(payload_bytes / 1e6, 1),
        "batch_read_mb_s": round(read_mb_s, 1),
        "heal_mb_s": round(heal_mb_s, 1),
        "heal_over_read": round(heal_mb_s / read_mb_s, 3),
        "heal_s": round(heal_s, 2),
        "entries_copied": worker.metrics.entries_copied,
        "write_p50_ms_alone": round(_p(alone, 0.5), 2),
        "write_p99_ms_alone": round(_p(alone, 0.99), 2),
        "write_p50_ms_during_heal": round(_p(during, 0.5), 2),
        "write_p99_ms_during_heal": round(_p(during, 0.99), 2),
    }


def main() -> None:
    parser = _cluster.parser(__doc__, reps=3)
    parser.add_argument("--ledgers", type=int, default=16)
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument("--rate", type=int, default=200, help="foreground adds per second")
    parser.add_argument("--seconds", type=float, default=3.0, help="foreground run without a heal")
    parser.add_argument("--copy-window", type=int, default=64, help="entries copied at once per fragment")
    parser.add_argument("--copy-rate-mb", type=float, default=0.0, help="the heal's copy limit (0: none)")
    parser.set_defaults(size=4096)
    args = parser.parse_args()
    _cluster.BOOKIES = 4
    runs = _cluster.run_reps("autorecovery", args, one_run)
    numeric = [key for key, value in runs[0].items() if isinstance(value, int | float)]
    summary = {key: statistics.median(run[key] for run in runs) for key in numeric}
    print(json.dumps({"summary": summary, "reps": len(runs)}))


if __name__ == "__main__":
    main()
