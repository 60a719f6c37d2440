"""Bookie add-path benchmark: one bookie process, one client process, fsync on.

Closed loop (``--window`` adds in flight, max throughput) and open loop (``--rate`` adds/s, latency),
for each ``--size``; also the CPU the bookie and the client process spent per entry. With
``--bound`` it also runs the no-logic yardstick (``shared/tools/replication_bound.py --bookies 1
--qw 1 --qa 1``) interleaved with ours, rep by rep, and reports ours / bound. Prints one JSON
line per run and a final JSON summary (medians over ``--reps``).

    python -m benchmarks.bookie_add                      # 1 KiB + 100 B, window 1000, and 5k/s
    python -m benchmarks.bookie_add --sizes 1024 --reps 5 --bound
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import uvloop

from bookkeeper_aio.cli.bench import stats
from bookkeeper_aio.protocol.codes import OpCode
from bookkeeper_aio.protocol.digest import EntryCodec
from bookkeeper_aio.protocol.framing import LENGTH, FrameDecoder

KEY = b"B" * 32
ADD = int(OpCode.ADD_ENTRY)
packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack
BOUND_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "tools" / "replication_bound.py"


class Client(asyncio.Protocol):
    """Pipelined adds over one connection, writes coalesced per tick (as a real client does)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.decoder = FrameDecoder()
        self.pending: dict[int, tuple[asyncio.Future[int], float]] = {}
        self.out: list[bytes] = []
        self.scheduled = False
        self.latencies: list[float] = []
        self.errors = 0
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        import socket

        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.decoder.feed(data)
        now = time.perf_counter()
        while (frame := self.decoder.next_frame()) is not None:
            # [op, request_id, status, ...]: the client side is kept lean so the bookie is measured.
            response = msgpack.unpackb(frame)
            future, started = self.pending.pop(response[1])
            if response[2] != 0:
                self.errors += 1
            self.latencies.append(now - started)
            future.set_result(response[2])

    def add(self, request_id: int, frame: bytes) -> asyncio.Future[int]:
        future: asyncio.Future[int] = self.loop.create_future()
        self.pending[request_id] = (future, time.perf_counter())
        self.out.append(frame)
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._flush)
        return future

    def _flush(self) -> None:
        self.scheduled = False
        out, self.out = self.out, []
        self.transport.write(b"".join(out))


async def drive(
    port: int, size: int, window: int, secs: float, rate: float, ledger_id: int
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(Client, "127.0.0.1", port)
    codec = EntryCodec("crc32c")
    payload = os.urandom(size)
    next_id = [0]

    def add() -> asyncio.Future[int]:
        entry_id = next_id[0]
        next_id[0] += 1
        body = codec.encode(ledger_id, entry_id, entry_id - 1, 0, payload)
        packed = packb((ADD, entry_id, ledger_id, entry_id, 0, KEY, body))  # == m.encode(AddEntryRequest)
        return client.add(entry_id, LENGTH.pack(len(packed)) + packed)

    started = time.perf_counter()
    deadline = started + secs
    if rate:
        futures: list[asyncio.Future[int]] = []
        while (now := time.perf_counter()) < deadline:
            due = int((now - started) * rate)
            while next_id[0] < due:
                futures.append(add())
            await asyncio.sleep(0.001)
        await asyncio.gather(*futures)
    else:

        async def worker() -> None:
            while time.perf_counter() < deadline:
                await add()

        await asyncio.gather(*(worker() for _ in range(window)))
    elapsed = time.perf_counter() - started
    client.transport.close()
    lat = sorted(client.latencies)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(len(lat) * q))] * 1e3

    return {
        "entries_s": len(lat) / elapsed,
        "MB_s": len(lat) * size / elapsed / 1e6,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "errors": client.errors,
    }


def start_bookie(data_dir: str) -> tuple[subprocess.Popen[bytes], int]:
    cmd = [sys.executable, "-m", "bookie", "--data-dir", data_dir, "--port", "0", "--bookie-id", "bench"]
    if os.environ.get("BENCH_BOOKIE_SCRIPT"):  # profiling hook: run the bookie through a wrapper
        cmd[1:3] = [os.environ["BENCH_BOOKIE_SCRIPT"]]
    env = {**os.environ, "BKAIO_BOOKIE_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"bookie did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """(event-loop thread, every other thread: the journal writer and idle pools) CPU seconds."""
    cpu = stats.thread_cpu_s(pid)
    assert cpu is not None, "needs Linux /proc"
    return cpu


def one_run(size: int, window: int, secs: float, rate: float, parent: str | None) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="bookie-bench-", dir=parent)
    proc, port = start_bookie(os.path.join(base, "data"))
    try:
        bookie_cpu0, client_cpu0 = process_cpu_s(proc.pid), time.process_time()
        loop_cpu0, other_cpu0 = thread_cpu_s(proc.pid)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(drive(port, size, window, secs, rate, ledger_id=1))
        entries = result["entries_s"] * secs
        result["bookie_cpu_us_per_entry"] = (process_cpu_s(proc.pid) - bookie_cpu0) / entries * 1e6
        loop_cpu1, other_cpu1 = thread_cpu_s(proc.pid)
        result["bookie_loop_cpu_us_per_entry"] = (loop_cpu1 - loop_cpu0) / entries * 1e6
        result["bookie_writer_cpu_us_per_entry"] = (other_cpu1 - other_cpu0) / entries * 1e6
        result["client_cpu_us_per_entry"] = (time.process_time() - client_cpu0) / entries * 1e6
        return result
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def run_bound(size: int, window: int, secs: float, rate: float, reps: int) -> dict[str, Any]:
    cmd = [sys.executable, str(BOUND_SCRIPT), "--bookies", "1", "--qw", "1", "--qa", "1", "--size", str(size),
           "--window", str(window), "--secs", str(secs), "--reps", str(reps)]  # fmt: skip
    if rate:
        cmd += ["--rate", str(rate)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()
    return {"runs": [json.loads(line) for line in out[:-1]], "median": json.loads(out[-1])["median"]}


def median_of(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,100", help="entry payload sizes in bytes, comma-separated")
    ap.add_argument("--window", type=int, default=1000, help="adds in flight (closed loop)")
    ap.add_argument("--rate", type=float, default=5000.0, help="open-loop rate in adds/s (0: skip)")
    ap.add_argument("--secs", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bound", action="store_true", help="also run the yardstick and report ratios")
    ap.add_argument("--dir", default=None, help="parent directory for data dirs (default: system temp)")
    args = ap.parse_args()
    summary: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "config": vars(args),
        "results": [],
    }
    scenarios = [("closed", int(s), 0.0) for s in args.sizes.split(",")]
    if args.rate:
        scenarios.append(("rate", 1024, args.rate))
    for mode, size, rate in scenarios:
        runs, bounds = [], []
        for _ in range(args.reps):  # interleaved with the yardstick: the machine drifts between runs
            runs.append(one_run(size, args.window, args.secs, rate, args.dir))
            print(json.dumps({"mode": mode, "size": size, **{k: round(v, 3) for k, v in runs[-1].items()}}))
            if args.bound:
                bounds.append(run_bound(size, args.window, args.secs, rate, 1)["median"])
                print(json.dumps({"mode": mode, "size": size, "bound": bounds[-1]}), flush=True)
        result: dict[str, Any] = {"mode": mode, "size": size, "rate": rate, "median": median_of(runs)}
        if bounds:
            result["bound_median"] = median_of(bounds)
            ratios = [r["entries_s"] / b["entries_s"] for r, b in zip(runs, bounds, strict=True)]
            result["ratio_entries_s_median"] = round(statistics.median(ratios), 3)
            result["ratio_of_medians"] = round(
                result["median"]["entries_s"] / result["bound_median"]["entries_s"], 3
            )
        summary["results"].append(result)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
