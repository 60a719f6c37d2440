"""Client write-path benchmark: real bookie processes, the real client, fsync on.

Shape (issue 4): 3 bookies, E3/Qw2/Qa2, 1 KiB entries, one client process, 1,000 adds in flight
(closed loop: max throughput), then a fixed-rate open loop (``--rate``, default 5,000/s) for
latency. With ``--bound`` the no-logic yardstick ``shared/tools/replication_bound.py`` runs in the
same session with the same shape and the report gives ours / bound.

Latencies are recorded in an HdrHistogram (microseconds, 3 significant digits). Prints one JSON line
per run and a final JSON summary (medians over ``--reps``); ``--json-out`` also writes the summary,
``--png`` a latency histogram of the fixed-rate runs.

    python -m benchmarks.write                       # ours only
    python -m benchmarks.write --bound --reps 3      # ours and the bound, interleaved
    python -m benchmarks.write --tls --reps 3        # ours in plaintext and over TLS, interleaved

With ``--tls`` every pass also runs with TLS on the bookie port (a throwaway CA from trustme; the
client verifies the certificate and host name) and the report gives tls / plaintext ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import trustme
import uvloop
from hdrh.histogram import HdrHistogram

from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.cli.bench import load, stats
from bookkeeper_aio.client.bookie_client import StaticResolver
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore
from tests.harness.admin_http import get_json
from tests.harness.bookie_proc import BookieProcess
from tests.harness.tls import issue

BOUND_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "tools" / "replication_bound.py"
LATENCY_US_MAX = stats.LATENCY_US_MAX


async def drive(
    procs: list[BookieProcess], args: argparse.Namespace, rate: float, ca_file: str | None = None
) -> dict[str, Any]:
    resolver = StaticResolver({p.bookie_id: p.address for p in procs})
    tls: dict[str, Any] = {} if ca_file is None else {"tls_enabled": True, "tls_ca_file": ca_file}
    config = ClientConfig.load(add_window_max=max(args.window, 1), **tls)  # BKAIO_CLIENT_* env applies
    bk = BookKeeper(
        LedgerManager(MemoryStore(), "/bench"),
        StaticDirectory([p.bookie_id for p in procs]),
        config=config,
        resolver=resolver,
    )
    lh = await bk.create_ledger(args.ensemble, args.qw, args.qa, password=b"bench")
    await lh.append(b"warm-up")  # connections established before the clock starts
    payload = os.urandom(args.size)
    bookie_cpu0 = [_thread_cpu_s(p) for p in procs]
    journal0 = [await _journal_state(p) for p in procs]
    # The load loop of `bkaio bench`: closed loop, or open loop measured from the timer tick that
    # sent each add, as replication_bound.py measures its own (a like-for-like latency ratio)
    span = load.Span(load.clock(), 0.0, args.secs)
    submit = functools.partial(lh.append_async, payload)
    nowait = functools.partial(lh.append_nowait, payload)  # a plain call, as the bound's client adds
    result = await load.drive(
        [submit], span, window=args.window, rate=rate, latency_from="send", nowait=[nowait]
    )
    count = result.acked
    hist = result.histogram()
    bookie_cpu = [
        tuple(b - a for a, b in zip(before, _thread_cpu_s(p), strict=True))
        for p, before in zip(procs, bookie_cpu0, strict=True)
    ]
    journal = [await _journal_state(p) for p in procs]
    groups = sum(after["groups"] - before["groups"] for before, after in zip(journal0, journal, strict=True))
    records = sum(
        after["records"] - before["records"] for before, after in zip(journal0, journal, strict=True)
    )
    fsync_s = sum(
        after["fsync_seconds_sum"] - before["fsync_seconds_sum"]
        for before, after in zip(journal0, journal, strict=True)
    )
    fsyncs = sum(
        after["fsync_count"] - before["fsync_count"] for before, after in zip(journal0, journal, strict=True)
    )
    await lh.close()
    await bk.close()
    return {
        "entries_s": count / args.secs,
        "MB_s": count * args.size / args.secs / 1e6,
        "p50_ms": hist.get_value_at_percentile(50) / 1e3,
        "p99_ms": hist.get_value_at_percentile(99) / 1e3,
        "p999_ms": hist.get_value_at_percentile(99.9) / 1e3,
        "ensemble_changes": lh.ensemble_changes,
        "client_cpu_us_per_entry": result.cpu_s / max(count, 1) * 1e6,
        "bookies_cpu_us_per_entry": sum(loop + other for loop, other in bookie_cpu) / max(count, 1) * 1e6,
        "bookies_loop_cpu_us_per_entry": sum(loop for loop, _ in bookie_cpu) / max(count, 1) * 1e6,
        "bookies_writer_cpu_us_per_entry": sum(other for _, other in bookie_cpu) / max(count, 1) * 1e6,
        "entries_per_group": records / max(groups, 1),
        "fsync_ms": fsync_s / max(fsyncs, 1) * 1e3,
        "_hist": hist,
    }


def _thread_cpu_s(proc: BookieProcess) -> tuple[float, float]:
    """(event-loop thread, every other thread: the journal writer) CPU seconds of a bookie (Linux /proc)."""
    assert proc.proc is not None
    cpu = stats.thread_cpu_s(proc.proc.pid)
    assert cpu is not None, "needs Linux /proc"
    return cpu


async def _journal_state(proc: BookieProcess) -> dict[str, Any]:
    status, state = await get_json(*proc.admin_address(), "/state")
    assert status == 200, state
    journal: dict[str, Any] = state["journal"]
    return journal


def one_run(args: argparse.Namespace, rate: float, tls: bool = False) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="bench-write-", dir=args.dir)
    extra = ["--admin-port", "0"]
    ca_file = None
    if tls:
        files = issue(trustme.CA(), Path(base) / "certs", "bookie", "127.0.0.1")
        extra += ["--tls-cert-file", files.cert, "--tls-key-file", files.key]
        ca_file = files.ca
    procs = [
        BookieProcess(os.path.join(base, f"b{i}"), bookie_id=f"b{i}", extra_args=extra)
        for i in range(args.bookies)
    ]
    try:
        for proc in procs:
            proc.start()
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(drive(procs, args, rate, ca_file))
    finally:
        for proc in procs:
            proc.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def run_bound(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    cmd = [
        sys.executable, str(BOUND_SCRIPT), "--bookies", str(args.bookies), "--qw", str(args.qw),
        "--qa", str(args.qa), "--size", str(args.size), "--window", str(args.window),
        "--secs", str(args.secs), "--reps", "1",
    ]  # fmt: skip
    if rate:
        cmd += ["--rate", str(rate)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    result: dict[str, Any] = json.loads(out[-1])["median"]
    return result


def median_of(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k in runs[0] if not k.startswith("_")]
    return {k: round(statistics.median(float(r[k]) for r in runs), 3) for k in keys}


def write_png(path: str, hist: HdrHistogram, width: int = 640, height: int = 240) -> None:
    """A latency histogram (log-spaced buckets from 0.1 ms to 100 ms) as a dependency-free PNG."""
    edges = [0.1 * (10 ** (i / 20)) for i in range(61)]  # ms, 20 buckets per decade
    counts = [_count_between(hist, low * 1e3, high * 1e3) for low, high in itertools.pairwise(edges)]
    peak = max(counts) or 1
    bar_w = width // len(counts)
    rows = []
    for y in range(height):
        row = bytearray(b"\x00")  # filter type 0
        level = (height - y) / height
        for count in counts:
            filled = count / peak >= level
            pixel = b"\x30\x60\xc0" if filled else b"\xff\xff\xff"
            row += pixel * bar_w
        row += b"\xff\xff\xff" * (width - bar_w * len(counts))
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(b"".join(rows), 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)


def _count_between(hist: HdrHistogram, low_us: float, high_us: float) -> int:
    total = 0
    for item in hist.get_recorded_iterator():
        if low_us <= item.value_iterated_to < high_us:
            total += item.count_added_in_this_iter_step
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bookies", type=int, default=3)
    ap.add_argument("--ensemble", type=int, default=3)
    ap.add_argument("--qw", type=int, default=2)
    ap.add_argument("--qa", type=int, default=2)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--secs", type=float, default=8.0)
    ap.add_argument("--rate", type=float, default=5000.0, help="fixed-rate pass (entries/s); 0 skips it")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bound", action="store_true", help="also run replication_bound.py (same shape)")
    ap.add_argument("--tls", action="store_true", help="also run ours with TLS on the bookie port")
    ap.add_argument("--dir", default=None, help="parent directory for bookie data (default: system temp)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--png", default=None, help="latency histogram of the fixed-rate runs")
    args = ap.parse_args()
    passes = [("closed", 0.0)] + ([("rate", args.rate)] if args.rate else [])
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for rep in range(args.reps):
        for name, rate in passes:
            by_who = results.setdefault(name, {})
            # With --bound the order alternates rep by rep (ours first, then the bound first), so
            # neither side always runs on the machine the other just warmed or loaded.
            order = ["ours"] + (["ours_tls"] if args.tls else []) + (["bound"] if args.bound else [])
            if rep % 2:
                order.reverse()
            for who in order:
                if who in ("ours", "ours_tls"):
                    run = one_run(args, rate, tls=who == "ours_tls")
                    shown = {k: round(v, 3) for k, v in run.items() if k[0] != "_"}
                    line = {"pass": name, "who": who, **shown}
                else:
                    run = run_bound(args, rate)
                    line = {"pass": name, "who": who, **run}
                by_who.setdefault(who, []).append(run)
                print(json.dumps(line), flush=True)
    summary: dict[str, Any] = {"config": vars(args)}
    for name, by_who in results.items():
        summary[name] = {who: median_of(runs) for who, runs in by_who.items()}
        if "bound" in by_who:
            ours_m, bound_m = summary[name]["ours"], summary[name]["bound"]
            summary[name]["ours_over_bound"] = {
                "throughput": round(ours_m["entries_s"] / bound_m["entries_s"], 3),
                # the same ratio rep by rep (each pair ran back to back), then its median
                "throughput_median_of_reps": round(
                    statistics.median(
                        o["entries_s"] / b["entries_s"]
                        for o, b in zip(by_who["ours"], by_who["bound"], strict=True)
                    ),
                    3,
                ),
                "p50": round(ours_m["p50_ms"] / bound_m["p50_ms"], 3),
                "p99": round(ours_m["p99_ms"] / bound_m["p99_ms"], 3),
            }
        if "ours_tls" in by_who:
            plain_m, tls_m = summary[name]["ours"], summary[name]["ours_tls"]
            summary[name]["tls_over_plaintext"] = {
                "throughput": round(tls_m["entries_s"] / plain_m["entries_s"], 3),
                "throughput_median_of_reps": round(
                    statistics.median(
                        t["entries_s"] / p["entries_s"]
                        for t, p in zip(by_who["ours_tls"], by_who["ours"], strict=True)
                    ),
                    3,
                ),
                "p50": round(tls_m["p50_ms"] / plain_m["p50_ms"], 3),
                "p99": round(tls_m["p99_ms"] / plain_m["p99_ms"], 3),
                "client_cpu": round(tls_m["client_cpu_us_per_entry"] / plain_m["client_cpu_us_per_entry"], 3),
                "bookies_loop_cpu": round(
                    tls_m["bookies_loop_cpu_us_per_entry"] / plain_m["bookies_loop_cpu_us_per_entry"], 3
                ),
            }
    print(json.dumps(summary), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n")
    if args.png and "rate" in results:
        merged = HdrHistogram(1, LATENCY_US_MAX, 3)
        for run in results["rate"]["ours"]:
            merged.add(run["_hist"])
        write_png(args.png, merged)


if __name__ == "__main__":
    main()
