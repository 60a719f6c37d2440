"""The GC pass's walks over a million ledgers give the event loop turns: the sorted snapshot of the
ledger ids (:func:`bookie.gc.sorted_ids`) and compaction's index walks over ledgers that hold no
entry. What is checked is that they are correct whatever the order, and that the loop turns while
they run (how long a turn takes is measured by ``benchmarks/gc_stall.py``, not asserted here)."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import pytest

from bookie import compaction
from bookie.gc import SORT_CHUNK, sorted_ids


async def _turns_during(work: Any) -> tuple[Any, int]:
    """``work``'s result, and how many times another task ran while it did."""
    turns = 0
    done = False

    async def count() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count())
    await asyncio.sleep(0)
    started = turns
    try:
        result = await work
    finally:
        done = True
        await counter
    return result, turns - started


@pytest.mark.parametrize("order", ["increasing", "shuffled", "decreasing blocks", "duplicated ranges"])
async def test_sorted_ids_sorts_in_slices_whatever_the_order(order: str) -> None:
    n = 5 * SORT_CHUNK + 123
    ids = list(range(7, 7 + 3 * n, 3))
    if order == "shuffled":
        random.Random(5).shuffle(ids)
    elif order == "decreasing blocks":
        ids = [i for start in range(0, n, 1000) for i in reversed(ids[start : start + 1000])]
    elif order == "duplicated ranges":  # interleaved halves: every chunk spans the whole range
        ids = [i for pair in zip(ids[: n // 2], ids[n // 2 :], strict=False) for i in pair] + ids[n - 1 :]
    table = dict.fromkeys(ids)
    result, turns = await _turns_during(sorted_ids(table))
    assert result == sorted(ids)
    assert turns >= 5  # one per chunk at least


async def test_sorted_ids_is_the_snapshot_taken_on_entry() -> None:
    table = dict.fromkeys(range(3 * SORT_CHUNK))
    task = asyncio.create_task(sorted_ids(table))
    await asyncio.sleep(0)  # started: the snapshot is taken
    for ledger_id in range(3 * SORT_CHUNK, 4 * SORT_CHUNK):
        table[ledger_id] = None  # made meanwhile: not in it
    del table[5]  # forgotten meanwhile: still in it
    assert await task == list(range(3 * SORT_CHUNK))
    assert await sorted_ids({}) == []
    assert await sorted_ids({3: None, 1: None}) == [1, 3]


async def test_compaction_walks_give_turns_over_ledgers_with_no_entry() -> None:
    """A million ledgers that hold no entry were visited in one go (~50 ms on the loop)."""
    empty = SimpleNamespace(index=SimpleNamespace(count=0))
    storage = SimpleNamespace(ledgers=dict.fromkeys(range(10 * compaction.WALK_SLOTS_PER_STEP), empty))
    usage, turns = await _turns_during(compaction.segment_usage(storage))  # type: ignore[arg-type]
    assert usage == {}
    assert turns >= 9
    found, turns = await _turns_during(compaction._live_entries(storage, frozenset({1})))  # type: ignore[arg-type]
    assert found == {1: []}
    assert turns >= 9
