"""The load loop of ``bkaio bench``: open loop at a fixed rate measures from the intended send time
(a stall is charged to everything queued behind it: no coordinated omission), the closed loop keeps
the window full, and only the measured span counts."""

from __future__ import annotations

import array
import asyncio
import random

import pytest

from bookkeeper_aio.cli.bench.load import Span, clock, drive, timeline_of
from bookkeeper_aio.cli.bench.stats import latency_ms, merge


def answered_later(state: dict[str, int], delay_s: float) -> asyncio.Future[None]:
    """A future the fake system answers ``delay_s`` from now, counted in ``state``'s ``in_flight``
    and ``in_flight_max`` meanwhile."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    state["in_flight"] += 1
    state["in_flight_max"] = max(state["in_flight_max"], state["in_flight"])

    def answer() -> None:
        state["in_flight"] -= 1
        future.set_result(None)

    loop.call_later(delay_s, answer)
    return future


def fake_system(delay_s: float, stall_at: int | None = None, stall_s: float = 0.0):  # type: ignore[no-untyped-def]
    """A submit answering after ``delay_s``; submission ``stall_at`` blocks the sender ``stall_s``."""
    state = {"sent": 0, "in_flight": 0, "in_flight_max": 0}

    async def submit() -> asyncio.Future[None]:
        state["sent"] += 1
        if state["sent"] == stall_at:
            await asyncio.sleep(stall_s)  # e.g. the window is full, or the client is stuck
        return answered_later(state, delay_s)

    return submit, state


async def test_open_loop__latency_counts_from_the_intended_send_time() -> None:
    submit, state = fake_system(0.002, stall_at=50, stall_s=0.3)
    span = Span(clock(), 0.0, 1.0, 0.25)
    result = await drive([submit], span, window=1000, rate=200.0)
    hist = merge([result.to_json()["histogram"]])
    ms = latency_ms(hist)
    # 200/s for 1 s: every intended submission went out, however late.
    assert 195 <= state["sent"] <= 201
    assert result.failed == 0
    # The 0.3 s stall at the 50th delays the ~60 intended during it: they carry it in their latency
    # (a loop that measured from the real send would see ~2 ms for all of them).
    assert ms["max"] >= 250
    assert ms["p50"] < 50
    assert hist.get_value_at_percentile(75) / 1e3 >= 50


async def test_open_loop__from_the_send_tick_a_stall_is_not_charged_to_what_waited_behind_it() -> None:
    # replication_bound.py's clock, for a like-for-like ratio against it (docs/benchmarks.md)
    submit, state = fake_system(0.002, stall_at=50, stall_s=0.3)
    span = Span(clock(), 0.0, 1.0, 0.25)
    result = await drive([submit], span, window=1000, rate=200.0, latency_from="send")
    ms = latency_ms(merge([result.to_json()["histogram"]]))
    assert 195 <= state["sent"] <= 201
    # Only the stalled submission itself (sent on the tick it blocked) carries the stall.
    assert ms["max"] >= 250
    assert result.histogram().get_value_at_percentile(98) / 1e3 < 50


async def test_load__an_unknown_latency_origin_is_refused() -> None:
    submit, _ = fake_system(0.001)
    with pytest.raises(ValueError, match="latency_from"):
        await drive([submit], Span(clock(), 0.0, 0.1), window=1, rate=10.0, latency_from="answer")


async def test_closed_loop__keeps_the_window_full_and_counts_only_the_measured_span() -> None:
    submit, state = fake_system(0.01)
    span = Span(clock(), 0.3, 0.6, 0.1)
    result = await drive([submit, submit], span, window=20, rate=0.0)
    assert state["in_flight_max"] == 20
    # ~20 in flight, 10 ms each: ~2,000/s; the warm-up's answers are not counted.
    assert 0.4 * 2000 * 0.6 <= result.acked <= 1.1 * 2000 * 0.6
    assert result.acked < state["sent"]
    assert sum(result.timeline) == result.acked
    assert len(result.timeline) == 6
    assert sum(result.per_target) == result.acked
    assert abs(result.per_target[0] - result.per_target[1]) <= 20


async def test_load__a_failed_submission_stops_the_load_and_is_reported() -> None:
    async def failing() -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_exception(RuntimeError("bookie gone"))
        return future

    span = Span(clock(), 0.0, 5.0, 0.5)
    started = clock()
    result = await drive([failing], span, window=10)
    assert clock() - started < 2.0
    assert result.failed >= 1
    assert result.first_error is not None
    assert "bookie gone" in result.first_error


async def test_closed_loop__a_nowait_submit_is_tried_first_and_the_waiting_one_when_it_declines() -> None:
    state = {"in_flight": 0, "in_flight_max": 0, "nowait": 0, "declined": 0, "waited": 0}
    room = 15  # the nowait submit declines beyond this many in flight; the loop's window is 20

    def nowait() -> asyncio.Future[None] | None:
        state["nowait"] += 1
        if state["in_flight"] >= room:
            state["declined"] += 1
            return None  # nothing done: the loop must call the waiting submit instead
        return answered_later(state, 0.01)

    async def submit() -> asyncio.Future[None]:
        state["waited"] += 1
        await asyncio.sleep(0)
        return answered_later(state, 0.01)

    span = Span(clock(), 0.0, 0.5, 0.1)
    result = await drive([submit], span, window=20, nowait=[nowait])
    assert result.failed == 0
    assert state["declined"] > 0
    assert state["waited"] == state["declined"]  # each decline, and only a decline, waits
    assert state["nowait"] - state["declined"] > state["waited"]  # most go the plain way
    assert state["in_flight_max"] == 20  # the window stays full
    assert 0.4 * 2000 * 0.5 <= result.acked <= 1.1 * 2000 * 0.5
    assert sum(result.timeline) == result.acked


async def test_load__nowait_submits_must_match_the_submits() -> None:
    async def submit() -> asyncio.Future[None]:
        raise AssertionError("not called")

    with pytest.raises(ValueError, match="nowait"):
        await drive([submit, submit], Span(clock(), 0.0, 0.1), window=2, nowait=[lambda: None])


@pytest.mark.parametrize("seed", range(20))
def test_timeline_of__is_the_bucket_of_each_answer(seed: int) -> None:
    rng = random.Random(seed)
    start, interval_s, buckets = 1000.0 + rng.random(), rng.choice([0.1, 0.25, 0.5]), rng.randint(1, 12)
    # sorted, as the loop appends them; some past the last bucket's end (a rounded span)
    times = sorted(start + rng.random() * (buckets + 0.3) * interval_s for _ in range(rng.randint(0, 500)))
    expected = [0] * buckets  # the division per answer that timeline_of replaces
    for now in times:
        expected[min(int((now - start) / interval_s), buckets - 1)] += 1
    assert timeline_of(array.array("d", times), start, interval_s, buckets) == expected
    # An answer on an edge opens its bucket (the division may round it either way there).
    for k in range(buckets):
        edge = [start + k * interval_s]
        assert timeline_of(edge, start, interval_s, buckets) == [int(i == k) for i in range(buckets)]
