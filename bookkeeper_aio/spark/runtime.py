"""A private event loop for each piece of work Spark hands us (a partition, a commit, a plan).

Spark calls the data source synchronously, in Python worker processes it may reuse for many
tasks, and pickles the objects it calls. So nothing async lives on those objects: each call opens
its own loop (uvloop), its own ``BookKeeper.connect(url)``, does its work and closes both before
returning, or, for a partition's rows, when the generator is exhausted or closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

import uvloop

T = TypeVar("T")


def run(work: Callable[[], Awaitable[T]]) -> T:
    """``work()`` to completion on a fresh loop; the loop is closed before returning."""

    async def main() -> T:
        return await work()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def iterate(produce: Callable[[], AsyncIterator[T]]) -> Iterator[T]:
    """The items of ``produce()`` as a plain iterator, on a loop of its own. Closing the iterator
    early (Spark stops reading a partition, a limit) closes the async iterator on its loop first,
    so its ``finally`` blocks (closing the client) run."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        items = produce()

        async def step() -> tuple[bool, T | None]:
            try:
                return True, await anext(items)
            except StopAsyncIteration:
                return False, None

        async def close() -> None:
            aclose = getattr(items, "aclose", None)
            if aclose is not None:
                await aclose()

        try:
            while True:
                more, item = runner.run(step())
                if not more:
                    return
                yield item  # type: ignore[misc]
        finally:
            runner.run(close())
