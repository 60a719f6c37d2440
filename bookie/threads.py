"""The only door from the bookie to threads (beside :mod:`bookie.fileio`, its door to the disk).

The bookie runs blocking work off the event loop in two shapes: the journal's one writer thread
(a bare thread on a queue, :mod:`bookie.journal`) and small executors for reads, recovery and cold
paths (:mod:`bookie.storage`). Both are made here, through a :class:`Threads` passed down from
:meth:`Storage.open <bookie.storage.Storage.open>` (default :data:`OS_THREADS`: real threads and
``ThreadPoolExecutor``), so a deterministic simulation can pass a twin that runs the work inline
or on its own schedule (docs/internals.md §2, the seams). Production pays one call per thread or
executor made, at startup: nothing on the hot path. Time goes through the other seam,
:class:`bookkeeper_aio.common.clock.Clock`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol


class GilShare:
    """For a long pure-Python job on a worker thread (decoding a checkpoint, replaying the journal):
    call :meth:`tick` once per step; about every ``interval_s`` it lets go of the GIL
    (``time.sleep(0)``), so an event loop waiting for it takes it at once instead of after the
    interpreter's switch interval, and then some. A loop-lag probe beside a spinning thread on a
    loaded 2-core machine (docs/benchmarks.md, issue 19): p50 7-9 ms and p99 65-74 ms, against
    0.5-0.7 ms and 13-27 ms with this. It changes no result, only when the other threads run."""

    __slots__ = ("_interval_s", "_next", "_steps")

    def __init__(self, interval_s: float = 0.001) -> None:
        self._interval_s = interval_s
        self._next = time.perf_counter() + interval_s
        self._steps = 0

    def tick(self) -> None:
        self._steps += 1
        if self._steps & 63:  # the clock is read every 64 steps (a step is a row or a record)
            return
        if time.perf_counter() >= self._next:
            time.sleep(0)
            self._next = time.perf_counter() + self._interval_s


class Thread(Protocol):
    def join(self) -> None:
        """Wait until the thread's target returned."""
        ...


class Worker(Protocol):
    def submit(self, item: Any) -> None:
        """Queue ``item`` for the worker's handler (never blocks)."""
        ...

    def stop(self) -> None:
        """Handle everything submitted so far, then end the worker (blocks until it has)."""
        ...


class Threads(Protocol):
    def start_thread(self, target: Callable[[], None], name: str) -> Thread:
        """Run ``target`` on a new (daemon) thread named ``name``, started at once."""
        ...

    def start_worker(self, handle: Callable[[Any], None], name: str) -> Worker:
        """A thread named ``name`` that calls ``handle(item)`` for each submitted item, in order,
        one at a time (the journal's writer). A simulation runs each call on its own schedule."""
        ...

    def executor(self, name: str) -> Executor:
        """A one-worker executor for blocking calls (``loop.run_in_executor``); its owner shuts it
        down. One worker: each user (reads, cold writes, recovery) is sequential by design."""
        ...


class OsThreads:
    """Real threads."""

    __slots__ = ()

    def start_thread(self, target: Callable[[], None], name: str) -> Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def start_worker(self, handle: Callable[[Any], None], name: str) -> Worker:
        return _QueueWorker(self, handle, name)

    def executor(self, name: str) -> Executor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


class _QueueWorker:
    """A bare thread on a ``SimpleQueue`` (C put/get, the GIL released while idle): a thread
    pool's futures cost more per item. ``submit`` is the queue's own ``put``: no extra call."""

    __slots__ = ("_handle", "_queue", "_thread", "submit")

    def __init__(self, threads: Threads, handle: Callable[[Any], None], name: str) -> None:
        self._handle = handle
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.submit = self._queue.put
        self._thread = threads.start_thread(self._run, name)

    def _run(self) -> None:
        handle, get = self._handle, self._queue.get
        while (item := get()) is not _STOP:
            handle(item)

    def stop(self) -> None:
        self._queue.put(_STOP)
        self._thread.join()


_STOP = object()


OS_THREADS: Threads = OsThreads()
