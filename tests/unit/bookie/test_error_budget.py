"""The per-address refusal budget and the log-line bucket of bookie.connection_handler, on a
scripted clock: the burst, the refill, the deficit's floor, the wait it asks for, and the buckets
dropped once full; refused connections counted and logged once a second."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from bookie import budgets
from bookie.budgets import SWEEP_BUCKETS_MIN, SWEEP_INTERVAL_S, ErrorBudget, LogLines, Refusals
from bookkeeper_aio.protocol.errors import ProtocolError, RequestTooComplex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_then_waits_bounded_by_the_floor() -> None:
    clock = Clock()
    budget = ErrorBudget(rate=10.0, burst=100.0, clock=clock)
    assert [budget.charge("a") for _ in range(100)] == [0.0] * 100  # the burst
    assert budget.charge("a") == 0.1  # one in deficit: a tenth of a second at 10/s
    assert budget.charge("b") == 0.0  # another address has its own budget
    for _ in range(1000):
        budget.charge("a")
    assert budget.deficit_s("a") == 10.0  # never deeper than the burst: at most burst / rate
    clock.now = 5.0
    assert budget.deficit_s("a") == 5.0
    clock.now = 10.0
    assert budget.deficit_s("a") == 0.0  # paid back, with nothing to spare:
    assert budget.charge("a") == 0.1  # the next refusal is a deficit again
    clock.now = 30.0
    assert budget.charge("a") == 0.0  # refilled: a burst is allowed again


def test_a_large_refused_frame_costs_one_refusal_per_64_kib() -> None:
    clock = Clock()
    budget = ErrorBudget(rate=10.0, burst=100.0, clock=clock)
    cost = (1024 * 1024) / budgets.REFUSED_BYTES_PER_CHARGE  # a 1 MiB frame of garbage: 16
    assert [budget.charge("a", cost) for _ in range(6)] == [0.0] * 6  # 96 of the burst
    assert budget.charge("a", cost) == pytest.approx(1.2)  # 12 in deficit at 10/s


def test_a_frame_refused_for_nested_values_costs_one_refusal_per_256_bytes() -> None:
    nested = RequestTooComplex("request frame holds more than 64 arrays, maps and extension values")
    assert budgets.refused_frame_cost(nested, 54_250) == pytest.approx(54_250 / 256)  # ~212
    assert budgets.refused_frame_cost(nested, 100) == 1.0
    assert budgets.refused_frame_cost(ProtocolError("not msgpack"), 54_250) == 1.0
    assert budgets.refused_frame_cost(ProtocolError("not msgpack"), 1 << 20) == 16.0


def test_buckets_are_dropped_only_when_full_again() -> None:
    clock = Clock()
    budget = ErrorBudget(rate=10.0, burst=100.0, clock=clock)
    for _ in range(150):
        budget.charge("a")
    budget.release("a")  # in deficit: kept, so reconnecting does not reset it
    assert budget.deficit_s("a") > 0
    clock.now = 100.0
    budget.release("a")
    assert budget.deficit_s("a") == 0.0
    assert "a" not in budget._buckets


def test_rate_zero_budgets_nothing() -> None:
    budget = ErrorBudget(rate=0.0, burst=0.0, clock=Clock())
    assert all(budget.charge("a") == 0.0 for _ in range(10_000))


def test_log_lines_are_rate_limited_and_the_dropped_counted() -> None:
    clock = Clock()
    lines = LogLines(rate=10.0, burst=3.0, clock=clock)
    assert [lines.take() for _ in range(5)] == [0, 0, 0, None, None]
    clock.now = 0.1
    assert lines.take() == 2  # the next line says how many were dropped before it
    assert lines.take() is None


async def test_refused_connections_are_counted_each_and_logged_once_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(budgets, "REFUSALS_LOG_INTERVAL_S", 0.01)
    refusals = Refusals()
    with capture_logs() as logs:
        for _ in range(1000):  # a flood at accept: one line now, the rest as one count
            refusals.note("connections_per_address_max", 32, "10.0.0.9")
        refusals.note("connections_max", 1024, "10.0.0.8")
        for _ in range(1000):  # the interval passes twice, the second with nothing to say (however
            if refusals._timer is None:  # late a loaded machine runs the timers)
                break
            await asyncio.sleep(0.01)
        refusals.note("connections_max", 1024, "10.0.0.8")  # after a quiet spell: logged at once
    assert refusals.total == 1002
    assert [line.get("refused", line.get("reason")) for line in logs] == [
        "connections_per_address_max",
        {"connections_per_address_max": 999, "connections_max": 1},
        "connections_max",
    ]


class Waiter:
    def __init__(
        self, name: str, budget: ErrorBudget, released: list[tuple[str, int]], done: asyncio.Event
    ) -> None:
        self.name = name
        self.budget = budget
        self.released = released
        self.budget_done = done

    def errors_paid(self) -> None:
        self.released.append((self.name, self.budget.waiting(self.name[0])))
        if len(self.released) == 4:
            self.budget_done.set()


async def test_waiting_connections_go_one_at_a_time_in_arrival_order() -> None:
    """An address's connections waiting for its deficit are let go in the order they came, one per
    turn of the budget's pacing, never together (together they came back as a burst: each is let
    go while the ones behind it still wait); one that closes meanwhile leaves the queue; another
    address has a queue of its own."""
    budget = ErrorBudget(rate=200.0, burst=2.0, clock=time.monotonic)
    for _ in range(4):
        budget.charge("a")  # 2 in deficit: 10 ms to pay
    released: list[tuple[str, int]] = []
    done = asyncio.Event()
    waiters = {name: Waiter(name, budget, released, done) for name in ("a1", "a2", "a3", "a4")}
    for waiter in waiters.values():
        budget.wait("a", waiter)
    budget.wait("b", Waiter("b1", budget, released, done))  # not in deficit: let go at once
    budget.unwait("a", waiters["a3"])
    assert budget.waiting("a") == 3
    await asyncio.wait_for(done.wait(), 10)
    assert released == [("b1", 0), ("a1", 2), ("a2", 1), ("a4", 0)]
    assert not budget._timers


def test_buckets_of_addresses_gone_are_swept() -> None:
    """An address that erred once and closed kept its bucket for good (``release`` drops only a
    full one, and a bucket is not full right after a charge): 100,000 IPv6 peers, 100,000 buckets
    an hour later. Now full buckets are swept as new ones come, and after ``SWEEP_INTERVAL_S``."""
    now = [0.0]
    budget = ErrorBudget(100.0, 1000.0, lambda: now[0])
    for i in range(100_000):
        address = f"2001:db8:{i:x}::/64"
        budget.charge(address)  # one refusal on its only connection
        now[0] += 0.000_1  # 10,000 a second: about 100 not full again at any time
        budget.release(address)  # which closed at once
    assert budget.buckets <= 2 * SWEEP_BUCKETS_MIN
    now[0] += SWEEP_INTERVAL_S
    budget.release("2001:db8::/64")  # any release after the interval sweeps
    assert budget.buckets == 0
    budget.charge("10.0.0.1", 2000.0)  # in deficit: kept
    now[0] += 1.0
    budget.sweep()
    assert budget.buckets == 1
    now[0] += 20.0  # paid back and full again
    budget.sweep()
    assert budget.buckets == 0
