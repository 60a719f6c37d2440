"""The client's timer wheel (the explicit-LAC checks of every write handle on one loop timer):
never early, at most a tick late, in order, one failing callback does not starve the others, and
no loop timer while nothing waits."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio.client.timer_wheel import TimerWheel

TICK_S = 0.01


async def test_wheel__calls_no_earlier_than_the_delay_and_at_most_a_tick_later() -> None:
    loop = asyncio.get_running_loop()
    wheel = TimerWheel(TICK_S)
    fired: dict[str, float] = {}
    started = loop.time()
    for name, delay_s in (("late", 0.05), ("soon", 0.012), ("same-tick", 0.013)):
        wheel.call_later(delay_s, lambda name=name: fired.setdefault(name, loop.time()))
    assert len(wheel) == 3
    await asyncio.sleep(0.12)
    assert set(fired) == {"late", "soon", "same-tick"}
    assert fired["soon"] - started >= 0.012 - 0.001  # the loop's clock counts whole milliseconds
    assert fired["late"] - started >= 0.05 - 0.001
    assert fired["soon"] <= fired["same-tick"] < fired["late"]
    assert len(wheel) == 0
    assert wheel._handle is None  # nothing waits: no loop timer


async def test_wheel__same_tick_in_order_and_a_failing_callback_does_not_starve_the_rest() -> None:
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context["exception"]))
    wheel = TimerWheel(TICK_S)
    order: list[int] = []

    def boom() -> None:
        raise RuntimeError("boom")

    wheel.call_later(0.0, lambda: order.append(1))
    wheel.call_later(0.0, boom)
    wheel.call_later(0.0, lambda: order.append(2))
    # a callback scheduling again lands on a later tick, not in the run that calls it
    wheel.call_later(0.0, lambda: wheel.call_later(0.0, lambda: order.append(3)))
    await asyncio.sleep(0.05)
    loop.set_exception_handler(None)
    assert order == [1, 2, 3]
    assert [str(e) for e in errors] == ["boom"]


async def test_wheel__an_earlier_deadline_moves_the_loop_timer_and_close_drops_everything() -> None:
    wheel = TimerWheel(TICK_S)
    fired: list[str] = []
    wheel.call_later(10.0, lambda: fired.append("far"))
    wheel.call_later(0.01, lambda: fired.append("near"))
    await asyncio.sleep(0.05)
    assert fired == ["near"]
    assert len(wheel) == 1
    wheel.close()
    assert len(wheel) == 0
    assert wheel._handle is None


def test_wheel__a_tick_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tick_s"):
        TimerWheel(0.0)
