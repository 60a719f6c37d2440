"""GET_LIST_OF_ENTRIES' ranges are built from an index snapshot by a scan of its bytes (C), with
Python work per range, not per entry (:func:`bookie.processor.entry_ranges`)."""

from __future__ import annotations

import random

import pytest

from bookie.index import LedgerIndex
from bookie.processor import TooManyRequests, entry_ranges
from bookkeeper_aio.protocol import messages as m


def _naive(entry_ids: list[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for entry_id in entry_ids:
        if ranges and ranges[-1][1] == entry_id - 1:
            ranges[-1][1] = entry_id
        else:
            ranges.append([entry_id, entry_id])
    return ranges


def _ranges(index: LedgerIndex) -> list[list[int]]:
    base, positions, _lengths, overflow = index.snapshot()
    return entry_ranges(base, positions.tobytes(), overflow[0::4].tolist())


@pytest.mark.parametrize("seed", range(40))
def test_ranges_are_those_of_the_entry_ids(seed: int) -> None:
    rng = random.Random(seed)
    index = LedgerIndex()
    count = rng.choice([0, 1, 5, 300, 3000])
    ids = set()
    for _ in range(count):
        entry_id = rng.choice(
            [rng.randrange(0, 4000), rng.randrange(0, 40), rng.randrange(10**6, 10**6 + 50)]
        )
        ids.add(entry_id)
        # Offsets with 0xff bytes: a present slot must never read as absent.
        index.put(entry_id, rng.choice([1, 255, 0x7FFFFFFF]), rng.choice([0, 0xFFFFFF, 0xFFFFFFFF]), 10)
    assert _ranges(index) == _naive(sorted(ids)) == _naive(index.entry_ids())


def test_striped_and_dense_ledgers() -> None:
    dense = LedgerIndex()
    striped = LedgerIndex()
    for entry_id in range(30_000):
        dense.put(entry_id, 1, entry_id * 10, 10)
        if entry_id % 3 != 1:  # ensemble 3, write quorum 2: every third entry elsewhere
            striped.put(entry_id, 1, entry_id * 10, 10)
    assert _ranges(dense) == [[0, 29_999]]
    assert _ranges(striped) == _naive(striped.entry_ids())
    assert len(_ranges(striped)) == 10_001  # [0, 0], then [3k + 2, 3k + 3]


def test_too_many_ranges_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    index = LedgerIndex()
    for entry_id in range(0, 100, 2):
        index.put(entry_id, 1, entry_id, 1)
    monkeypatch.setattr(m, "RANGES_MAX", 10)
    with pytest.raises(TooManyRequests):
        _ranges(index)
