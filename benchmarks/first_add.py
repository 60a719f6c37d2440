"""Create + first add: what a new ledger costs before its first entry is acknowledged.

Shape: a private single-member etcd, 3 bookie processes **with metadata** (so each checks the key
of a ledger it does not hold against metadata before it acknowledges the ledger's first add:
docs/bookie.md, *Ledger keys*), the real client. One ledger at a time (``--ledgers`` per rep):
``create_ledger`` (an etcd create, the key derivation), its first ``append`` (a record on each
bookie of the write set, first seen there), its second ``append`` (an add of a known ledger: the
reference), then ``close``. Latencies in milliseconds, medians and p99 over a rep; the summary
gives the medians over ``--reps``.

    python -m benchmarks.first_add --reps 3 --ledgers 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Any

import uvloop

import metadata
from bookkeeper_aio import BookKeeper
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster, find_etcd_binary

PASSWORD = b"bench"


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


async def _one_rep(url: str, procs: list[BookieProcess], args: argparse.Namespace) -> dict[str, Any]:
    payload = os.urandom(args.size)
    create, first, second, both = [], [], [], []
    conn = metadata.connect(url)
    client = BookKeeper(
        LedgerManager(conn.store, conn.root),
        StaticDirectory([p.bookie_id for p in procs]),
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )
    try:
        warm = await client.create_ledger(args.ensemble, args.qw, args.qa, password=PASSWORD)
        await warm.append(b"warm-up")  # connections up, id block claimed
        await warm.close()
        for _ in range(args.ledgers):
            t0 = time.perf_counter()
            handle = await client.create_ledger(args.ensemble, args.qw, args.qa, password=PASSWORD)
            t1 = time.perf_counter()
            await handle.append(payload)
            t2 = time.perf_counter()
            await handle.append(payload)
            t3 = time.perf_counter()
            await handle.close()
            create.append((t1 - t0) * 1e3)
            first.append((t2 - t1) * 1e3)
            second.append((t3 - t2) * 1e3)
            both.append((t2 - t0) * 1e3)
    finally:
        await client.close()
        await conn.close()
    result: dict[str, Any] = {}
    for name, values in (("create", create), ("first_add", first), ("second_add", second), ("both", both)):
        result[f"{name}_p50_ms"] = _p(values, 0.5)
        result[f"{name}_p99_ms"] = _p(values, 0.99)
    result["first_over_second_p50"] = round(result["first_add_p50_ms"] / result["second_add_p50_ms"], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ledgers", type=int, default=200, help="ledgers created per rep, one at a time")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--ensemble", type=int, default=3)
    ap.add_argument("--qw", type=int, default=3)
    ap.add_argument("--qa", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument(
        "--no-key-check", action="store_true", help="bookies without metadata (no key check: the floor)"
    )
    args = ap.parse_args()
    binary = find_etcd_binary()
    if binary is None:
        raise SystemExit("no etcd binary ($ETCD_BIN, the venv or PATH)")
    base = tempfile.mkdtemp(prefix="bench-first-add-", dir=args.dir)
    etcd = EtcdCluster(binary).start()
    url = etcd.url(f"/bench-{uuid.uuid4().hex[:8]}")
    extra = [] if args.no_key_check else ["--metadata", url]
    procs = [
        BookieProcess(os.path.join(base, f"b{i}"), bookie_id=f"b{i}", extra_args=extra) for i in range(3)
    ]
    runs = []
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:

            async def init() -> None:
                async with metadata.connect(url) as conn:
                    await metadata.ensure_cluster(conn.store, conn.root)

            runner.run(init())
            for proc in procs:
                proc.start()
            for rep in range(args.reps):
                result = {"rep": rep, **runner.run(_one_rep(url, procs, args))}
                print(json.dumps(result), flush=True)
                runs.append(result)
    finally:
        for proc in procs:
            proc.cleanup()
        etcd.stop()
        shutil.rmtree(base, ignore_errors=True)
    summary = {
        "config": vars(args),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        **{key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0] if key != "rep"},
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
