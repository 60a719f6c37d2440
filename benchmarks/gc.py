"""Bookie GC benchmark: foreground add latency while compaction copies, vs the same bookie idle.

Per rep: a fresh bookie (real process, fsync on, etcd metadata, admin endpoint) gets ``--ledgers``
ledgers written interleaved (``--entries`` x ``--entry-bytes`` each, so every journal segment holds
some of each), then all but ``--keep`` of them are deleted from metadata. Then, on that bookie,
an open-loop stream of ``--rate`` adds/s of ``--size`` bytes runs for ``--secs`` twice: once with
no GC (baseline), once right after a GC pass was started (its compaction copies the kept entries,
throttled to ``--compaction-mb-s``); the order of the two alternates from rep to rep, so a machine
whose load drifts does not favour one side. Prints one JSON line per rep and a summary of medians with
the ratios during/baseline. The pass's own numbers (bytes copied, seconds, copy rate) come along.

    python -m benchmarks.gc                       # 3 reps, 300 MiB, keep 30%, 2000 adds/s of 1 KiB
    python -m benchmarks.gc --reps 5 --compaction-mb-s 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any

import uvloop

import metadata
from benchmarks.bookie_add import ADD, KEY, Client, drive, packb
from bookkeeper_aio.protocol.digest import EntryCodec
from bookkeeper_aio.protocol.framing import LENGTH
from tests.harness.admin_http import get_json
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster, require_etcd_binary

CODEC = EntryCodec("crc32c")


async def fill(port: int, ledger_ids: list[int], entries: int, entry_bytes: int) -> None:
    """Write the ledgers interleaved over one pipelined connection (512 adds in flight)."""
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(Client, "127.0.0.1", port)
    payload = random.Random(1).randbytes(entry_bytes)
    window = asyncio.Semaphore(512)
    request_id = 0
    futures = []
    for entry_id in range(entries):
        for ledger_id in ledger_ids:
            await window.acquire()
            request_id += 1
            body = CODEC.encode(ledger_id, entry_id, entry_id - 1, 0, payload)
            packed = packb((ADD, request_id, ledger_id, entry_id, 0, KEY, body))
            future = client.add(request_id, LENGTH.pack(len(packed)) + packed)
            future.add_done_callback(lambda _: window.release())
            futures.append(future)
    statuses = await asyncio.gather(*futures)
    client.transport.close()
    if any(statuses):
        raise RuntimeError(f"{sum(1 for s in statuses if s)} adds failed while filling")


async def one_rep(url: str, base: str, args: argparse.Namespace, gc_first: bool) -> dict[str, Any]:
    """One fresh bookie; the GC window first on odd reps, the baseline first on even ones."""
    mib = 1024 * 1024
    bookie = BookieProcess(
        os.path.join(base, f"b-{uuid.uuid4().hex[:6]}"),
        "b0",
        extra_args=[
            *("--metadata", url, "--admin-port", "0", "--gc-interval-s", "0"),
            *("--gc-deleted-ledger-grace-s", "0", "--journal-segment-bytes", str(64 * mib)),
            *("--compaction-rate-bytes-per-s", str(int(args.compaction_mb_s * mib))),
            *("--disk-free-bytes-min", str(mib), "--disk-free-bytes-writable", str(mib)),
            *("--disk-reserve-bytes", "0", "--log-level", "warning"),
        ],
    )
    bookie.start()
    try:
        async with metadata.connect(url) as conn:
            manager = metadata.LedgerManager(conn.store, conn.root)
            ids = [
                (await manager.create(["b0"], write_quorum=1, ack_quorum=1)).ledger_id
                for _ in range(args.ledgers + 2)
            ]
            data, (baseline_ledger, during_ledger) = ids[:-2], ids[-2:]
            await fill(bookie.port, data, args.entries, args.entry_bytes)
            keep = set(data[:: max(1, round(1 / args.keep))]) if args.keep > 0 else set()
            for ledger_id in data:
                if ledger_id not in keep:
                    await manager.delete(ledger_id)
        host, admin_port = bookie.admin_address()
        if not gc_first:
            baseline = await drive(bookie.port, args.size, 0, args.secs, args.rate, baseline_ledger)
        _, before = await get_json(host, admin_port, "/gc")
        _, started = await get_json(host, admin_port, "/gc?start=1")
        assert started["started"]
        during = await drive(bookie.port, args.size, 0, args.secs, args.rate, during_ledger)
        _, status = await get_json(host, admin_port, "/gc")
        gc_ran_whole_window = status["running"] is not None
        while status["passes"] == before["passes"] or status["running"] is not None:
            await asyncio.sleep(0.1)
            _, status = await get_json(host, admin_port, "/gc")
        if gc_first:
            baseline = await drive(bookie.port, args.size, 0, args.secs, args.rate, baseline_ledger)
        report = status["last"]
        seconds = report["finished_at"] - report["started_at"]
        return {
            "gc_first": gc_first,
            "baseline_p50_ms": baseline["p50_ms"],
            "baseline_p99_ms": baseline["p99_ms"],
            "during_p50_ms": during["p50_ms"],
            "during_p99_ms": during["p99_ms"],
            "baseline_entries_s": baseline["entries_s"],
            "during_entries_s": during["entries_s"],
            "errors": baseline["errors"] + during["errors"],
            "gc_covered_window": gc_ran_whole_window,
            "gc_seconds": seconds,
            "gc_bytes_copied": report["bytes_copied"],
            "gc_copy_mb_s": report["bytes_copied"] / max(seconds, 1e-9) / mib,
            "gc_bytes_freed": report["bytes_freed"],
            "gc_error": report["error"],
        }
    finally:
        bookie.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ledgers", type=int, default=100)
    ap.add_argument("--entries", type=int, default=48)
    ap.add_argument("--entry-bytes", type=int, default=64 * 1024)
    ap.add_argument("--keep", type=float, default=0.3, help="fraction of the ledgers kept (the rest deleted)")
    ap.add_argument("--compaction-mb-s", type=float, default=32.0, help="the bookie's compaction throttle")
    ap.add_argument("--rate", type=float, default=2000.0, help="foreground adds/s (open loop)")
    ap.add_argument("--size", type=int, default=1024, help="foreground add payload bytes")
    ap.add_argument("--secs", type=float, default=2.0, help="length of each foreground window")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    etcd = EtcdCluster(require_etcd_binary()).start()
    base = tempfile.mkdtemp(prefix="bench-gc-", dir=args.dir)
    runs = []
    try:
        for rep_index in range(args.reps):
            url = etcd.url(f"/bench/gc-{uuid.uuid4().hex[:8]}")

            async def rep(url: str = url, gc_first: bool = rep_index % 2 == 1) -> dict[str, Any]:
                async with metadata.connect(url) as conn:
                    await metadata.init_cluster(conn.store, conn.root)
                return await one_rep(url, base, args, gc_first)

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                result = runner.run(rep())
            print(json.dumps(result), flush=True)
            runs.append(result)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        etcd.stop()
    summary: dict[str, Any] = {
        key: statistics.median(float(r[key]) for r in runs)
        for key in runs[0]
        if isinstance(runs[0][key], int | float) and not isinstance(runs[0][key], bool)
    }
    summary["p50_ratio_during_vs_baseline"] = summary["during_p50_ms"] / summary["baseline_p50_ms"]
    summary["p99_ratio_during_vs_baseline"] = summary["during_p99_ms"] / summary["baseline_p99_ms"]
    summary["gc_covered_window_all"] = all(r["gc_covered_window"] for r in runs)
    summary["machine"] = f"{platform.machine()} {os.cpu_count()} CPUs, {platform.python_version()}"
    summary["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps({"summary": summary, "args": vars(args)}), flush=True)


if __name__ == "__main__":
    main()
