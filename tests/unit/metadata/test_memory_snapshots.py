"""The memory twin's listing at an older revision against a copy of every state it went through."""

from __future__ import annotations

import random

import pytest

from metadata.memory import MemoryStore


@pytest.mark.parametrize("seed", range(5))
async def test_listing_at_any_revision_matches_the_state_at_that_revision(seed: int) -> None:
    rng = random.Random(seed)
    store = MemoryStore()
    names = [f"/p/{c}" for c in "abcdefgh"] + ["/p", "/q/x", "/pz"]
    states: dict[int, dict[str, bytes]] = {await store.current_revision(): {}}
    current: dict[str, bytes] = {}
    for step in range(120):
        key = rng.choice(names)
        if key in current and rng.random() < 0.4:
            await store.delete(key)
            del current[key]
        else:
            value = f"{step}".encode()
            await store.put(key, value)
            current[key] = value
        states[await store.current_revision()] = dict(current)
    for revision, state in states.items():
        for start_after in (None, "/p/", "/p/c", "/p/cc", "/p/h"):
            for limit in (1, 2, 3, 100):
                page = await store.list("/p/", start_after=start_after, limit=limit, revision=revision)
                expected = sorted(
                    k for k in state if k.startswith("/p/") and (start_after is None or k > start_after)
                )
                assert [kv.key for kv in page.items] == expected[:limit]
                assert [kv.value for kv in page.items] == [state[k] for k in expected[:limit]]
                assert page.more == (len(expected) > limit)
