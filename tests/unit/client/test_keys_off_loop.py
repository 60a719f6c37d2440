"""Ledger keys are derived off the event loop: PBKDF2 (~5 ms) on the loop would stall every append
in flight, e.g. a log writer's while its roll creates the next ledger (docs/benchmarks.md)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper, RandomPlacement, Unauthorized
from bookkeeper_aio.client import keys
from bookkeeper_aio.client.context import StaticDirectory
from metadata.ledger_manager import LedgerManager
from tests.unit.client.conftest import FAST


class RecordingExecutor(ThreadPoolExecutor):
    """A real worker thread that records the thread each submitted call ran on."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.threads: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def run() -> Any:
            self.threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return super().submit(run)


async def test_derive_keys_runs_pbkdf2_in_the_executor_once_per_salt() -> None:
    executor = RecordingExecutor()
    salt = random.randbytes(16)
    first = await keys.derive_keys(b"pw", salt, 1000, executor)
    again = await keys.derive_keys(b"pw", salt, 1000, executor)
    other = await keys.derive_keys(b"other", salt, 1000, executor)
    executor.shutdown()
    assert first == again != other
    assert len(executor.threads) == 2  # the second derivation of the same triple is cached
    assert threading.current_thread().name not in executor.threads
    assert first == keys.ledger_keys(b"pw", salt, 1000)


async def test_create_and_open_derive_in_the_clients_executor(
    ledgers: LedgerManager, directory: StaticDirectory
) -> None:
    executor = RecordingExecutor()
    bk = BookKeeper(
        ledgers,
        directory,
        config=FAST,
        placement=RandomPlacement(random.Random(3)),
        key_executor=executor,
    )
    try:
        lh = await bk.create_ledger(3, 2, 2, password=b"secret")
        await lh.append(b"x")
        await lh.close()
        keys._cache.clear()  # as in another process: the open derives again
        rh = await bk.open_ledger(lh.id, password=b"secret")
        assert [e.payload async for e in rh.read(0, 0)] == [b"x"]
        with pytest.raises(Unauthorized):
            await bk.open_ledger(lh.id, password=b"wrong")
    finally:
        await bk.close()
        executor.shutdown()
    assert len(executor.threads) == 3  # create, open, the wrong password's open
    assert threading.current_thread().name not in executor.threads
