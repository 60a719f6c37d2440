"""Unique 63-bit ids from a counter key, allocated in blocks with CAS.

The counter key holds the next unallocated id as ASCII decimal. A generator claims ``[n, n + block)`` by
CAS-ing the counter from ``n`` to ``n + block`` and then hands out ids from memory, so one store round
trip serves ``block_size`` ids (1000 creates/s need ~1 CAS/s). Uniqueness across processes and restarts
follows from the CAS: a block belongs to exactly one successful writer. A block whose CAS outcome is
unknown (`CasResultUnknown`) is never used: we re-read and claim a later one. Ids of a block left unused
at shutdown are skipped forever (the space is 2^63).
"""

from __future__ import annotations

import asyncio

from bookkeeper_aio.common.backoff import Backoff
from metadata.errors import (
    BadVersion,
    CasResultUnknown,
    MetadataError,
    MetadataFormatError,
    NodeExists,
    NoNode,
    UpdateRetriesExhausted,
)
from metadata.ledger_metadata import LEDGER_ID_MAX
from metadata.store import MetadataStore

FIRST_ID = 1  # id 0 is never handed out: it stays free as a "no ledger" marker for callers
BLOCK_SIZE_DEFAULT = 1000
BLOCK_SIZE_MAX = 1_000_000
CLAIM_ATTEMPTS_MAX = 100
# The pause after a lost claim: from 1 ms, doubling to 50 ms (jittered).
CONFLICT_PAUSE_S_INITIAL = 0.001
CONFLICT_PAUSE_S_MAX = 0.05
COUNTER_DIGITS_MAX = 19


def _decode_counter(key: str, raw: bytes) -> int:
    if not raw.isdigit() or len(raw) > COUNTER_DIGITS_MAX:
        raise MetadataFormatError(key, f"id counter is not a decimal number: {raw[:32]!r}")
    return int(raw)


class IdGenerator:
    """``await next_id()`` -> a never-repeating id in ``[1, 2^63 - 1]``. Safe for concurrent tasks."""

    def __init__(self, store: MetadataStore, key: str, *, block_size: int = BLOCK_SIZE_DEFAULT) -> None:
        if not 1 <= block_size <= BLOCK_SIZE_MAX:
            raise ValueError(f"block_size must be in [1, {BLOCK_SIZE_MAX}], got {block_size}")
        self._store = store
        self._key = key
        self._block_size = block_size
        self._next = 0
        self._end = 0
        self._lock = asyncio.Lock()

    async def next_id(self, after: int = 0) -> int:
        """An id larger than ``after`` (a block starting below it is dropped, and the next claimed
        block starts above it). Raises `MetadataUnavailable` (store down), `MetadataError` (id space
        exhausted)."""
        while self._next >= self._end or self._next <= after:
            async with self._lock:
                if self._next >= self._end or self._next <= after:
                    await self._claim_block(after)
        ledger_id = self._next
        self._next += 1
        return ledger_id

    async def _claim_block(self, after: int = 0) -> None:
        backoff = Backoff(initial_s=CONFLICT_PAUSE_S_INITIAL, max_s=CONFLICT_PAUSE_S_MAX)
        for _ in range(CLAIM_ATTEMPTS_MAX):
            current = await self._store.get(self._key)
            start = FIRST_ID if current is None else _decode_counter(self._key, current.value)
            start = max(start, after + 1)
            end = start + self._block_size
            if end - 1 > LEDGER_ID_MAX:
                raise MetadataError(f"id space exhausted at {start} (counter {self._key!r})")
            value = str(end).encode()
            try:
                if current is None:
                    await self._store.create(self._key, value)
                else:
                    await self._store.compare_and_set(self._key, value, current.version)
            except (BadVersion, NoNode, NodeExists, CasResultUnknown):
                # lost the race, or cannot know whether we won: claim a later block, after a short
                # pause (jittered, growing) so that contenders do not retry in lockstep
                await asyncio.sleep(backoff.next_delay_s())
                continue
            self._next, self._end = start, end
            return
        raise UpdateRetriesExhausted(self._key, CLAIM_ATTEMPTS_MAX)


async def read_counter(store: MetadataStore, key: str) -> int:
    """The next id the counter at ``key`` hands out (`FIRST_ID` when it was never claimed from)."""
    current = await store.get(key)
    return FIRST_ID if current is None else _decode_counter(key, current.value)


async def raise_counter(store: MetadataStore, key: str, at_least: int) -> tuple[int, int]:
    """Move the counter at ``key`` up to ``at_least`` (CAS; never down): no generator claims a block
    starting below it from then on. Returns (the counter before, the counter now); the two are
    equal when it already was at or above ``at_least``. For an operator after a metadata restore
    (docs/operations.md): a generator that still holds a block claimed before keeps handing its ids
    out, so no client may run meanwhile. Raises `MetadataUnavailable`, `MetadataError` (past the
    id space), `UpdateRetriesExhausted`."""
    if not FIRST_ID <= at_least <= LEDGER_ID_MAX:
        raise MetadataError(f"cannot raise the id counter {key!r} to {at_least}: ids are 1..{LEDGER_ID_MAX}")
    backoff = Backoff(initial_s=CONFLICT_PAUSE_S_INITIAL, max_s=CONFLICT_PAUSE_S_MAX)
    before: int | None = None
    for _ in range(CLAIM_ATTEMPTS_MAX):
        current = await store.get(key)
        counter = FIRST_ID if current is None else _decode_counter(key, current.value)
        if before is None:
            before = counter
        if counter >= at_least:
            return before, counter
        try:
            if current is None:
                await store.create(key, str(at_least).encode())
            else:
                await store.compare_and_set(key, str(at_least).encode(), current.version)
        except (BadVersion, NoNode, NodeExists, CasResultUnknown):
            await asyncio.sleep(backoff.next_delay_s())  # read again: a claim moved it, or ours did
            continue
        return before, at_least
    raise UpdateRetriesExhausted(key, CLAIM_ATTEMPTS_MAX)
