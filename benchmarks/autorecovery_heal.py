"""Autorecovery benchmark: the time to heal a lost bookie holding N GiB, its copy rate as a ratio of
the cluster's batch-read rate, and a foreground writer's latency during the heal and during the
compaction that follows, each against the same writer without them; all in one run.

Shape (issue 15), per rep on a fresh cluster: real etcd, 4 real bookie processes (fsync on, 64 MiB
journal segments, admin endpoints, GC on demand), ``--ledgers`` closed ledgers of ``--entries`` x
``--size`` (``--gib`` sets the entries) written to b0, b1, b2 (E3/Qw3/Qa2 by default: every bookie
holds every entry, so the copy reads in batches). Then:

1. read every ledger through the client (batch reads): the cluster's read rate, MB/s of payload;
   and, the yardstick of the copy's other side, b3's own add rate: ``--seconds`` of adds of the same
   entries to a ledger on b3 alone, as many in flight as the heal keeps (workers x copy window);
2. a foreground writer (its own ledger on b0, b1, b3, ``--rate`` adds/s of ``--fg-size`` bytes)
   runs ``--seconds`` alone: its add latency without anything else;
3. b2 is killed (kill -9: lost), every ledger is marked and ``--workers`` replication workers heal
   them all (copy to b3 + guarded CAS, each ledger under its lock) while the writer appends again:
   the time to heal, the copy rate (MB/s of payload written to the replacement) and the writer's
   latency during the heal;
4. ``--delete`` of the ledgers are deleted from metadata (all but every 4th with 0.75: ledgers
   were written 8 at a time, so every segment keeps some) and a GC pass is started on b0 (it holds
   every ledger: its compaction copies the kept entries, throttled to ``--compaction-mb-s``) while
   the writer appends again: the writer's latency during compaction, and the pass's numbers.

Prints one JSON line per rep and a summary (medians); the rep's data is deleted before the next.

    python -m benchmarks.autorecovery_heal --reps 3                       # 32 MiB, quick
    nice python -m benchmarks.autorecovery_heal --reps 3 --gib 1          # a bookie holding 1 GiB
    python -m benchmarks.autorecovery_heal --reps 3 --copy-rate-mb 8      # the heal throttled
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
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.autorecovery.config import AutorecoveryConfig
from bookkeeper_aio.autorecovery.worker import ReplicationWorker
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from metadata.underreplication import UnderReplicationManager
from tests.harness.admin_http import get_json, post_json
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster, require_etcd_binary

PASSWORD = b"bench"
MIB = 1024 * 1024
BOOKIES = 4
LOST = "b2"
WRITE_LEDGERS_AT_ONCE = 8


def _client(procs: list[BookieProcess], ledgers: LedgerManager, writable: list[str]) -> BookKeeper:
    return BookKeeper(
        ledgers,
        StaticDirectory(writable),
        config=ClientConfig(add_window_max=2000),
        resolver=StaticResolver({p.bookie_id: p.address for p in procs}),
    )


class PacedWriter:
    """A foreground writer: ``rate`` adds/s of ``size`` bytes on its own ledger, open loop; each
    :meth:`window` returns the latencies of the adds made while its ``until`` was pending."""

    def __init__(self, bk: BookKeeper, rate: float, size: int) -> None:
        self._bk = bk
        self._interval = 1.0 / rate
        self._payload = os.urandom(size)
        self._handle: Any = None

    async def window(self, until: asyncio.Future[Any] | float) -> list[float]:
        if self._handle is None:
            self._handle = await self._bk.create_ledger(3, 2, 2, password=PASSWORD)
        done = until if isinstance(until, asyncio.Future) else None
        deadline = None if done is not None else time.perf_counter() + float(until)  # type: ignore[arg-type]
        latencies: list[float] = []
        next_at = time.perf_counter()  # uvloop's loop.time() has millisecond resolution
        while not (done.done() if done is not None else time.perf_counter() >= deadline):  # type: ignore[operator]
            started = time.perf_counter()
            await self._handle.append(self._payload)
            latencies.append(time.perf_counter() - started)
            next_at += self._interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        return latencies

    async def close(self) -> None:
        if self._handle is not None:
            await self._handle.close()


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2) if ordered else 0.0


async def _write(bk: BookKeeper, args: argparse.Namespace) -> list[int]:
    payload = os.urandom(args.size)
    ids: list[int] = []

    async def one() -> None:
        handle = await bk.create_ledger(args.ensemble, args.qw, args.qa, password=PASSWORD)
        futures = [await handle.append_async(payload) for _ in range(args.entries)]
        await asyncio.gather(*futures)
        await handle.close()
        ids.append(handle.id)

    for start in range(0, args.ledgers, WRITE_LEDGERS_AT_ONCE):
        await asyncio.gather(*(one() for _ in range(min(WRITE_LEDGERS_AT_ONCE, args.ledgers - start))))
    return sorted(ids)


async def _heal(
    bk: BookKeeper, urm: UnderReplicationManager, config: AutorecoveryConfig, ids: list[int], workers: int
) -> ReplicationWorker:
    """``workers`` workers share the marks, each ledger under its own lock (as the daemon's do)."""
    store = urm.store
    lease = await store.grant_lease(60)
    pending = list(ids)
    team = [ReplicationWorker(bk, urm, config, worker_id=f"bench-w{i}") for i in range(workers)]
    for worker in team[1:]:
        worker.metrics = team[0].metrics
        worker.limiter = team[0].limiter

    async def run(worker: ReplicationWorker) -> None:
        while pending:
            ledger_id = pending.pop(0)
            mark = await urm.get(ledger_id)
            assert mark is not None
            lock = await urm.acquire(ledger_id, worker.worker_id, lease)
            assert lock is not None
            result = await worker.heal(mark, lock)
            assert result.resolved, result
            await urm.unlock(ledger_id, lease)

    try:
        await asyncio.gather(*(run(w) for w in team))
    finally:
        await store.revoke_lease(lease)
    return team[0]


async def _gc_pass(bookie: BookieProcess) -> dict[str, Any]:
    """Start a GC pass on ``bookie`` and return its report once it ended."""
    host, port = bookie.admin_address()
    _, before = await get_json(host, port, "/gc")
    status, started = await post_json(host, port, "/gc", bookie.admin_token())
    assert status == 200, started
    assert started["started"], started
    while True:
        _, now = await get_json(host, port, "/gc")
        if now["passes"] > before["passes"] and now["running"] is None:
            report: dict[str, Any] = now["last"]
            return report
        await asyncio.sleep(0.1)


async def one_rep(url: str, base: str, args: argparse.Namespace) -> dict[str, Any]:
    procs = [
        BookieProcess(
            os.path.join(base, f"b{i}"),
            bookie_id=f"b{i}",
            extra_args=[
                *("--metadata", url, "--admin-port", "0", "--gc-interval-s", "0"),
                *("--gc-deleted-ledger-grace-s", "0", "--journal-segment-bytes", str(64 * MIB)),
                *("--compaction-rate-bytes-per-s", str(int(args.compaction_mb_s * MIB))),
                *("--log-level", "warning"),
            ],
        )
        for i in range(BOOKIES)
    ]
    try:
        for proc in procs:
            await asyncio.to_thread(proc.start)
        async with metadata.connect(url) as conn:
            ledgers = LedgerManager(conn.store, conn.root)
            return await _measure(procs, args, ledgers, UnderReplicationManager(conn.store, conn.root))
    finally:
        for proc in procs:
            proc.cleanup()


async def _measure(
    procs: list[BookieProcess], args: argparse.Namespace, ledgers: LedgerManager, urm: UnderReplicationManager
) -> dict[str, Any]:
    all_ids = [p.bookie_id for p in procs]
    by_id = {p.bookie_id: p for p in procs}
    writer = _client(procs, ledgers, all_ids[:3])
    started = time.perf_counter()
    try:
        ids = await _write(writer, args)
    finally:
        await writer.close()
    write_s = time.perf_counter() - started
    payload_bytes = args.ledgers * args.entries * args.size

    reader = _client(procs, ledgers, all_ids)
    started = time.perf_counter()
    for ledger_id in ids:
        rh = await reader.open_ledger(ledger_id, password=PASSWORD)
        async for _ in rh.read():
            pass
    read_s = time.perf_counter() - started
    await reader.close()

    # the yardstick of the copy's write side: the replacement's own add rate, same entries, as many
    # in flight as the heal keeps (workers x copy window), one ledger E1 on it
    direct = _client(procs, ledgers, ["b3"])
    try:
        handle = await direct.create_ledger(1, 1, 1, password=PASSWORD)
        payload = os.urandom(args.size)
        in_flight = asyncio.Semaphore(args.workers * args.copy_window)
        added = 0
        started = time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            await in_flight.acquire()
            (await handle.append_async(payload)).add_done_callback(lambda _: in_flight.release())
            added += 1
        for _ in range(args.workers * args.copy_window):
            await in_flight.acquire()
        add_s = time.perf_counter() - started
        await handle.close()
    finally:
        await direct.close()
    replacement_add_mb_s = added * args.size / add_s / 1e6

    survivors = [b for b in all_ids if b != LOST]
    foreground = _client(procs, ledgers, survivors)
    healer = _client(procs, ledgers, survivors)
    try:
        fg = PacedWriter(foreground, args.rate, args.fg_size)
        alone = await fg.window(args.seconds)

        by_id[LOST].kill()  # lost: its copies are gone with it
        config = AutorecoveryConfig(
            passwords=(PASSWORD,), copy_bytes_per_s=args.copy_rate_mb * 1e6, copy_window=args.copy_window
        )
        for ledger_id in ids:
            await urm.mark(ledger_id, [LOST], reason="lost")
        heal: asyncio.Future[ReplicationWorker] = asyncio.ensure_future(
            _heal(healer, urm, config, ids, args.workers)
        )
        started = time.perf_counter()
        during_heal = await fg.window(heal)
        worker = await heal
        heal_s = time.perf_counter() - started

        keep_every = max(1, round(1 / max(1e-9, 1 - args.delete)))  # in every segment, some kept
        dropped = [ledger_id for i, ledger_id in enumerate(ids) if i % keep_every]
        for ledger_id in dropped:
            await ledgers.delete(ledger_id)
        gc: asyncio.Future[dict[str, Any]] = asyncio.ensure_future(_gc_pass(by_id["b0"]))
        during_gc = await fg.window(gc)
        report = await gc
        after = await fg.window(args.seconds)  # alone again, after both
        await fg.close()
    finally:
        await foreground.close()
        await healer.close()
    read_mb_s = payload_bytes / read_s / 1e6
    heal_mb_s = worker.metrics.bytes_copied / heal_s / 1e6
    gc_s = report["finished_at"] - report["started_at"]
    return {
        "shape": f"E{args.ensemble}/Qw{args.qw}/Qa{args.qa} {args.size} B x {args.entries} x {args.ledgers}",
        "payload_mib": round(payload_bytes / MIB, 1),
        "workers": args.workers,
        "copy_window": args.copy_window,
        "copy_rate_limit_mb_s": args.copy_rate_mb,
        "write_mb_s": round(payload_bytes / write_s / 1e6, 1),
        "batch_read_mb_s": round(read_mb_s, 1),
        "heal_s": round(heal_s, 2),
        "heal_mb_s": round(heal_mb_s, 1),
        "heal_over_read": round(heal_mb_s / read_mb_s, 3),
        "replacement_add_mb_s": round(replacement_add_mb_s, 1),
        "heal_over_replacement_add": round(heal_mb_s / replacement_add_mb_s, 3),
        "entries_copied": worker.metrics.entries_copied,
        "fg_p50_ms_alone": _p(alone, 0.5),
        "fg_p99_ms_alone": _p(alone, 0.99),
        "fg_p50_ms_during_heal": _p(during_heal, 0.5),
        "fg_p99_ms_during_heal": _p(during_heal, 0.99),
        "fg_p50_ms_during_compaction": _p(during_gc, 0.5),
        "fg_p99_ms_during_compaction": _p(during_gc, 0.99),
        "fg_p50_ms_alone_after": _p(after, 0.5),
        "fg_p99_ms_alone_after": _p(after, 0.99),
        "fg_adds_during_compaction": len(during_gc),
        "gc_s": round(gc_s, 2),
        "gc_mib_copied": round(report["bytes_copied"] / MIB, 1),
        "gc_copy_mib_s": round(report["bytes_copied"] / MIB / max(gc_s, 1e-9), 1),
        "gc_mib_freed": round(report["bytes_freed"] / MIB, 1),
        "gc_segments_deleted": report["segments_deleted"],
        "gc_error": report["error"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ledgers", type=int, default=16)
    parser.add_argument("--entries", type=int, default=500)
    parser.add_argument("--gib", type=float, default=0.0, help="payload per bookie (sets --entries)")
    parser.add_argument("--size", type=int, default=4096, help="entry payload bytes")
    parser.add_argument("--ensemble", type=int, default=3)
    parser.add_argument("--qw", type=int, default=3)
    parser.add_argument("--qa", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="replication workers (the daemon's default)")
    parser.add_argument("--copy-window", type=int, default=AutorecoveryConfig().copy_window)
    parser.add_argument("--copy-rate-mb", type=float, default=0.0, help="the heal's copy limit (0: none)")
    parser.add_argument("--rate", type=float, default=200.0, help="foreground adds per second")
    parser.add_argument("--fg-size", type=int, default=4096, help="foreground add payload bytes")
    parser.add_argument("--seconds", type=float, default=5.0, help="foreground window alone")
    parser.add_argument(
        "--delete", type=float, default=0.75, help="fraction of the ledgers deleted before GC"
    )
    parser.add_argument(
        "--compaction-mb-s", type=float, default=32.0, help="the bookies' compaction throttle"
    )
    parser.add_argument("--dir", default=None, help="parent of the data dirs (default: system temp)")
    args = parser.parse_args()
    if args.gib:
        args.entries = max(1, round(args.gib * 1024 * MIB / args.size / args.ledgers))
    etcd = EtcdCluster(require_etcd_binary()).start()
    base = tempfile.mkdtemp(prefix="bench-heal-", dir=args.dir)
    runs: list[dict[str, Any]] = []
    try:
        for _ in range(args.reps):
            url = etcd.url(f"/bench/heal-{uuid.uuid4().hex[:8]}")

            async def rep(url: str = url) -> dict[str, Any]:
                async with metadata.connect(url) as conn:
                    await metadata.init_cluster(conn.store, conn.root)
                return await one_rep(url, base, args)

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                result = runner.run(rep())
            print(json.dumps(result), flush=True)
            runs.append(result)
            for child in os.listdir(base):  # the next rep's disk space
                shutil.rmtree(os.path.join(base, child), ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        etcd.stop()
    numeric = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    summary: dict[str, Any] = {key: statistics.median(run[key] for run in runs) for key in numeric}
    summary["machine"] = f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}"
    summary["load_average"] = os.getloadavg()
    summary["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps({"summary": summary, "reps": len(runs), "args": vars(args)}), flush=True)


if __name__ == "__main__":
    main()
