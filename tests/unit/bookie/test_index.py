"""The per-ledger index: dense arrays plus an overflow dict, same answers as a plain dict."""

from __future__ import annotations

import itertools
import random

from hypothesis import given
from hypothesis import strategies as st

from bookie.index import (
    DENSE_GAP_MAX,
    DENSITY_MIN,
    SPARSE_SLOTS_MAX,
    LedgerIndex,
    Location,
    segment_position,
    split_position,
)


def test_an_overflow_entry_moves_into_the_arrays_when_they_grow_over_it() -> None:
    index = LedgerIndex()
    index.put(0, 1, 0, 1)
    far = DENSE_GAP_MAX + 1025  # just beyond the reach of the first growth: overflow
    index.put(far, 1, 1, 2)
    index.put(1024, 1, 2, 3)  # the arrays grow; ``far`` is now within their reach
    index.put(far, 1, 3, 4)
    assert index.items() == [(0, Location(1, 0, 1)), (1024, Location(1, 2, 3)), (far, Location(1, 3, 4))]
    assert len(index) == 3
    assert far in index


def test_dense_sparse_and_far_ids() -> None:
    index = LedgerIndex()
    assert index.get(0) is None
    assert 0 not in index
    index.put(5, 1, 100, 50)
    index.put(7, 2, 4_000_000_000, 60)
    index.put(5 + 10 * DENSE_GAP_MAX, 3, 0, 70)  # far: overflow, no huge array
    index.put(2, 4, 16, 80)  # below the base: overflow
    assert index.get(5) == Location(1, 100, 50)
    assert index.get(7) == Location(2, 4_000_000_000, 60)
    assert index.get(6) is None
    assert index.get(2) == Location(4, 16, 80)
    assert index.get(5 + 10 * DENSE_GAP_MAX) == Location(3, 0, 70)
    assert index.entry_ids() == [2, 5, 7, 5 + 10 * DENSE_GAP_MAX]
    assert len(index) == 4
    assert index.last_entry_id == 5 + 10 * DENSE_GAP_MAX
    index.put(5, 9, 9, 9)  # replace
    assert len(index) == 4
    assert index.get(5) == Location(9, 9, 9)


@given(st.lists(st.tuples(st.integers(0, 3 * DENSE_GAP_MAX), st.integers(1, 1000)), max_size=200))
def test_matches_a_dict(puts: list[tuple[int, int]]) -> None:
    index = LedgerIndex()
    model: dict[int, Location] = {}
    for entry_id, segment in puts:
        location = Location(segment, entry_id * 7 % (1 << 32), entry_id % 5000)
        index.put(entry_id, *location)
        model[entry_id] = location
    assert index.items() == sorted(model.items())
    assert len(index) == len(model)
    assert index.last_entry_id == max(model, default=-1)
    probe = random.Random(len(puts)).randrange(0, 3 * DENSE_GAP_MAX)
    assert index.get(probe) == model.get(probe)
    assert (probe in index) == (probe in model)


def test_checkpoint_round_trip_keeps_everything() -> None:
    from bookie import checkpoint
    from bookie.journal_format import Position
    from bookie.ledger_state import LedgerState

    state = LedgerState(7)
    state.master_key = b"k" * 32
    state.fenced = True
    state.piggyback_lac = 41
    state.explicit_lac = 45
    state.lac_body = b"body"
    for entry_id in [*range(0, 50, 3), 10 * DENSE_GAP_MAX]:
        state.index.put(entry_id, 2, entry_id * 10, 100)
    position, ledgers = checkpoint.decode(checkpoint.encode(Position(3, 1234), [state, LedgerState(8)]))
    assert position == Position(3, 1234)
    got = ledgers[7]
    assert (got.master_key, got.fenced, got.lac, got.lac_body) == (b"k" * 32, True, 45, b"body")
    assert got.index.items() == state.index.items()
    assert len(got.index) == len(state.index)
    assert got.index.last_entry_id == 10 * DENSE_GAP_MAX
    assert len(ledgers[8].index) == 0


@given(
    st.lists(st.tuples(st.integers(-5, 3 * DENSE_GAP_MAX), st.integers(1, 1000)), max_size=200),
    st.lists(st.integers(0, 200), max_size=6),
)
def test_put_run_matches_put(puts: list[tuple[int, int]], cuts: list[int]) -> None:
    """``put_run`` (a journal group's adds of a ledger, back to back, in one loop) leaves the index
    exactly as ``put`` one by one: dense, sparse, overflow, replaced, and ids that grow the arrays
    mid-run."""
    segment_id, start_offset = 3, 16
    one_by_one, in_runs = LedgerIndex(), LedgerIndex()
    offset = start_offset
    for entry_id, length in puts:
        one_by_one.put(abs(entry_id), segment_id, offset, length)
        offset += length
    bounds = sorted({0, len(puts), *(min(cut, len(puts)) for cut in cuts)})
    offset = start_offset
    for start, stop in itertools.pairwise(bounds):
        run = puts[start:stop]
        in_runs.put_run(segment_id, offset, [abs(e) for e, _ in run], [length for _, length in run])
        offset += sum(length for _, length in run)
    assert in_runs.items() == one_by_one.items()
    assert len(in_runs) == len(one_by_one)
    assert in_runs.last_entry_id == one_by_one.last_entry_id
    assert [list(part) if not isinstance(part, int) else part for part in in_runs.snapshot()] == [
        list(part) if not isinstance(part, int) else part for part in one_by_one.snapshot()
    ]


@given(
    st.integers(0, 40),
    st.lists(st.tuples(st.integers(1, 3), st.integers(1, 1000), st.booleans()), min_size=1, max_size=300),
    st.lists(st.integers(0, 300), max_size=6),
)
def test_put_run_of_a_writer_matches_put(
    first: int, steps: list[tuple[int, int, bool]], cuts: list[int]
) -> None:
    """A writer's runs (ids rising, one in E/Qw with striping) take ``put_run``'s path with no test
    per entry when wholly past the last entry held; a run with an id sent twice does not (it is not
    rising). Either way: the same index as ``put`` one by one, its count included."""
    puts, entry_id = [], first
    for step, length, again in steps:
        puts.append((entry_id, length))
        if again:
            puts.append((entry_id, length + 1))
        entry_id += step
    segment_id, start_offset = 3, 16
    one_by_one, in_runs = LedgerIndex(), LedgerIndex()
    offset = start_offset
    for entry_id, length in puts:
        one_by_one.put(entry_id, segment_id, offset, length)
        offset += length
    bounds = sorted({0, len(puts), *(min(cut, len(puts)) for cut in cuts)})
    offset = start_offset
    for start, stop in itertools.pairwise(bounds):
        run = puts[start:stop]
        in_runs.put_run(segment_id, offset, [e for e, _ in run], [length for _, length in run])
        offset += sum(length for _, length in run)
    assert in_runs.items() == one_by_one.items()
    assert len(in_runs) == len(one_by_one) == len({e for e, _ in puts})
    assert in_runs.last_entry_id == one_by_one.last_entry_id


@given(
    st.lists(st.tuples(st.integers(0, 3 * DENSE_GAP_MAX), st.integers(1, 1000)), max_size=200),
    st.integers(0, 3 * DENSE_GAP_MAX),
    st.integers(1, 300),
    st.integers(1, 64),
)
def test_run_is_get_up_to_the_first_absent(
    puts: list[tuple[int, int]], first: int, count_max: int, step: int
) -> None:
    """``run`` (what a batch read asks) gives the locations ``get`` gives for ``first``, ``+ step``,
    ... up to ``count_max`` and before the first absent one: dense slices, overflow or both."""
    index = LedgerIndex()
    for entry_id, segment in puts:
        index.put(entry_id, segment, entry_id * 7 % (1 << 32), entry_id % 5000 + 1)
    if puts and first % 2:  # start on an entry that exists half the time
        first = puts[first % len(puts)][0]
    expected = []
    for entry_id in range(first, first + count_max * step, step):
        location = index.get(entry_id)
        if location is None:
            break
        expected.append(location)
    positions, lengths = index.run(first, count_max, step)
    got = [Location(*split_position(p), length) for p, length in zip(positions, lengths, strict=True)]
    assert got == expected
    assert all(segment_position(*split_position(p)) == p for p in positions)


def test_empty_indexes_share_nothing_they_change_and_know_their_segments() -> None:
    first, second = LedgerIndex(), LedgerIndex()
    first.put(5, 3, 16, 40)
    first.put(10 * DENSE_GAP_MAX, 9, 16, 40)  # the overflow
    assert (len(second), second.get(5), second.get(10 * DENSE_GAP_MAX)) == (0, None, None)
    second.put(7, 4, 16, 40)
    assert first.segment_ids() == {3, 9}
    assert second.segment_ids() == {4}
    assert LedgerIndex().segment_ids() == set()


def test_ids_each_just_past_the_reach_of_the_arrays_do_not_grow_them_without_bound() -> None:
    """Ids each DENSE_GAP_MAX - 1 past the arrays' end made them grow by half at every put (25 adds
    of 100 bytes: 16 GiB, kept by checkpoints and replay); they now hold at most DENSITY_MIN slots
    per entry (past SPARSE_SLOTS_MAX), the rest going to the overflow — and stay correct."""
    index = LedgerIndex()
    entry_id = 0
    put: list[int] = []
    for i in range(40):
        index.put(entry_id, 1, i, 100)
        put.append(entry_id)
        entry_id = max(index._base + len(index._positions), entry_id + 1) + DENSE_GAP_MAX - 1
    assert len(index._positions) <= max(SPARSE_SLOTS_MAX, (len(put) + 1) * DENSITY_MIN)
    assert index.entry_ids() == put
    assert all(index.get(e) == Location(1, i, 100) for i, e in enumerate(put))


def test_a_striped_ledger_stays_in_the_arrays() -> None:
    """One entry in DENSITY_MIN (a bookie of E = 16, Qw = 1) is dense enough: no overflow."""
    index = LedgerIndex()
    for entry_id in range(3, 100_000, DENSITY_MIN):
        index.put(entry_id, 1, entry_id, 10)
    assert not index._overflow
    assert len(index) == len(range(3, 100_000, DENSITY_MIN))
