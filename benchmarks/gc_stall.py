"""Event-loop stalls during a bookie GC pass over many ledgers (the metadata steps).

In one process (uvloop): a real :class:`bookie.storage.Storage` (real journal, fsync on) holds
``--ledgers`` ledger records (each made by a fence with a key, as :mod:`benchmarks.checkpoint_stall`
fills it); an in-memory metadata store lists all of them but ``--deleted`` of them (deleted from
metadata: the deleted-ledger step collects those), ``--over-replicated`` of the rest name this
bookie as replaced in a closed ledger placed elsewhere, and ``--orphans`` are closed ledgers placed
elsewhere that never named it (a copy whose heal failed): the over-replicated check collects both.
The other ledgers are closed ledgers on this bookie and two others. The in-memory store yields to
the loop on every call, as a network client does, but costs no round trip: what is measured is the
pass's own work on the event loop. Then one GC pass runs (grace periods 0, so both steps collect in
it; compaction off) while a probe task sleeps ``--probe-ms`` in a loop and records how late it
wakes: the longest stall is the longest hold of the loop. On a shared machine a stall may also be
the process waiting for a core, so the probe also records the event-loop thread's own CPU time
between two wake-ups, and gives as ``own_stall_ms`` the part of each stall that CPU can explain
(the smaller of the two): a stall of 150 ms during which the loop ran 10 ms of CPU was a wait for
a core, not a hold. The probe first runs as long on the idle loop: the baseline of the same run.

    python -m benchmarks.gc_stall                       # 200k ledgers
    python -m benchmarks.gc_stall --ledgers 1000000 --dir /dev/shm

Prints the idle baseline and one summary line (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
from typing import Any

import uvloop

import metadata
from benchmarks.checkpoint_stall import _Probe, fill
from bookie.gc import GarbageCollector, GcConfig, MetadataCatalog
from bookie.storage import Storage, StorageConfig
from metadata.ledger_metadata import LedgerMetadata, LedgerState, ReplacedBookie
from metadata.ledger_metadata import encode as encode_metadata

ME = "bookie-gc-bench-0"
OTHERS = ("bookie-gc-bench-1", "bookie-gc-bench-2", "bookie-gc-bench-3")
ROOT = "/gc-bench"
CLUSTER = "gc-bench"
"""The cluster the bench bookie's data belongs to (the catalog checks the root still holds it)."""


class _CpuProbe(_Probe):
    """:class:`_Probe`, plus the part of each stall the loop thread's own CPU time explains."""

    async def _run(self) -> None:
        self.own_ms: list[float] = []
        while True:
            started, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(self.period_s)
            lag_ms = (time.perf_counter() - started - self.period_s) * 1000
            self.lags_ms.append(lag_ms)
            self.own_ms.append(min(lag_ms, (time.thread_time() - cpu) * 1000))

    async def stop(self) -> dict[str, float]:
        out = await super().stop()
        own = sorted(self.own_ms) or [0.0]
        return {
            **out,
            "own_stall_ms_max": round(own[-1], 2),
            "own_stall_ms_p99": round(own[int(len(own) * 0.99)], 2),
        }


class _Connection:
    """What :class:`MetadataCatalog` connects to: the store and the cluster's root."""

    def __init__(self, store: metadata.MetadataStore, root: str) -> None:
        self.store, self.root = store, root

    async def close(self) -> None:
        pass


def _metadata(ledger_id: int, over_replicated: bool, orphan: bool = False) -> bytes:
    elsewhere = over_replicated or orphan
    ensemble = [OTHERS[0], OTHERS[1], OTHERS[2]] if elsewhere else [ME, OTHERS[0], OTHERS[1]]
    md = LedgerMetadata.new(ledger_id, ensemble, write_quorum=2, ack_quorum=2, ctime_ms=1)
    replaced = (ReplacedBookie(0, ME, OTHERS[2], 1),) if over_replicated else ()
    return encode_metadata(
        LedgerMetadata(
            ledger_id=ledger_id,
            ensemble_size=3,
            write_quorum=2,
            ack_quorum=2,
            state=LedgerState.CLOSED,
            ensembles=md.ensembles,
            last_entry_id=-1,
            ctime_ms=1,
            replaced_bookies=replaced,
        )
    )


async def _fill_metadata(store: metadata.MetadataStore, args: argparse.Namespace) -> tuple[int, int, int]:
    """Create the listed ledgers' metadata (ids in increasing order); returns (deleted,
    over-replicated, orphans)."""
    await metadata.init_cluster(store, ROOT, instance_id=CLUSTER)
    manager = metadata.LedgerManager(store, ROOT)
    deleted_every = round(1 / args.deleted) if args.deleted else 0
    over_every = round(1 / args.over_replicated) if args.over_replicated else 0
    orphan_every = round(1 / args.orphans) if args.orphans else 0
    deleted = over = orphans = 0
    for ledger_id in range(1, args.ledgers + 1):
        if deleted_every and ledger_id % deleted_every == 0:
            deleted += 1
            continue
        is_over = bool(over_every) and ledger_id % over_every == 1
        is_orphan = not is_over and bool(orphan_every) and ledger_id % orphan_every == 3
        over += is_over
        orphans += is_orphan
        await store.create(manager.keys.ledger(ledger_id), _metadata(ledger_id, is_over, is_orphan))
    await store.put(manager.keys.idgen, str(args.ledgers + 1).encode())
    return deleted, over, orphans


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="bk-gc-stall-", dir=args.dir)
    try:
        config = StorageConfig(
            data_dir=os.path.join(base, "bookie"),
            bookie_id=ME,
            checkpoint_interval_s=3600,
            checkpoint_journal_bytes=1 << 62,  # only the checkpoints the pass writes
            checkpoint_journal_records=1 << 62,
        )
        storage = await Storage.open(config)
        started = time.perf_counter()
        await fill(storage, args.ledgers, -1, range(1, args.ledgers + 1))
        store = metadata.MemoryStore()
        deleted, over, orphans = await _fill_metadata(store, args)
        fill_s = time.perf_counter() - started
        catalog = MetadataCatalog(
            f"memory://{ROOT}", connect=lambda url: _Connection(store, ROOT), cluster_id=lambda: CLUSTER
        )
        collector = GarbageCollector(
            storage,
            GcConfig(
                interval_s=0,
                deleted_ledger_grace_s=0.0,
                future_ledger_grace_s=0.0,
                compaction_threshold=0.0,
                compaction_roll_dead_bytes=0,
                over_replicated_interval_s=1.0,
            ),
            catalog,
            replicas=catalog,
            bookie_id=ME,
        )
        probe = _CpuProbe(args.probe_ms / 1000)
        probe.start()
        await asyncio.sleep(args.idle_s)
        idle = await probe.stop()
        print(json.dumps({"phase": "idle", **idle}), flush=True)
        probe.start()
        await asyncio.sleep(args.probe_ms * 3 / 1000)
        t0 = time.perf_counter()
        report = await collector.run_once("bench")
        pass_s = time.perf_counter() - t0
        await asyncio.sleep(args.probe_ms * 3 / 1000)
        stalls = await probe.stop()
        await collector.close()
        await storage.close()
        if report.error is not None:
            raise RuntimeError(f"the GC pass failed: {report.error}")
        return {
            "summary": True,
            "ledgers": args.ledgers,
            "deleted_in_metadata": deleted,
            "over_replicated_in_metadata": over,
            "orphans_in_metadata": orphans,
            "ledgers_collected": report.ledgers_collected,
            "over_replicated_collected": report.over_replicated_collected,
            "orphans_collected": report.orphans_collected,
            "replicas_checked": report.replicas_checked,
            "fill_s": round(fill_s, 1),
            "pass_s": round(pass_s, 2),
            "idle_stall_ms_max": idle["stall_ms_max"],
            "pass_stall_ms_max": stalls["stall_ms_max"],
            "pass_stall_ms_p99": stalls["stall_ms_p99"],
            "pass_own_stall_ms_max": stalls["own_stall_ms_max"],
            "pass_own_stall_ms_p99": stalls["own_stall_ms_p99"],
            "idle_own_stall_ms_max": idle["own_stall_ms_max"],
            "gc_pause_ms_max": stalls["gc_pause_ms_max"],
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--ledgers", type=int, default=200_000)
    parser.add_argument("--deleted", type=float, default=0.1, help="fraction deleted from metadata")
    parser.add_argument("--over-replicated", type=float, default=0.01, help="fraction placed elsewhere")
    parser.add_argument("--orphans", type=float, default=0.0, help="fraction never placed here")
    parser.add_argument("--probe-ms", type=float, default=5.0)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="parent of the data dir (default: system temp)")
    args = parser.parse_args()
    print(json.dumps(uvloop.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
