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
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Protocol


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
