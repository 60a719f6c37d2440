"""The canary of the attack tests: a well-behaved client writing alongside an attack, and the
attacker process it runs beside (tests/harness/attacker.py).

:class:`Canary` adds to its own ledger at a fixed rate over one connection of its own (TLS and AUTH
when the bookie asks for them), records each add's latency, and at the end reads every entry back.
Its ledger "never fails": every add is answered EOK and every entry reads back identical.
:func:`attack` runs one measured scenario: the canary alone (its baseline) and beside the attacker,
interleaved, sampling the bookie's RSS meanwhile; it returns the figures, the tests assert on them.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import StatusCode
from tests.harness.bookie_proc import BookieProcess

from .wire import KEY, WireClient, entry_body

MIB = 1024 * 1024
CPU_GROWTH_MAX = 0.15
"""What an attack may add to the bookie's CPU share (of one core) over the canary's own load: a
refused attack costs it next to nothing (measured: +0-3 %), an unbounded one all of a core. Less
noisy than the canary's p99 on a busy machine, so it is checked in the fast variants too."""
CANARY_RATE = 200.0
"""Canary adds per second (one every 5 ms, each awaited on its own: an open loop)."""
STALL_S = 0.005
"""A wake-up of the canary's own event loop this much later than asked: its process was not
running (the machine descheduled it, or it collected garbage). An add in flight meanwhile measured
the canary's stall, not the bookie's answer: it is left out of the latencies, in both phases alike
(counted in ``stalled``). Measured on the 2-core machine these tests share, at load 5-10: two
phases of the canary beside an attacker that does nothing (one idle connection, with or without
SIGSTOP/SIGCONT) had p99 ratios from 0.3x to 3x, and most of the adds over the p99 had been in
flight across a stall of the canary itself — the p99 measured the machine, not the attack."""
STALL_TICK_S = 0.002
SLOWEST_KEPT = 12


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Stalls:
    """The canary process's own stalls (:data:`STALL_S`), watched by a ticker while a phase runs."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    async def watch(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(STALL_TICK_S)
            after = time.perf_counter()
            if after - before - STALL_TICK_S > STALL_S:
                self.starts.append(before)
                self.ends.append(after)

    def overlaps(self, start: float, end: float) -> bool:
        """Whether [start, end] overlaps a stall (stalls come in time order, one after another)."""
        first = bisect.bisect_right(self.ends, start)  # the first stall ending after ``start``
        return first < len(self.starts) and self.starts[first] < end


@dataclass
class Phase:
    latencies_ms: list[float] = field(default_factory=list)
    """Of the adds not in flight across a stall of the canary's own process (:data:`STALL_S`)."""
    slowest: list[tuple[float, float]] = field(default_factory=list)
    """The slowest of those adds: (latency ms, seconds since the run's start), for a failure's
    report (one stall of the bookie, or many spread out?)."""
    stalled: int = 0
    """Adds left out of ``latencies_ms``: in flight across a stall of the canary's process."""
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bookie_cpu_s: float = 0.0
    """CPU time the canary's bookie used meanwhile."""
    attacker_cpu_s: float = 0.0

    def add(self, other: Phase) -> None:
        self.latencies_ms += other.latencies_ms
        offset = self.seconds
        self.slowest = sorted(self.slowest + [(ms, offset + at) for ms, at in other.slowest], reverse=True)
        del self.slowest[SLOWEST_KEPT:]
        self.stalled += other.stalled
        self.failures += other.failures
        self.seconds += other.seconds
        self.bookie_cpu_s += other.bookie_cpu_s
        self.attacker_cpu_s += other.attacker_cpu_s

    @property
    def bookie_cpu_share(self) -> float:
        return self.bookie_cpu_s / self.seconds if self.seconds else 0.0

    @property
    def p99_ms(self) -> float:
        return p99(self.latencies_ms) if self.latencies_ms else 0.0


class Canary:
    def __init__(
        self,
        address: tuple[str, int],
        ledger_id: int,
        *,
        key: bytes = KEY,
        tls: ssl.SSLContext | None = None,
        token: str | None = None,
        rate: float = CANARY_RATE,
        keepalive_s: float = 0.0,
    ) -> None:
        self.address = address
        self.ledger_id = ledger_id
        self.key = key
        self.tls = tls
        self.token = token
        self.interval_s = 1.0 / rate
        self.next_entry = 0
        self.wire: WireClient | None = None
        self.keepalive_s = keepalive_s
        """Non-zero: a READ_LAC this often while connected, so that a bookie with a short
        ``idle_timeout_s`` does not close the canary between its phases."""
        self._keepalive: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        self.wire = await WireClient.connect(*self.address, tls=self.tls)
        if self.token is not None:
            answer = await asyncio.wait_for(self.wire.request(m.AuthRequest, "token", self.token.encode()), 5)
            assert (answer.status, answer.complete) == (StatusCode.EOK, 1), answer
        if self.keepalive_s:
            self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        while self.wire is not None and not self.wire.closed.done():
            await asyncio.wait_for(self.wire.read_lac(self.ledger_id, key=self.key), 10)
            await asyncio.sleep(self.keepalive_s)

    async def run(self, seconds: float) -> Phase:
        """Adds every ``interval_s`` for ``seconds`` (each on its own: a slow answer does not
        delay the next add), then waits for every answer. The latencies of adds in flight across a
        stall of this process are left out (:data:`STALL_S`)."""
        assert self.wire is not None
        phase = Phase()
        loop = asyncio.get_running_loop()
        pending: list[asyncio.Task[None]] = []
        stalls = Stalls()
        watcher = loop.create_task(stalls.watch())
        timed: list[tuple[float, float]] = []

        async def one(entry_id: int) -> None:
            assert self.wire is not None
            started = time.perf_counter()
            try:
                answer = await asyncio.wait_for(
                    self.wire.add(self.ledger_id, entry_id, b"canary %d" % entry_id, key=self.key), 10
                )
            except (TimeoutError, ConnectionError) as exc:
                phase.failures.append(f"entry {entry_id}: {exc!r}")
                return
            timed.append((started, time.perf_counter()))
            if answer.status != StatusCode.EOK:
                phase.failures.append(f"entry {entry_id}: status {answer.status} {answer.message}")

        start = loop.time()
        count = int(seconds / self.interval_s)
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i * self.interval_s - loop.time()))
            pending.append(loop.create_task(one(self.next_entry)))
            self.next_entry += 1
        try:
            await asyncio.gather(*pending)
        finally:
            watcher.cancel()
        origin = time.perf_counter() - (loop.time() - start)
        for started, ended in timed:
            if stalls.overlaps(started, ended):
                phase.stalled += 1
            else:
                phase.latencies_ms.append((ended - started) * 1e3)
                phase.slowest.append(((ended - started) * 1e3, started - origin))
        phase.slowest.sort(reverse=True)
        del phase.slowest[SLOWEST_KEPT:]
        return phase

    async def verify(self) -> list[str]:
        """Every entry added reads back identical; the problems found."""
        assert self.wire is not None
        reads = [self.wire.read(self.ledger_id, e, key=self.key) for e in range(self.next_entry)]
        problems = []
        for entry_id, answer in enumerate(await asyncio.wait_for(asyncio.gather(*reads), 30)):
            expected = entry_body(self.ledger_id, entry_id, b"canary %d" % entry_id)
            if (answer.status, answer.body) != (StatusCode.EOK, expected):
                problems.append(f"entry {entry_id}: status {answer.status}")
        return problems

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self.wire is not None:
            self.wire.close()


OTHER_PEER = "127.0.0.2"
"""The attacker connects from here: another peer address on loopback, as another host would. The
bookie's per-address bounds then tell it from the canary and the test's own connections (from
127.0.0.1), which must not share its fate."""


def start_attacker(
    kind: str, targets: list[tuple[str, int]], seconds: float, *args: str
) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "tests.harness.attacker", kind, "--seconds", str(seconds)]
    command += ["--source-host", OTHER_PEER, *args]
    for host, port in targets:
        command += ["--target", f"{host}:{port}"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def attacker_result(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    try:
        out, err = await asyncio.wait_for(loop.run_in_executor(None, proc.communicate), timeout_s)
    except TimeoutError:
        proc.kill()
        raise
    assert proc.returncode == 0, f"attacker failed ({proc.returncode}): {err[-2000:]}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@dataclass
class Figures:
    """What one scenario measured (the tests assert on these; ``as_json`` is printed for the docs)."""

    kind: str
    baseline: Phase
    attacked: Phase
    attacker: dict[str, Any]
    rss_before: int
    rss_peak: int
    read_back: list[str]

    @property
    def rss_growth(self) -> int:
        return self.rss_peak - self.rss_before

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "canary_baseline_p99_ms": round(self.baseline.p99_ms, 2),
            "canary_attacked_p99_ms": round(self.attacked.p99_ms, 2),
            "bookie_cpu_baseline": round(self.baseline.bookie_cpu_share, 3),
            "bookie_cpu_attacked": round(self.attacked.bookie_cpu_share, 3),
            "attacker_cpu_attacked": round(
                self.attacked.attacker_cpu_s / max(self.attacked.seconds, 1e-9), 3
            ),
            "canary_adds_stalled": [self.baseline.stalled, self.attacked.stalled],
            "canary_slowest_ms_at_s": [
                [[round(ms, 1), round(at, 2)] for ms, at in phase.slowest]
                for phase in (self.baseline, self.attacked)
            ],
            "canary_adds": sum(len(p.latencies_ms) + p.stalled for p in (self.baseline, self.attacked)),
            "canary_failures": len(self.baseline.failures) + len(self.attacked.failures),
            "rss_before_mib": round(self.rss_before / MIB, 1),
            "rss_peak_mib": round(self.rss_peak / MIB, 1),
            "attacker": self.attacker,
        }

    def check(self, *, rss_growth_max: int, latency: bool, cpu_growth_max: float = CPU_GROWTH_MAX) -> None:
        """The acceptance: the canary never failed, the bookie's RSS grew at most
        ``rss_growth_max``, its CPU share beside the attack is at most ``cpu_growth_max`` (of a
        core) over its share while the canary wrote alone, and (``latency``) the canary's p99
        beside the attack is within 2x of its baseline."""
        print(json.dumps(self.as_json()))
        failures = self.baseline.failures + self.attacked.failures + self.read_back
        assert not failures, f"{self.kind}: the canary failed: {failures[:5]}"
        assert self.rss_growth <= rss_growth_max, (
            f"{self.kind}: bookie RSS grew {self.rss_growth / MIB:.0f} MiB (bound {rss_growth_max / MIB:.0f})"
        )
        cpu_alone, cpu_attacked = self.baseline.bookie_cpu_share, self.attacked.bookie_cpu_share
        assert cpu_attacked <= cpu_alone + cpu_growth_max, (
            f"{self.kind}: the bookie used {cpu_attacked:.0%} of a core beside the attack, "
            f"{cpu_alone:.0%} with the canary alone"
        )
        if latency:
            assert self.attacked.p99_ms <= 2 * self.baseline.p99_ms, (
                f"{self.kind}: canary p99 {self.attacked.p99_ms:.2f} ms beside the attack, baseline "
                f"{self.baseline.p99_ms:.2f} ms"
            )


async def _measured(canary: Canary, seconds: float, bookie_pid: int, attacker_pid: int) -> Phase:
    cpu0, attacker0, t0 = cpu_s(bookie_pid), cpu_s(attacker_pid), time.perf_counter()
    phase = await canary.run(seconds)
    phase.seconds = time.perf_counter() - t0
    phase.bookie_cpu_s = cpu_s(bookie_pid) - cpu0
    phase.attacker_cpu_s = cpu_s(attacker_pid) - attacker0
    return phase


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` catches ``signum`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


async def _handles(pid: int, signum: int, timeout_s: float = 30.0) -> None:
    """Wait until process ``pid`` catches ``signum``."""
    async with asyncio.timeout(timeout_s):
        while True:  # a poll: nothing tells when another process installs a handler
            if catches(pid, signum):
                return
            await asyncio.sleep(0.02)


async def attack(
    bookies: list[BookieProcess],
    canary: Canary,
    kind: str,
    *attacker_args: str,
    rounds: int,
    slice_s: float,
) -> Figures:
    """``rounds`` times: the canary alone for ``slice_s`` (the attacker's connections dropped,
    SIGUSR1, and its process stopped, SIGSTOP: none of its requests wait at the bookie), then beside
    the attacker for ``slice_s`` (SIGCONT and SIGUSR2, after a moment to ramp up) — interleaved, so
    that what else the machine does weighs on the baseline and the attacked phase alike. The RSS of
    the canary's bookie (``bookies[0]``) is sampled every 50 ms throughout; at the end the attacker
    is stopped (SIGTERM: it reports) and the canary reads everything back."""
    main = bookies[0]
    assert main.proc is not None
    await canary.connect()
    await canary.run(0.5)  # warm-up, not counted
    rss_before = rss_bytes(main.proc.pid)
    ramp_s = 0.3
    cap_s = rounds * 2 * (slice_s + ramp_s) + 30  # the attacker's own time limit: SIGTERM comes first
    proc = start_attacker(kind, [b.address for b in bookies], cap_s, *attacker_args)
    peak = [rss_before]
    sampling = True

    async def sample() -> None:
        assert main.proc is not None
        while sampling:
            peak[0] = max(peak[0], rss_bytes(main.proc.pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.get_running_loop().create_task(sample())
    baseline, attacked = Phase(), Phase()
    try:
        await _handles(proc.pid, signal.SIGUSR2)  # started (imports done): SIGUSR1 would kill it before
        await asyncio.sleep(1.0)  # it opens its connections
        for _ in range(rounds):
            proc.send_signal(signal.SIGUSR1)  # it drops its connections: nothing of it stays queued
            await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(ramp_s)  # what it sent before the stop is answered or dropped
            baseline.add(await _measured(canary, slice_s, main.proc.pid, proc.pid))
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGUSR2)  # it connects again and attacks
            await asyncio.sleep(ramp_s)
            attacked.add(await _measured(canary, slice_s, main.proc.pid, proc.pid))
        proc.send_signal(signal.SIGTERM)
        result = await attacker_result(proc)
    finally:
        sampling = False
        await sampler
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
    read_back = await canary.verify()
    canary.close()
    return Figures(kind, baseline, attacked, result, rss_before, peak[0], read_back)
