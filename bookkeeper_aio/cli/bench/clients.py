"""The parent side of a load run: start the client processes (:mod:`bookkeeper_aio.cli.bench.worker`),
wait until every one is ready, give them one shared start instant, show the live progress, read
the bookies at both ends of the measured span, and merge what the processes measured.

Every client process is killed on the way out, whatever happened (no orphan keeps loading the
cluster after a Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bookkeeper_aio.cli.bench.errors import BenchFailed
from bookkeeper_aio.cli.bench.live import LiveLine
from bookkeeper_aio.cli.bench.load import Span, clock
from bookkeeper_aio.cli.bench.stats import latency_ms, merge

READY_TIMEOUT_S = 60.0
"""Connecting, creating the ledgers and writing one entry each: minutes would mean a sick cluster
(plus :data:`READY_S_PER_LEDGER` for each ledger of a process)."""
READY_S_PER_LEDGER = 0.02
"""Ten processes creating 100,000 ledgers each share one etcd: on a 2-core machine about 1,000
creates a second in all, so 0.01 s per ledger of each process was too short for a million."""
START_DELAY_S = 0.3
"""The shared start is this far ahead of the go line, so every process is waiting when it comes."""
DRAIN_TIMEOUT_S = 60.0
"""After the measured span: the adds still in flight must be answered (or time out) within this."""
STOP_GRACE_S = 10.0
"""A client process told to stop gets this long to delete its ledgers before it is killed."""


@dataclass
class _Client:
    index: int
    proc: asyncio.subprocess.Process
    log_path: Path
    created: int = 0
    answered: int = 0
    result: dict[str, Any] | None = None
    error: str | None = None


Sampler = Callable[[], Awaitable[Any]]


async def run_clients(
    spec: dict[str, Any],
    clients: int,
    out: Path,
    live: LiveLine,
    *,
    label: str,
    at_span_ends: Sampler | None = None,
) -> dict[str, Any]:
    """Run ``clients`` processes of ``spec`` (the worker's spec, ``index`` set per process) and
    return the merged result: entries/s, latency percentiles, timeline, CPU, per-ledger fairness,
    plus ``samples``: what ``at_span_ends()`` returned at the start and end of the measured span."""
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    procs: list[_Client] = []
    try:
        for index in range(clients):
            log_path = out / f"{label}-client-{index}.log"
            procs.append(await _start(index, {**spec, "index": index}, log_path))
        ready_s = READY_TIMEOUT_S + READY_S_PER_LEDGER * spec.get("ledgers", 1)
        total = clients * spec.get("ledgers", 1)

        def show_created() -> None:
            live.show(f"{label}: creating ledgers {sum(c.created for c in procs):,}/{total:,}")

        async with asyncio.timeout(ready_s):
            await asyncio.gather(*(_wait_ready(c, show_created) for c in procs))
        start = clock() + START_DELAY_S
        span = Span(start, spec["warmup_s"], spec["duration_s"], spec["interval_s"])
        for client in procs:
            assert client.proc.stdin is not None
            client.proc.stdin.write(f"go {start!r}\n".encode())
            await client.proc.stdin.drain()
        readers = [asyncio.create_task(_read_until_result(c)) for c in procs]
        samples = await _sample_and_show(span, procs, live, label, at_span_ends)
        # the result comes once the process closed and deleted its ledgers (unless the spec's
        # cleanup is off): that takes time too
        ledgers_s = READY_S_PER_LEDGER * spec.get("ledgers", 1)
        async with asyncio.timeout(spec["duration_s"] + DRAIN_TIMEOUT_S + ledgers_s):
            await asyncio.gather(*readers)
        for client in procs:
            if client.result is None:
                raise BenchFailed(
                    f"client process {client.index} failed: {client.error or 'no result'}; "
                    f"its log: {client.log_path}"
                )
        return _merge(span, [c.result for c in procs if c.result is not None], samples)
    finally:
        await asyncio.shield(_stop(procs))


async def _stop(procs: list[_Client]) -> None:
    """SIGTERM (a worker then deletes its ledgers and exits), SIGKILL after STOP_GRACE_S."""
    alive = [c.proc for c in procs if c.proc.returncode is None]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    for proc in alive:
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


RESULT_LINE_BYTES_MAX = 64 * 1024 * 1024
"""Longest line a client process may print: its result holds a count per ledger (100,000 ledgers
took past asyncio's default of 64 KiB)."""


async def _start(index: int, spec: dict[str, Any], log_path: Path) -> _Client:
    with log_path.open("ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bookkeeper_aio.cli.bench.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env={**os.environ, "BKAIO_LOG_FORMAT": "json"},
            limit=RESULT_LINE_BYTES_MAX,
        )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    await proc.stdin.drain()
    return _Client(index, proc, log_path)


async def _next_line(client: _Client) -> tuple[str, str] | None:
    assert client.proc.stdout is not None
    while True:
        raw = await client.proc.stdout.readline()
        if not raw:
            return None
        line = raw.decode(errors="replace").rstrip("\n")
        if line.startswith("BENCH "):
            kind, _, rest = line[len("BENCH ") :].partition(" ")
            return kind, rest


async def _wait_ready(client: _Client, show_created: Callable[[], None]) -> None:
    while (got := await _next_line(client)) is not None and got[0] == "created":
        client.created = int(got[1])
        show_created()
    if got is None or got[0] != "ready":
        message = got[1] if got else "exited before it was ready"
        raise BenchFailed(f"client process {client.index}: {message}; its log: {client.log_path}")


async def _read_until_result(client: _Client) -> None:
    while (got := await _next_line(client)) is not None:
        kind, rest = got
        if kind == "progress":
            client.answered = int(rest)
        elif kind == "result":
            client.result = json.loads(rest)
        elif kind == "error":
            client.error = rest
    await client.proc.wait()


async def _sample_and_show(
    span: Span, procs: list[_Client], live: LiveLine, label: str, sampler: Sampler | None
) -> list[Any]:
    samples: list[Any] = []
    last_answered, last_t = 0, clock()
    marks = [span.measure_from, span.end]
    while True:
        now = clock()
        if marks and now >= marks[0]:
            marks.pop(0)
            if sampler is not None:
                samples.append(await sampler())
            continue
        if not marks:
            break
        answered = sum(c.answered for c in procs)
        if now - last_t >= 0.5:
            rate = (answered - last_answered) / (now - last_t)
            last_answered, last_t = answered, now
            phase = "warm-up" if now < span.measure_from else "measuring"
            live.show(
                f"{label}: {phase} {now - span.start:5.1f}/{span.end - span.start:.1f} s  {rate:,.0f}/s"
            )
        await asyncio.sleep(min(0.1, max(0.0, marks[0] - clock())))
    live.show(f"{label}: draining the adds in flight ...")
    return samples


def _merge(span: Span, results: list[dict[str, Any]], samples: list[Any]) -> dict[str, Any]:
    hist = merge(r["histogram"] for r in results)
    acked = sum(r["acked"] for r in results)
    timeline = [sum(values) for values in zip(*(r["timeline"] for r in results), strict=True)]
    per_ledger = [count for r in results for count in r["per_target"]]
    cpu_s = [r["cpu_s"] for r in results]
    merged: dict[str, Any] = {
        "entries": acked,
        "entries_per_s": round(acked / span.duration_s, 1),
        "failed": sum(r["failed"] for r in results),
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "latency_ms": latency_ms(hist),
        "timeline_interval_s": span.interval_s,
        "timeline_entries_per_s": [round(n / span.interval_s, 1) for n in timeline],
        "client_cpu_us_per_entry": round(sum(cpu_s) / acked * 1e6, 2) if acked else None,
        "clients": [
            {
                "entries": r["acked"],
                "cpu_us_per_entry": round(r["cpu_s"] / r["acked"] * 1e6, 2) if r["acked"] else None,
                "rss_peak_mib": r.get("rss_peak_mib"),
                "rss_end_mib": r.get("rss_end_mib"),
            }
            for r in results
        ],
        "client_rss_peak_mib": max((r.get("rss_peak_mib") or 0 for r in results), default=None),
        "client_rss_end_mib": max((r.get("rss_end_mib") or 0 for r in results), default=None),
        "fairness": _fairness(per_ledger),
        "_histogram": hist,
        "_samples": samples,
    }
    return merged


def _fairness(per_ledger: list[int]) -> dict[str, Any]:
    """Entries per ledger over the measured span: min, max and min / max (1.0 = perfectly even)."""
    if not per_ledger:
        return {}
    low, high = min(per_ledger), max(per_ledger)
    return {
        "ledgers": len(per_ledger),
        "min": low,
        "max": high,
        "min_over_max": round(low / high, 3) if high else None,
    }
