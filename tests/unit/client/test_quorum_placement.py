"""Pure modules: striping, coverage, placement."""

from __future__ import annotations

import itertools
import random

import pytest

from bookkeeper_aio import NotEnoughBookies, RackAwarePlacement, RandomPlacement
from bookkeeper_aio.client.quorum import DistributionSchedule


def test_write_sets__match_seed_000_table() -> None:
    schedule = DistributionSchedule(4, 3, 2)
    assert [schedule.write_set(e) for e in range(6)] == [
        (0, 1, 2),
        (1, 2, 3),
        (2, 3, 0),
        (3, 0, 1),
        (0, 1, 2),
        (1, 2, 3),
    ]


def test_schedule__rejects_bad_quorums() -> None:
    with pytest.raises(ValueError, match="E >= Qw >= Qa"):
        DistributionSchedule(2, 3, 1)


def _brute_force_ensemble_coverage(e: int, qw: int, qa: int, answered: set[int]) -> bool:
    # Coverage: no Qa-subset of any write set is entirely unanswered.
    for start in range(e):
        ws = [(start + i) % e for i in range(qw)]
        for subset in itertools.combinations(ws, qa):
            if not any(p in answered for p in subset):
                return False
    return True


def test_coverage__matches_brute_force_for_all_small_configs() -> None:
    for e in range(1, 6):
        for qw in range(1, e + 1):
            for qa in range(1, qw + 1):
                schedule = DistributionSchedule(e, qw, qa)
                for size in range(e + 1):
                    for answered in itertools.combinations(range(e), size):
                        expected = _brute_force_ensemble_coverage(e, qw, qa, set(answered))
                        assert schedule.covers_ensemble(answered) == expected, (e, qw, qa, answered)


def test_random_placement__deterministic_with_seed_and_excludes() -> None:
    bookies = [f"b{i}" for i in range(6)]
    a = RandomPlacement(random.Random(3)).new_ensemble(3, bookies, exclude={"b0"})
    b = RandomPlacement(random.Random(3)).new_ensemble(3, bookies, exclude={"b0"})
    assert a == b
    assert "b0" not in a
    assert len(set(a)) == 3
    with pytest.raises(NotEnoughBookies):
        RandomPlacement().new_ensemble(3, bookies[:2])


def test_random_placement__replacement_avoids_ensemble_and_failed() -> None:
    policy = RandomPlacement(random.Random(1))
    for _ in range(50):
        new = policy.replace_bookie(["b0", "b1", "b2"], 0, ["b0", "b1", "b2", "b3", "b4"], exclude={"b3"})
        assert new == "b4"
    with pytest.raises(NotEnoughBookies):
        policy.replace_bookie(["b0", "b1", "b2"], 0, ["b0", "b1", "b2"])


def test_rack_aware__spreads_over_racks() -> None:
    racks = {"a1": "/r1", "a2": "/r1", "b1": "/r2", "b2": "/r2", "c1": "/r3"}
    policy = RackAwarePlacement(racks, random.Random(5))
    for _ in range(20):
        ensemble = policy.new_ensemble(3, list(racks))
        assert {racks[b] for b in ensemble} == {"/r1", "/r2", "/r3"}
    replacement = policy.replace_bookie(["a1", "b1", "c1"], 2, list(racks))
    assert replacement in {"a2", "b2"}


def test_encode_add_request__same_bytes_as_the_protocol_module() -> None:
    from bookkeeper_aio.protocol import messages as m
    from bookkeeper_aio.protocol.messages import encode_add_request

    for args in [(1, 2, 3, 0, b"k" * 32, b"body"), ((1 << 64) - 1, (1 << 63) - 1, 0, 1, b"", b"x" * 70000)]:
        assert encode_add_request(*args) == m.encode(m.AddEntryRequest(*args))
