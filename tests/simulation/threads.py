"""The bookie's thread seam (bookie.threads.Threads) without threads.

- The journal's writer (``start_worker``) becomes a chain of loop callbacks: each submitted group
  is written after a random disk latency, in submission order, one at a time (as the thread would).
  Its completion comes back through ``call_soon_threadsafe``, which on the simulated loop is just
  ``call_soon``; a crash drops both with the node's incarnation.
- Executors run their calls inline: reads, cold writes and recovery take no simulated time.
- A bare thread is refused: nothing in the bookie may block the simulation.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from asyncio.futures import _convert_future_exc  # type: ignore[attr-defined]
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

from bookie.threads import Thread, Worker
from tests.simulation.loop import SimLoop

SYNC_S_MIN = 0.0001
SYNC_S_MAX = 0.002


class _InlineExecutor(Executor):
    at_once = False
    """Set by :meth:`SimThreads.at_once`: :meth:`run_inline` hands back a future already done."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass

    def run_inline(self, loop: SimLoop, fn: Callable[..., Any], args: tuple[Any, ...]) -> asyncio.Future[Any]:
        """``loop.run_in_executor(self, fn, *args)`` without the concurrent future in between, and
        with the same loop steps as asyncio's chaining of one: the result lands one callback later,
        and completing the future schedules a no-op first (where ``_chain_future``'s cancel check
        was), so every seed keeps its trace."""
        future = loop.create_future()
        if self.at_once:  # nothing awaits it yet: done now, no callback scheduled
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(_convert_future_exc(exc))
            return future
        future.add_done_callback(_no_cancel_to_forward)
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        loop.call_soon(_settle, future, result, error)
        return future


def _no_cancel_to_forward(future: asyncio.Future[Any]) -> None:
    """The call already ran: a cancelled awaiter has nothing to cancel."""


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(_convert_future_exc(error))
    else:
        future.set_result(result)


class _SimWorker:
    """Items run one at a time after a disk latency each; :meth:`interrupt` runs the one in
    flight at once, for a crash to cut it in the middle (its fdatasync never happens)."""

    def __init__(self, loop: SimLoop, rng: random.Random, handle: Callable[[Any], None]) -> None:
        self._loop = loop
        self._rng = rng
        self._handle = handle
        self._queue: deque[Any] = deque()
        self._busy = False

    def submit(self, item: Any) -> None:
        self._queue.append(item)
        if not self._busy:
            self._next()

    def _next(self) -> None:
        self._busy = bool(self._queue)
        if self._busy:
            # Random.uniform(a, b) is a + (b - a) * random(): written out (the same draw and float)
            self._loop.call_later(SYNC_S_MIN + (SYNC_S_MAX - SYNC_S_MIN) * self._rng.random(), self._run)

    def _run(self) -> None:
        if self._queue:  # empty when stop() wrote everything meanwhile
            self._handle(self._queue.popleft())
        self._next()

    @property
    def busy(self) -> bool:
        return self._busy

    def interrupt(self) -> None:
        """Start the item in flight now (the caller has made syncs no-ops: a crash mid-write)."""
        if self._queue:
            self._handle(self._queue.popleft())

    def stop(self) -> None:
        while self._queue:  # a graceful close: what was submitted is written now
            self._handle(self._queue.popleft())


class SimThreads:
    def __init__(self, loop: SimLoop, rng: random.Random) -> None:
        self._loop = loop
        self._rng = rng
        self.workers: list[_SimWorker] = []
        self.executors: list[_InlineExecutor] = []

    @property
    def syncing(self) -> bool:
        """Whether a journal group is between its submission and its fdatasync."""
        return any(worker.busy for worker in self.workers)

    def start_thread(self, target: Callable[[], None], name: str) -> Thread:
        raise RuntimeError(f"no threads in the simulation (asked for {name!r})")

    def start_worker(self, handle: Callable[[Any], None], name: str) -> Worker:
        worker = _SimWorker(self._loop, self._rng, handle)
        self.workers.append(worker)
        return worker

    def executor(self, name: str) -> Executor:
        executor = _InlineExecutor()
        self.executors.append(executor)
        return executor

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Within it, a call run on this bookie's executors is done when ``run_in_executor``
        returns: a coroutine awaiting one goes on without yielding to the loop (the final checks
        read every replica of every entry through the bookie's own read path this way, which
        cost a tenth of a seed's loop callbacks when each read took three)."""
        for executor in self.executors:
            executor.at_once = True
        try:
            yield
        finally:
            for executor in self.executors:
                executor.at_once = False
