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

import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Protocol


class Thread(Protocol):
    def join(self) -> None:
        """Wait until the thread's target returned."""
        ...


class Threads(Protocol):
    def start_thread(self, target: Callable[[], None], name: str) -> Thread:
        """Run ``target`` on a new (daemon) thread named ``name``, started at once."""
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

    def executor(self, name: str) -> Executor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


OS_THREADS: Threads = OsThreads()
