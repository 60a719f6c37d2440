"""A bound on how often the same warning is logged, per key (a bad key seen on every listing)."""

from __future__ import annotations

import time


class LogLimiter:
    """``due(key)`` is true at most once per ``interval_s`` for each key; at most ``keys_max`` keys
    are remembered (then all are forgotten: a burst of new keys logs again, never grows memory)."""

    __slots__ = ("_interval_s", "_keys_max", "_last")

    def __init__(self, interval_s: float, keys_max: int = 1024) -> None:
        self._interval_s = interval_s
        self._keys_max = keys_max
        self._last: dict[str, float] = {}

    def due(self, key: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -self._interval_s) < self._interval_s:
            return False
        if len(self._last) >= self._keys_max:
            self._last.clear()
        self._last[key] = now
        return True
