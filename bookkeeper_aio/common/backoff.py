"""Capped exponential backoff with jitter, for reconnects and keepalive retries."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# One generator for all backoffs: seeding a Random per call costs ~14 us (os.urandom), and a Backoff is
# created for every store call.
_SHARED_RNG = random.Random()


@dataclass(slots=True)
class Backoff:
    """``next_delay_s()`` grows from ``initial_s`` by ``factor`` up to ``max_s``; ``reset()`` after success.

    Jitter draws each delay from [delay/2, delay] so that clients that failed together retry apart.
    """

    initial_s: float = 0.05
    max_s: float = 1.0
    factor: float = 2.0
    rng: random.Random = field(default=_SHARED_RNG)
    _current_s: float = 0.0

    def next_delay_s(self) -> float:
        self._current_s = (
            self.initial_s if self._current_s == 0.0 else min(self.max_s, self._current_s * self.factor)
        )
        return self._current_s * self.rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._current_s = 0.0
