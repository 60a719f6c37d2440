"""Ensemble placement: which bookies store a new ledger, and who replaces a failed one.

Pure (no I/O); the random generator is injected so tests are deterministic. The client hands a
policy the *writable* bookies it knows (read-only bookies are never offered) and the bookies to
avoid (the current ensemble, bookies that failed for this handle).

Policies implement :class:`PlacementPolicy`. :class:`RandomPlacement` is the default;
:class:`RackAwarePlacement` spreads an ensemble over as many racks (or zones) as it can.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from bookkeeper_aio.errors import NotEnoughBookies


class PlacementPolicy(Protocol):
    def new_ensemble(self, size: int, writable: Sequence[str], exclude: Collection[str] = ()) -> list[str]:
        """``size`` distinct bookies from ``writable`` minus ``exclude``. Raises NotEnoughBookies."""
        ...

    def replace_bookie(
        self, ensemble: Sequence[str], position: int, writable: Sequence[str], exclude: Collection[str] = ()
    ) -> str:
        """A bookie for ``ensemble[position]``: writable, not in the ensemble, not excluded.
        Raises NotEnoughBookies."""
        ...


class RandomPlacement:
    """Uniformly random choice among the eligible bookies."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def new_ensemble(self, size: int, writable: Sequence[str], exclude: Collection[str] = ()) -> list[str]:
        candidates = sorted(set(writable).difference(exclude))
        if len(candidates) < size:
            raise NotEnoughBookies(
                f"need {size} writable bookies, {len(candidates)} available ({sorted(set(writable))})"
            )
        return self._rng.sample(candidates, size)

    def replace_bookie(
        self, ensemble: Sequence[str], position: int, writable: Sequence[str], exclude: Collection[str] = ()
    ) -> str:
        candidates = sorted(set(writable).difference(exclude).difference(ensemble))
        if not candidates:
            raise NotEnoughBookies(
                f"no writable bookie to replace {ensemble[position]} (ensemble {list(ensemble)}, "
                f"writable {sorted(set(writable))}, excluded {sorted(set(exclude))})"
            )
        return self._rng.choice(candidates)


class RackAwarePlacement:
    """Spread each ensemble over distinct racks first, then fill randomly.

    ``racks`` maps a bookie id to its rack (or zone); unknown bookies share the rack ``"/default"``.
    A replacement prefers a rack not yet used by the rest of the ensemble.
    """

    DEFAULT_RACK = "/default"

    def __init__(self, racks: Mapping[str, str], rng: random.Random | None = None) -> None:
        self._racks = dict(racks)
        self._rng = rng or random.Random()

    def _rack(self, bookie: str) -> str:
        return self._racks.get(bookie, self.DEFAULT_RACK)

    def new_ensemble(self, size: int, writable: Sequence[str], exclude: Collection[str] = ()) -> list[str]:
        candidates = sorted(set(writable).difference(exclude))
        if len(candidates) < size:
            raise NotEnoughBookies(f"need {size} writable bookies, {len(candidates)} available")
        self._rng.shuffle(candidates)
        chosen: list[str] = []
        used_racks: set[str] = set()
        for bookie in candidates:  # first pass: one per rack
            if len(chosen) < size and self._rack(bookie) not in used_racks:
                chosen.append(bookie)
                used_racks.add(self._rack(bookie))
        for bookie in candidates:  # second pass: fill up
            if len(chosen) < size and bookie not in chosen:
                chosen.append(bookie)
        return chosen

    def replace_bookie(
        self, ensemble: Sequence[str], position: int, writable: Sequence[str], exclude: Collection[str] = ()
    ) -> str:
        candidates = sorted(set(writable).difference(exclude).difference(ensemble))
        if not candidates:
            raise NotEnoughBookies(f"no writable bookie to replace {ensemble[position]}")
        others = {self._rack(b) for i, b in enumerate(ensemble) if i != position}
        fresh = [b for b in candidates if self._rack(b) not in others]
        return self._rng.choice(fresh or candidates)
