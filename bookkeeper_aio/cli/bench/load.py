"""The load loop of ``bkaio bench``: submit appends for a warm-up and a measured span, closed or
open loop, and record what came back. The system under test is a ``submit`` callable (our ledger
handles, or a NATS JetStream publisher for ``--compare nats``), so every system runs the very same
loop and the numbers compare.

Rules:

- Closed loop: at most ``window`` submitted and not yet answered; latency = answer - submit.
- Open loop (``rate > 0``): submission ``n`` is *intended* at ``start + n / rate`` and its latency is
  measured from that instant, however late the loop or a full window makes the real send (no
  coordinated omission: a stall shows up in the latencies of everything queued behind it).
- What counts: latencies of submissions intended inside the measured span; throughput = answers
  received inside it / its length; answers are bucketed per ``interval_s`` for the timeline.
- Nothing but a list append per answer on the hot path: the HdrHistogram is filled afterwards
  (recording costs ~2 µs a value).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import functools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bookkeeper_aio.cli.bench.stats import HdrHistogram, new_histogram, rss_bytes

Submit = Callable[[], Awaitable["asyncio.Future[Any]"]]
"""Start one append; returns (once there is room) a future resolved when it is acknowledged."""

SubmitNowait = Callable[[], "asyncio.Future[Any] | None"]
"""The same append started only if there is room right now: its future, or None (nothing was done,
and the loop calls the :data:`Submit` instead, which waits for room). Optional. The closed loop
tries it first: a plain call that returns the future, as ``replication_bound.py``'s client makes
its adds, instead of a coroutine per append (~700 instructions per entry of our client's,
docs/benchmarks.md)."""

TICK_S = 0.001
"""The event loop's timer resolution."""

clock = time.monotonic
"""CLOCK_MONOTONIC: one clock for every process on the machine, so client processes share a start."""


@dataclass(frozen=True)
class Span:
    """When to submit: ``start`` (a :data:`clock` instant) + ``warmup_s``, then ``duration_s``."""

    start: float
    warmup_s: float
    duration_s: float
    interval_s: float = 0.5

    @property
    def measure_from(self) -> float:
        return self.start + self.warmup_s

    @property
    def end(self) -> float:
        return self.measure_from + self.duration_s


@dataclass
class LoadResult:
    """What one process measured. ``timeline``: answers per ``interval_s`` of the measured span;
    ``rss_end_bytes``: the process's RSS at the span's end (steady state, the window full)."""

    acked: int = 0
    failed: int = 0
    first_error: str | None = None
    latencies_s: list[float] = field(default_factory=list)
    timeline: list[int] = field(default_factory=list)
    per_target: list[int] = field(default_factory=list)
    cpu_s: float = 0.0
    rss_end_bytes: int | None = None

    def histogram(self) -> HdrHistogram:
        """The latencies in microseconds."""
        hist = new_histogram()
        for latency_s in self.latencies_s:
            hist.record_value(max(1, int(latency_s * 1e6)))
        return hist

    def to_json(self) -> dict[str, Any]:
        hist = self.histogram()
        return {
            "acked": self.acked,
            "failed": self.failed,
            "first_error": self.first_error,
            "histogram": hist.encode().decode("ascii"),
            "timeline": self.timeline,
            "per_target": self.per_target,
            "cpu_s": round(self.cpu_s, 6),
            "rss_end_mib": None if self.rss_end_bytes is None else round(self.rss_end_bytes / 2**20, 1),
        }


async def drive(
    submits: Sequence[Submit],
    span: Span,
    *,
    window: int,
    rate: float = 0.0,
    latency_from: str = "intended",
    progress: Callable[[int], None] | None = None,
    nowait: Sequence[SubmitNowait] | None = None,
) -> LoadResult:
    """Run the load over ``submits`` (round robin: one per ledger) until ``span.end``, then wait for
    what is still in flight. ``progress(answers so far)`` is called about every 0.5 s. ``nowait``
    (one per submit, optional): the closed loop tries it first (:data:`SubmitNowait`).

    ``latency_from`` (open loop only): ``"intended"`` (the default, no coordinated omission) or
    ``"send"``: from the timer tick that sent the submission, the way ``replication_bound.py``
    measures its own open loop, for a like-for-like ratio against it (uvloop's timers tick whole
    milliseconds, so at 5,000/s a submission waits ~0.5-1 ms for its tick)."""
    if latency_from not in ("intended", "send"):
        raise ValueError(f"latency_from must be 'intended' or 'send', not {latency_from!r}")
    tries: list[SubmitNowait | None] = [None] * len(submits) if nowait is None else list(nowait)
    if len(tries) != len(submits):
        raise ValueError(f"{len(tries)} nowait submits for {len(submits)} submits")
    buckets = max(1, round(span.duration_s / span.interval_s))
    result = LoadResult(timeline=[0] * buckets, per_target=[0] * len(submits))
    measure_from, end, interval_s = span.measure_from, span.end, span.interval_s
    answered = [0]
    answer_times = array.array("d")  # of the answers inside the span: the timeline, afterwards

    def done(intended: float, target: int, future: asyncio.Future[Any]) -> None:
        now = clock()
        answered[0] += 1
        if future.cancelled() or future.exception() is not None:
            failed(future)
            return
        if measure_from <= now < end:
            answer_times.append(now)
            result.per_target[target] += 1
        if measure_from <= intended < end:
            result.latencies_s.append(now - intended)

    def failed(future: asyncio.Future[Any]) -> None:
        result.failed += 1
        if result.first_error is None:
            result.first_error = "cancelled" if future.cancelled() else repr(future.exception())

    await _sleep_until(span.start)
    reporter = asyncio.create_task(_report(progress, answered, end))
    cpu_marks: list[float] = []
    marker = asyncio.create_task(_mark_cpu((measure_from, end), cpu_marks, result))
    try:
        if rate:
            await _open_loop(submits, span, window, rate, latency_from == "send", result, done)
        else:
            workers = [
                _closed_worker(submits, tries, i, span, result, answer_times, answered, failed)
                for i in range(window)
            ]
            await asyncio.gather(*workers)
        # The span's CPU: from its start to its end (draining what is in flight is not part of it).
        if len(cpu_marks) == 1:
            cpu_marks.append(time.process_time())
        result.cpu_s = cpu_marks[1] - cpu_marks[0] if len(cpu_marks) == 2 else 0.0
    finally:
        reporter.cancel()
        marker.cancel()
    result.acked = len(answer_times)
    result.timeline = timeline_of(answer_times, measure_from, interval_s, buckets)
    if progress is not None:
        progress(answered[0])
    return result


def timeline_of(answer_times: Sequence[float], start: float, interval_s: float, buckets: int) -> list[int]:
    """How many of ``answer_times`` (sorted, none before ``start``) fall in each of ``buckets``
    intervals from ``start`` (the last takes everything after it too). The times are appended as
    the clock is read, so they are sorted: one binary search per bucket edge, not a division per
    answer (~2,800 instructions each, millions of answers in a long run)."""
    edges = [bisect.bisect_left(answer_times, start + i * interval_s) for i in range(1, buckets)]
    return [high - low for low, high in zip([0, *edges], [*edges, len(answer_times)], strict=True)]


_Done = Callable[[float, int, "asyncio.Future[Any]"], None]


async def _closed_worker(
    submits: Sequence[Submit],
    tries: Sequence[SubmitNowait | None],
    first: int,
    span: Span,
    result: LoadResult,
    answer_times: array.array[float],
    answered: list[int],
    failed: Callable[[asyncio.Future[Any]], None],
) -> None:
    """One slot of the closed loop's window: submit, wait for the answer, again, until the span's
    end (a coroutine per slot costs half the loop CPU per entry of a semaphore and done callbacks).
    An answer costs two appends and a count: the rest is worked out once the load is over."""
    count = len(submits)
    target = first % count
    measure_from, end = span.measure_from, span.end
    per_target, latencies = result.per_target, result.latencies_s
    while result.first_error is None and (intended := clock()) < end:
        future = None if (nowait := tries[target]) is None else nowait()
        if future is None:
            future = await submits[target]()
        try:
            await future
        except asyncio.CancelledError:
            if not future.cancelled():
                raise  # this worker was cancelled, not the submission
            answered[0] += 1
            failed(future)
        except Exception:  # noqa: BLE001 (the future holds it)
            answered[0] += 1
            failed(future)
        else:
            now = clock()
            answered[0] += 1
            if intended >= measure_from:  # latencies: of what was submitted inside the span
                latencies.append(now - intended)
            if measure_from <= now < end:  # throughput: answers inside the span
                answer_times.append(now)
                per_target[target] += 1
        target = target + 1 if target + 1 < count else 0


async def _open_loop(
    submits: Sequence[Submit],
    span: Span,
    window: int,
    rate: float,
    from_send: bool,
    result: LoadResult,
    done: _Done,
) -> None:
    """Submission ``n`` intended at ``span.start + n / rate``, at most ``window`` unanswered."""
    slots = asyncio.Semaphore(window)
    pending: set[asyncio.Future[Any]] = set()

    def answered(intended: float, target: int, future: asyncio.Future[Any]) -> None:
        slots.release()
        pending.discard(future)
        done(intended, target, future)

    count, end, sent = len(submits), span.end, 0
    while result.first_error is None and (now := clock()) < end:
        due = min(int((now - span.start) * rate) + 1, int((end - span.start) * rate))
        while sent < due:
            await slots.acquire()
            intended = now if from_send else span.start + sent / rate
            future = await submits[sent % count]()
            pending.add(future)
            future.add_done_callback(functools.partial(answered, intended, sent % count))
            sent += 1
        # At least a timer tick: uvloop's timers count whole milliseconds, a shorter sleep returns
        # at once and the loop would spin (measured: 4x the client's CPU per entry at 5,000/s).
        # What falls due meanwhile goes out together, measured from its intended instant all the
        # same (or from this tick, with ``from_send``).
        await asyncio.sleep(max(TICK_S, span.start + sent / rate - clock()))
    if pending:
        await asyncio.wait(list(pending))


async def _sleep_until(instant: float) -> None:
    delay_s = instant - clock()
    if delay_s > 0:
        await asyncio.sleep(delay_s)


async def _report(progress: Callable[[int], None] | None, answered: list[int], end: float) -> None:
    if progress is None:
        return
    while clock() < end:
        await asyncio.sleep(0.5)
        progress(answered[0])


async def _mark_cpu(instants: tuple[float, ...], into: list[float], result: LoadResult) -> None:
    """This process's CPU seconds at each of ``instants`` (the measured span's start and end), and
    its RSS at the last one."""
    for instant in instants:
        await _sleep_until(instant)
        into.append(time.process_time())
    result.rss_end_bytes = rss_bytes(os.getpid())
