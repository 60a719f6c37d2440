"""Event-loop stalls while a bookie with many ledger records writes index checkpoints.

In one process (uvloop), a real :class:`bookie.storage.Storage` on a temp dir (real journal, real
fsync) gets ``--ledgers`` ledger records, each created by a fence with a master key (what a
recovering client or a squatter sends; ``--entries`` more adds an entry to each), then writes
``--checkpoints`` checkpoints while a probe task sleeps ``--probe-ms`` in a loop and records how
late it wakes up: the loop stall. Between checkpoints ``--dirty`` of the ledgers get a new entry,
so an incremental checkpoint has something to re-encode. Before the checkpoints the probe runs as
long on the idle loop: the baseline in the same run (this machine is shared; only ratios and the
max against the 50 ms target mean anything). Only these checkpoints are written (the storage's own
policy is set out of reach). Then the storage is closed and opened again in a fresh process, as a
restart from the final checkpoint: how long the open takes, the longest stall meanwhile (the probe
runs on the loop while the recovery thread decodes the checkpoint: its GIL holds count), the RSS per
ledger record of the restarted process, and its first checkpoint. The RSS per ledger record is also
given for the filling process (after the fill, against before it: those records also cache their
checkpoint rows).

    python -m benchmarks.checkpoint_stall                     # 200k ledgers, 3 checkpoints
    python -m benchmarks.checkpoint_stall --ledgers 1000000
    python -m benchmarks.checkpoint_stall --reopen DATA_DIR   # the restart alone (what the above runs)

Prints one JSON line per checkpoint and a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import uvloop

from bookie.storage import AddBatch, Storage, StorageConfig
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.digest import EntryCodec

KEY = b"K" * 32
CODEC = EntryCodec("crc32c")
BATCH = 5_000
"""Ledgers created (or entries added) per loop pass while filling: the journal groups them."""


class _Probe:
    """Sleeps ``period_s`` in a loop; keeps how late each wake-up was, and the longest pause of
    Python's cyclic garbage collector meanwhile (a stall the checkpoint may only have triggered)."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.lags_ms: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._gc_started = 0.0
        self.gc_ms_max = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_ms_max = max(self.gc_ms_max, (time.perf_counter() - self._gc_started) * 1000)

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lags_ms.append((time.perf_counter() - started - self.period_s) * 1000)

    def start(self) -> None:
        self.lags_ms = []
        self.gc_ms_max = 0.0
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> dict[str, float]:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        lags = sorted(self.lags_ms) or [0.0]
        return {
            "stall_ms_max": round(lags[-1], 2),
            "stall_ms_p99": round(lags[int(len(lags) * 0.99) - 1 if len(lags) > 1 else 0], 2),
            "wakeups": len(lags),
            "gc_pause_ms_max": round(self.gc_ms_max, 2),
        }


class _Done(AddBatch):
    __slots__ = ()
    failed = 0

    def on_error(self, request_id: int, error: BaseException) -> None:
        _Done.failed += 1

    def on_durable(self, error: BaseException | None) -> None:
        if error is not None:
            _Done.failed += 1


async def _durable(storage: Storage) -> None:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    storage.force(lambda error: done.set_result(None) if error is None else done.set_exception(error))
    await done


async def fill(storage: Storage, ledgers: int, entry_id: int, ids: range | list[int]) -> None:
    """Fence ledgers ``ids`` into existence (``entry_id`` < 0), or add entry ``entry_id`` to each."""
    ids = list(ids)
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]
        if entry_id < 0:
            for lid in chunk:
                storage.fence(lid, KEY, lambda _error: None)
        else:
            requests = m.AddRequests()
            for lid in chunk:
                body = CODEC.encode(lid, entry_id, entry_id - 1, 0, b"x" * 64)
                requests.append(m.AddEntryRequest(lid, lid, entry_id, 1, KEY, body))  # recovery add: fenced
            storage.add_run(requests, None, _Done)
        await _durable(storage)
    if _Done.failed:
        raise RuntimeError(f"{_Done.failed} adds failed while filling")


async def run(args: argparse.Namespace) -> None:
    base = tempfile.mkdtemp(prefix="bk-ckpt-", dir=args.dir)
    try:
        config = StorageConfig(
            data_dir=os.path.join(base, "bookie"),
            bookie_id="b0",
            checkpoint_interval_s=3600,
            checkpoint_journal_bytes=1 << 62,  # only the checkpoints measured here
            checkpoint_journal_records=1 << 62,
        )
        storage = await Storage.open(config)
        gc.collect()
        rss_before = _rss_bytes()
        started = time.perf_counter()
        await fill(storage, args.ledgers, -1, range(1, args.ledgers + 1))
        for entry_id in range(args.entries):
            await fill(storage, args.ledgers, entry_id, range(1, args.ledgers + 1))
        fill_s = time.perf_counter() - started
        gc.collect()
        rss_per_ledger = (_rss_bytes() - rss_before) / args.ledgers
        probe = _Probe(args.probe_ms / 1000)
        probe.start()
        await asyncio.sleep(args.idle_s)
        baseline = await probe.stop()
        print(json.dumps({"phase": "idle", **baseline}), flush=True)
        rows = []
        dirty_n = int(args.ledgers * args.dirty)
        for n in range(args.checkpoints):
            if n and dirty_n:  # touch some ledgers: an incremental checkpoint re-encodes these only
                first = 1 + (n * dirty_n) % args.ledgers
                touched = [1 + (first + i) % args.ledgers for i in range(dirty_n)]
                await fill(storage, args.ledgers, args.entries + n - 1, touched)
            probe.start()
            await asyncio.sleep(args.probe_ms * 3 / 1000)  # the probe is asleep when the checkpoint starts
            t0 = time.perf_counter()
            await storage.write_checkpoint()
            wall_s = time.perf_counter() - t0
            await asyncio.sleep(args.probe_ms * 3 / 1000)
            stalls = await probe.stop()
            size = os.path.getsize(os.path.join(base, "bookie", "index", "checkpoint"))  # noqa: ASYNC240
            row = {"checkpoint": n, "wall_s": round(wall_s, 3), "bytes": size, **stalls}
            rows.append(row)
            print(json.dumps(row), flush=True)
        await storage.close()
        restart = await _restart_elsewhere(config.data_dir, args)
        print(json.dumps({"phase": "restart", **restart}), flush=True)
        summary: dict[str, Any] = {
            "summary": True,
            "ledgers": args.ledgers,
            "entries_per_ledger": args.entries,
            "dirty_fraction": args.dirty,
            "fill_s": round(fill_s, 1),
            "idle_stall_ms_max": baseline["stall_ms_max"],
            "checkpoint_stall_ms_max": max(r["stall_ms_max"] for r in rows),
            "checkpoint_stall_ms_max_median": statistics.median(r["stall_ms_max"] for r in rows),
            "checkpoint_wall_s_median": statistics.median(r["wall_s"] for r in rows),
            "stall_ratio_vs_idle": round(
                statistics.median(r["stall_ms_max"] for r in rows) / max(baseline["stall_ms_max"], 0.01), 1
            ),
            "rss_bytes_per_ledger": round(rss_per_ledger),
            "restart_open_s": restart["open_s"],
            "restart_stall_ms_max": restart["stall_ms_max"],
            "restart_rss_bytes_per_ledger": restart["rss_bytes_per_ledger"],
            "restart_first_checkpoint_s": restart["first_checkpoint_s"],
            "restart_first_checkpoint_stall_ms_max": restart["first_checkpoint"]["stall_ms_max"],
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
        print(json.dumps(summary), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def _restart_elsewhere(data_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`reopen` in a fresh process (its RSS is the restarted bookie's, nothing else's)."""
    command = [sys.executable, "-m", "benchmarks.checkpoint_stall", "--reopen", data_dir]
    command += ["--probe-ms", str(args.probe_ms)]
    child = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    out, _ = await child.communicate()
    if child.returncode:
        raise RuntimeError(f"the restart exited {child.returncode}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def reopen(data_dir: str, probe_ms: float) -> dict[str, Any]:
    """Open the storage at ``data_dir`` (a restart) with the probe on: open time, stalls, RSS per
    ledger record, then one checkpoint (the first after a start)."""
    config = StorageConfig(
        data_dir=data_dir,
        bookie_id="b0",
        checkpoint_interval_s=3600,
        checkpoint_journal_bytes=1 << 62,
        checkpoint_journal_records=1 << 62,
    )
    probe = _Probe(probe_ms / 1000)
    await asyncio.sleep(0.2)  # the loop idle, everything imported
    rss_before = _rss_bytes()
    probe.start()
    t0 = time.perf_counter()
    storage = await Storage.open(config)
    open_s = time.perf_counter() - t0
    await asyncio.sleep(probe_ms * 3 / 1000)
    opened = await probe.stop()
    ledgers = len(storage.ledgers)
    rss_per_ledger = (_rss_bytes() - rss_before) / max(ledgers, 1)
    probe.start()
    t0 = time.perf_counter()
    await storage.write_checkpoint()
    first_checkpoint_s = time.perf_counter() - t0
    await asyncio.sleep(probe_ms * 3 / 1000)
    first_checkpoint = await probe.stop()
    await storage.close()
    return {
        "ledgers": ledgers,
        "open_s": round(open_s, 3),
        **opened,
        "rss_bytes_per_ledger": round(rss_per_ledger),
        "first_checkpoint_s": round(first_checkpoint_s, 3),
        "first_checkpoint": first_checkpoint,
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--ledgers", type=int, default=200_000)
    parser.add_argument("--entries", type=int, default=0, help="entries added to every ledger (default 0)")
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument(
        "--dirty", type=float, default=0.01, help="fraction of ledgers touched between checkpoints"
    )
    parser.add_argument("--probe-ms", type=float, default=5.0)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="where the temp data dir goes (default: the system's)")
    parser.add_argument("--reopen", metavar="DATA_DIR", help="only open this bookie data dir (a restart)")
    args = parser.parse_args()
    if args.reopen:
        print(json.dumps(uvloop.run(reopen(args.reopen, args.probe_ms))), flush=True)
        return
    uvloop.run(run(args))


if __name__ == "__main__":
    main()
