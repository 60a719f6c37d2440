"""LogLimiter: the same key at most once per interval; memory bounded by its key count."""

from __future__ import annotations

import pytest

from bookkeeper_aio.common import log_limit
from bookkeeper_aio.common.log_limit import LogLimiter


def test_a_key_is_due_once_per_interval_and_memory_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(log_limit.time, "monotonic", lambda: now[0])
    limiter = LogLimiter(60.0, keys_max=3)
    assert limiter.due("a")
    assert not limiter.due("a")
    assert limiter.due("b")
    now[0] += 59.0
    assert not limiter.due("a")
    now[0] += 1.0
    assert limiter.due("a")
    for key in "cdefg":  # past keys_max the memory is cleared, never grown
        assert limiter.due(key)
    assert len(limiter._last) <= 3
