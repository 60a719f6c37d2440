"""The simulation's event loop: virtual time, a seeded order of ready callbacks, no threads, no sockets.

Rules (the whole point is that one seed is one history):

- Time is a number the loop owns. It moves only when nothing is ready: straight to the earliest
  timer. No wall clock is read anywhere (``time()`` is the virtual time).
- Each iteration takes every ready callback (and every timer now due) and runs them in an order
  drawn from the seeded RNG: two tasks that are both ready may run either way round, as they may
  on a real machine. Order *within* one byte stream is kept by the network (tests/simulation/network.py),
  not by the loop.
- A callback whose context belongs to a crashed node is dropped instead of run: that is how a
  crash cancels everything the node had in flight (timers, task steps, disk completions) at once.
  Contexts carry the node through :data:`NODE`, set when the node's code is started.
- Sockets: ``create_server`` / ``create_connection`` go to the simulated network. Threads: a call to
  ``run_in_executor`` without an executor is refused (the bookie's executors come from the
  ``bookie.threads`` seam, which the simulation fills with inline ones).
- Nothing ready and no timer while the caller still waits: :class:`Deadlock` (a liveness bug).

The scheduling primitives (``call_soon``, ``call_at``, running a handle) are leaner versions of
``asyncio.BaseEventLoop``'s: the same handles in the same order (a seed's trace is byte-identical
with the stock ones), without the checks a single-threaded, never-closed, non-debug loop does not
need; the timer heap holds due times (floats carrying their timers: compared in C, in the
handles' own order) and the ready batch is shuffled with ``random.shuffle``'s algorithm inline.
They are most of the simulator's own cost.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import heapq
import random
from asyncio import format_helpers
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.simulation.network import Network


class Deadlock(RuntimeError):
    """The loop has nothing to run and no timer, yet the awaited operation has not finished."""


class Livelock(RuntimeError):
    """Callbacks keep running but virtual time does not move (a busy loop in the code under test)."""


class Cut(Exception):
    """Raised by an exhaustive explorer at a state already explored: the run ends there."""


ITERATIONS_AT_ONE_INSTANT_MAX = 100_000
"""More iterations than this without time moving is a busy loop, not progress."""


class Incarnation:
    """One life of a simulated node: dead once crashed (a restart makes a new incarnation)."""

    __slots__ = ("dead", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.dead = False

    def __repr__(self) -> str:
        return f"<{self.name}{' dead' if self.dead else ''}>"


NODE: contextvars.ContextVar[Incarnation | None] = contextvars.ContextVar("sim_node", default=None)
_NOBODY = Incarnation("-")
"""What the loop takes a callback's node to be when its context names none (never dead)."""

_copy_context = contextvars.copy_context
_heappush = heapq.heappush


class _Handle(asyncio.Handle):
    """A ``Handle`` the loop fills in itself (:meth:`SimLoop.call_soon`), without an ``__init__``
    frame and without the debug-mode lookups (the simulated loop never runs in debug).

    ``_repr`` and ``_source_traceback`` are None in every handle of a loop that is never in debug
    (asyncio writes them only in debug mode): class attributes here, which shadow the base
    class's slots, so making a handle stores neither."""

    __slots__ = ()
    _repr = None
    _source_traceback = None


class _TimerHandle(asyncio.TimerHandle):
    """A ``TimerHandle`` likewise (:meth:`SimLoop.call_at`). The timer heap never compares two:
    see :class:`_Due`."""

    __slots__ = ()
    _repr = None
    _source_traceback = None

    def cancel(self) -> None:
        """``TimerHandle.cancel`` (the loop's count of cancelled timers, then ``Handle.cancel``) in
        one frame instead of three: timeouts and sleeps cancel a timer each."""
        if not self._cancelled:
            if self._scheduled:  # BaseEventLoop._timer_handle_cancelled
                self._loop._timer_cancelled_count += 1  # type: ignore[attr-defined]
            self._cancelled = True
            self._callback = None
            self._args = None


class _Due(float):
    """A timer heap entry: the timer's due time, as a float, carrying the timer (``handle``).

    The heap compares entries with ``<`` only: two floats, in C, with no tuple to walk (before, an
    entry was ``(when, nan, handle)``: a tuple comparison, i.e. an equality and an order test of
    the due times, on each of the heap's steps, 2% of a race seed's instructions). Two entries due
    at the same time compare as neither earlier, as the handles themselves did (asyncio compares
    them by due time only) and as the NaN middle of the tuples did: the heap evolves as before and
    every seed keeps its trace."""

    __slots__ = ("handle",)
    handle: asyncio.TimerHandle


_new_handle = object.__new__
_Task = asyncio.Task


def _shuffle(batch: list[Any], getrandbits: Callable[[int], int]) -> None:
    """``random.Random.shuffle(batch)`` with its ``_randbelow`` inline: the same draws from the same
    generator, in the same order, so the same permutation (a seed keeps its trace), without two
    method calls per element. Two callbacks (over half the batches) take the one draw directly."""
    last = len(batch) - 1
    if last == 1:  # i = 1 below: n = 2, k = 2; j = 0 swaps the two
        j = getrandbits(2)
        while j >= 2:
            j = getrandbits(2)
        if not j:
            batch.reverse()
        return
    for i in range(last, 0, -1):
        n = i + 1
        k = n.bit_length()
        j = getrandbits(k)
        while j >= n:
            j = getrandbits(k)
        batch[i], batch[j] = batch[j], batch[i]


class SimLoop(asyncio.BaseEventLoop):
    """A deterministic event loop (see the module docstring)."""

    def __init__(self, rng: random.Random, *, shuffle: bool = True) -> None:
        super().__init__()
        self._now_s = 0.0
        self._rng = rng
        self._shuffle = shuffle
        self.network: Network | None = None
        self.callbacks_run = 0
        self.callbacks_dropped = 0
        self.errors: list[str] = []
        self._iterations_now = 0
        self.explorer: Any = None
        """Exhaustive mode (tests/simulation/exhaustive.py): orders each ready batch instead of
        the RNG (``explorer.order(loop, batch)``)."""
        self.dropped: list[asyncio.Handle] = []
        """A crashed node's callbacks, kept so that its tasks are not collected (and their
        ``finally`` blocks run) at a moment the garbage collector picks."""
        self.set_exception_handler(self._on_exception)
        self._ready: list[asyncio.Handle] = []  # type: ignore[assignment]  # swapped per batch
        # time(), asked by asyncio's timeouts and the code under test (and the clock seam), as a
        # C call that reads the attribute: no Python frame per call.
        self.time = functools.partial(getattr, self, "_now_s")  # type: ignore[method-assign]
        # create_future(), asked by every Future the code under test awaits: the class itself, no frame.
        self.create_future = functools.partial(asyncio.Future, loop=self)  # type: ignore[method-assign]

    # ------------------------------------------------------------------ time
    def time(self) -> float:  # replaced per instance by a C call doing the same (__init__)
        return self._now_s

    # Every Future and Task asks its loop this when it is made: a builtin answers without a frame.
    get_debug = staticmethod(bool)  # type: ignore[assignment]

    def create_task(
        self, coro: Any, *, name: str | None = None, context: contextvars.Context | None = None
    ) -> Any:
        """``BaseEventLoop.create_task`` without the checks a never-debug loop with no task factory
        does not need (the same task, the same name)."""
        if self._closed or self._task_factory is not None:
            return super().create_task(coro, name=name, context=context)
        return _Task(coro, loop=self, name=name, context=context)

    # ------------------------------------------------------------------ scheduling (lean)
    def call_soon(self, callback: Any, *args: Any, context: contextvars.Context | None = None) -> Any:
        handle = _new_handle(_Handle)  # _Handle.__init__, inline (one frame less per callback)
        handle._context = _copy_context() if context is None else context
        handle._loop = self
        handle._callback = callback
        handle._args = args
        handle._cancelled = False
        self._ready.append(handle)
        return handle

    call_soon_threadsafe = call_soon  # one thread: nothing to wake

    def call_at(
        self, when: float, callback: Any, *args: Any, context: contextvars.Context | None = None
    ) -> Any:
        if when is None:
            raise TypeError("when cannot be None")
        timer = _new_handle(_TimerHandle)
        timer._context = _copy_context() if context is None else context
        timer._loop = self
        timer._callback = callback
        timer._args = args
        timer._cancelled = False
        timer._when = when
        timer._scheduled = True
        due = _Due(when)
        due.handle = timer
        _heappush(self._scheduled, due)
        return timer

    def call_later(
        self, delay: float, callback: Any, *args: Any, context: contextvars.Context | None = None
    ) -> Any:
        if delay is None:
            raise TypeError("delay must not be None")
        when = self._now_s + delay
        timer = _new_handle(_TimerHandle)
        timer._context = _copy_context() if context is None else context
        timer._loop = self
        timer._callback = callback
        timer._args = args
        timer._cancelled = False
        timer._when = when
        timer._scheduled = True
        due = _Due(when)
        due.handle = timer
        _heappush(self._scheduled, due)
        return timer

    # ------------------------------------------------------------------ the scheduler
    def _run_once(self) -> None:
        """Iterations until the loop is told to stop (``run_forever`` calls this once per
        ``_stopping`` check; looping here saves that call per iteration, nothing else changes).

        The timer heap holds :class:`_Due` entries: compared in C, and in the same order as the
        handles themselves (by due time only: on a tie neither is earlier), so the heap evolves as
        it did with handles and every seed keeps its trace.
        The ready batch is shuffled by :func:`_shuffle`, ``random.shuffle``'s own algorithm."""
        scheduled = self._scheduled
        heappop = heapq.heappop
        rng = self._rng
        getrandbits = rng.getrandbits if self._shuffle and type(rng) is random.Random else None
        shuffle = rng.shuffle if self._shuffle else None
        node_var = NODE
        nobody = _NOBODY
        dropped = self.dropped
        now = self._now_s
        iterations = self._iterations_now  # a local while this runs (stored back on the way out)
        spare: list[asyncio.Handle] = []  # two lists take turns as the ready queue: none made per batch
        try:
            while True:
                ready = self._ready
                if not ready:
                    while True:
                        if not scheduled:
                            if self._stopping:
                                return
                            raise Deadlock(
                                "nothing is ready and no timer is set, but the awaited operation is pending"
                            )
                        handle = scheduled[0].handle
                        if not handle._cancelled:
                            break
                        self._pop_timer()
                    if handle._when > now:
                        self._now_s = now = handle._when
                        iterations = 0
                    heappop(scheduled)  # due, not cancelled: what the loop below takes first
                    handle._scheduled = False
                    ready.append(handle)
                iterations += 1
                if iterations > ITERATIONS_AT_ONE_INSTANT_MAX:
                    raise Livelock(f"{ITERATIONS_AT_ONE_INSTANT_MAX} loop iterations at t={now:.6f} s")
                while scheduled and scheduled[0] <= now:
                    handle = heappop(scheduled).handle
                    handle._scheduled = False
                    if handle._cancelled:
                        self._timer_cancelled_count = max(0, self._timer_cancelled_count - 1)
                    else:
                        ready.append(handle)
                batch = ready
                self._ready = spare  # empty: what this batch's callbacks schedule goes there
                if len(batch) > 1:
                    if self.explorer is not None:
                        batch = self.explorer.order(self, batch)
                    elif getrandbits is not None:
                        _shuffle(batch, getrandbits)
                    elif shuffle is not None:
                        shuffle(batch)
                ran = 0
                for handle in batch:
                    if handle._cancelled:
                        continue
                    context = handle._context
                    if context.get(node_var, nobody).dead:
                        self.callbacks_dropped += 1
                        dropped.append(handle)
                        continue
                    ran += 1
                    try:  # Handle._run, inline (a task's step has no arguments: no tuple to build)
                        args = handle._args
                        if args:
                            context.run(handle._callback, *args)
                        else:
                            context.run(handle._callback)
                    except (SystemExit, KeyboardInterrupt):
                        self.callbacks_run += ran
                        raise
                    except BaseException as exc:
                        callback = format_helpers._format_callback_source(handle._callback, handle._args)
                        self.call_exception_handler(
                            {
                                "message": f"Exception in callback {callback}",
                                "exception": exc,
                                "handle": handle,
                            }
                        )
                self.callbacks_run += ran
                ready.clear()  # run (an explorer's order is a list of its own): the next spare
                spare = ready
                if self._stopping:
                    return
        finally:
            self._iterations_now = iterations

    def _pop_timer(self) -> asyncio.TimerHandle:
        handle: asyncio.TimerHandle = heapq.heappop(self._scheduled).handle
        handle._scheduled = False
        if handle._cancelled:
            self._timer_cancelled_count = max(0, self._timer_cancelled_count - 1)
        return handle

    def _write_to_self(self) -> None:
        pass  # no selector to wake: everything runs on this one thread

    def _process_events(self, event_list: Any) -> None:
        pass

    # ------------------------------------------------------------------ no threads
    def run_in_executor(self, executor: Executor | None, func: Callable[..., Any], *args: Any) -> Any:
        if executor is None:
            raise RuntimeError("the simulation has no default executor: pass one from the threads seam")
        run_inline = getattr(executor, "run_inline", None)
        if run_inline is not None:  # the simulation's inline executor: no concurrent future between
            return run_inline(self, func, args)
        return super().run_in_executor(executor, func, *args)

    # ------------------------------------------------------------------ no sockets
    async def create_server(
        self, protocol_factory: Any, host: Any = None, port: Any = None, **kw: Any
    ) -> Any:
        assert self.network is not None, "no simulated network attached"
        return self.network.listen(protocol_factory, str(host), int(port or 0))

    async def create_connection(  # type: ignore[override]
        self,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        host: str | None = None,
        port: int | None = None,
        **kw: Any,
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        assert self.network is not None, "no simulated network attached"
        return await self.network.connect(protocol_factory, str(host), int(port or 0))

    async def getaddrinfo(self, *args: Any, **kw: Any) -> Any:
        raise OSError("no name resolution in the simulation")

    # ------------------------------------------------------------------ errors
    def _on_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "was destroyed but it is pending" in message:
            return  # a crashed node's tasks, collected whenever the GC runs: not part of the history
        exception = context.get("exception")
        self.errors.append(f"{message}: {exception!r}" if exception is not None else message)
