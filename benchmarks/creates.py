"""Ledger creates per second through the client, and the client's CPU per create.

Creates ``--ledgers`` ledgers with one password, ``--concurrency`` at a time (as ``bkaio bench``
makes its ledgers), on in-memory metadata (no round trip: the client's own cost, whose largest part
used to be the key derivation, PBKDF2 of 20,000 rounds per ledger before key format 3) or on a
private single-member etcd (``--etcd``: what a cluster's metadata adds). No bookie is contacted:
a ledger's bookies see it at its first add. Each rep starts with empty key caches, as a fresh
client process would. The client's CPU counts every thread of this process (the key derivation
runs on a worker thread).

    python -m benchmarks.creates --ledgers 2000 --reps 3
    python -m benchmarks.creates --ledgers 2000 --reps 3 --etcd

Prints one JSON line per rep and a summary line with the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from typing import Any

import uvloop

import metadata
from bookkeeper_aio import BookKeeper
from bookkeeper_aio.client import keys
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from tests.harness.etcd import EtcdCluster, find_etcd_binary

PASSWORD = b"bench"
BOOKIES = ["bookie-1", "bookie-2", "bookie-3"]


async def one_rep(store: metadata.MetadataStore, root: str, args: argparse.Namespace) -> dict[str, Any]:
    keys.clear_cache()  # a fresh client process
    bk = BookKeeper(LedgerManager(store, root), StaticDirectory(BOOKIES))
    handles = []

    async def create() -> None:
        handles.append(await bk.create_ledger(3, 2, 2, password=PASSWORD))

    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        for start in range(0, args.ledgers, args.concurrency):
            batch = min(args.concurrency, args.ledgers - start)
            await asyncio.gather(*(create() for _ in range(batch)))
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        for handle in handles:
            handle.abort()
        await bk.close()
    return {
        "ledgers": len(handles),
        "creates_per_s": round(len(handles) / wall_s),
        "client_cpu_ms_per_create": round(cpu_s * 1000 / len(handles), 3),
    }


async def run(args: argparse.Namespace) -> None:
    rows = []
    cluster = EtcdCluster(find_etcd_binary()).start() if args.etcd else None
    try:
        for rep in range(args.reps):
            root = f"/creates-{rep}"
            if cluster is None:
                store: metadata.MetadataStore = metadata.MemoryStore()
            else:
                store = metadata.connect(cluster.url(root)).store
            try:
                await metadata.init_cluster(store, root)
                row = await one_rep(store, root, args)
            finally:
                await store.close()
            rows.append(row)
            print(json.dumps({"rep": rep, **row}), flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    summary = {
        "summary": True,
        "metadata": "etcd" if args.etcd else "memory",
        "ledgers": args.ledgers,
        "concurrency": args.concurrency,
        "creates_per_s": statistics.median(r["creates_per_s"] for r in rows),
        "client_cpu_ms_per_create": statistics.median(r["client_cpu_ms_per_create"] for r in rows),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ledgers", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--etcd", action="store_true", help="a private single-member etcd")
    uvloop.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
