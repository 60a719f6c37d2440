"""The copy step and the periodic check at their seam (a scripted pool): which entries go to which
replacement, from which replica, verified; a missing entry everywhere is EntryUnavailable, never
skipped; the check finds missing and corrupt replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from bookkeeper_aio import ClientConfig
from bookkeeper_aio.autorecovery.auditor import check_ledger
from bookkeeper_aio.autorecovery.copier import FragmentCopy, RateLimiter, copy_fragment
from bookkeeper_aio.autorecovery.errors import EntryUnavailable, ReplicationError
from bookkeeper_aio.client.context import ClientContext
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import AddFlag, StatusCode
from bookkeeper_aio.protocol.digest import EntryCodec
from metadata.ledger_metadata import LedgerMetadata

LEDGER = 9
CODEC = EntryCodec("crc32c", b"pw")


class ScriptedPool:
    """Bookies as dicts of entry id -> body; records every request."""

    def __init__(self, stores: dict[str, dict[int, bytes]]) -> None:
        self.stores = stores
        self.reads: list[tuple[str, int]] = []
        self.batches: list[tuple[str, int]] = []
        self.adds: list[tuple[str, int, int, bytes]] = []
        self.answering: set[asyncio.Task[None]] = set()

    async def request(self, bookie_id: str, make: Callable[[int], Any], timeout_s: float) -> Any:
        request = make(1)
        if isinstance(request, m.ReadEntryRequest):
            self.reads.append((bookie_id, request.entry_id))
            body = self.stores[bookie_id].get(request.entry_id)
            if body is None:
                return m.ReadEntryResponse(1, int(StatusCode.ENOENTRY))
            return m.ReadEntryResponse(1, int(StatusCode.EOK), None, LEDGER, request.entry_id, body)
        if isinstance(request, m.BatchReadRequest):
            self.batches.append((bookie_id, request.start_entry_id))
            store = self.stores[bookie_id]
            bodies: list[bytes] = []
            entry_id = request.start_entry_id
            while entry_id in store and len(bodies) < request.max_count:
                bodies.append(store[entry_id])
                entry_id += request.step
            if not bodies:
                return m.BatchReadResponse(1, int(StatusCode.ENOENTRY))
            return m.BatchReadResponse(
                1, int(StatusCode.EOK), None, LEDGER, request.start_entry_id, bodies, -1, request.step
            )
        assert isinstance(request, m.AddEntryRequest)
        assert request.flags == int(AddFlag.RECOVERY_ADD)
        self.adds.append((bookie_id, request.entry_id, request.flags, request.master_key))
        self.stores.setdefault(bookie_id, {})[request.entry_id] = request.body
        return m.AddEntryResponse(1, int(StatusCode.EOK))

    def request_with_callback(
        self,
        bookie_id: str,
        make: Callable[[int], Any],
        callback: Callable[..., None],
        context: Any,
        timeout_s: float,
    ) -> int:
        async def answer() -> None:
            callback(context, bookie_id, await self.request(bookie_id, make, timeout_s))

        task = asyncio.get_running_loop().create_task(answer())
        self.answering.add(task)
        task.add_done_callback(self.answering.discard)
        return 1


def _ctx(pool: ScriptedPool) -> ClientContext:
    return cast(ClientContext, type("Ctx", (), {"pool": pool, "config": ClientConfig()})())


def _body(entry_id: int) -> bytes:
    return CODEC.encode(LEDGER, entry_id, entry_id - 1, 0, f"entry {entry_id}".encode())


def _fragment(old: tuple[str, ...], new: tuple[str, ...], last: int) -> FragmentCopy:
    md = LedgerMetadata.new(LEDGER, old, write_quorum=2, ack_quorum=2)
    return FragmentCopy(md, 0, last, old, new)


async def test_copies_exactly_the_entries_the_replacement_must_hold() -> None:
    # E3/Qw2: entry e is on positions e%3 and (e+1)%3; position 1 (b -> d) holds entries 0, 1, 3, 4
    stores: dict[str, dict[int, bytes]] = {b: {} for b in ("a", "b", "c")}
    for e in range(6):
        for p in (e % 3, (e + 1) % 3):
            stores["abc"[p]][e] = _body(e)
    del stores["b"]  # the lost bookie: never asked before the survivors
    stores["b"] = {}
    pool = ScriptedPool(stores)
    stats = await copy_fragment(
        _ctx(pool), _fragment(("a", "b", "c"), ("a", "d", "c"), 5), CODEC, b"k", window=4
    )
    assert sorted(e for _, e, _, _ in pool.adds) == [0, 1, 3, 4]
    assert {b for b, _, _, _ in pool.adds} == {"d"}
    assert all(key == b"k" for *_, key in pool.adds)
    assert pool.stores["d"] == {e: _body(e) for e in (0, 1, 3, 4)}
    assert all(bookie != "b" for bookie, _ in pool.reads)
    assert stats.entries == 4
    assert stats.bytes == sum(len(_body(e)) for e in (0, 1, 3, 4))


async def test_a_corrupt_survivor_is_skipped_for_the_next_replica() -> None:
    good = _body(0)
    corrupt = good[:-1] + bytes([good[-1] ^ 1])
    pool = ScriptedPool({"a": {0: corrupt}, "b": {0: good}, "c": {}})
    # E3/Qw3: entry 0 on every bookie; c is replaced, a (corrupt) then b are read
    md = LedgerMetadata.new(LEDGER, ("a", "b", "c"), write_quorum=3, ack_quorum=2)
    await copy_fragment(
        _ctx(pool), FragmentCopy(md, 0, 0, ("a", "b", "c"), ("a", "b", "d")), CODEC, b"k", window=1
    )
    assert pool.stores["d"] == {0: good}
    assert pool.batches == [("a", 0), ("b", 0)]  # Qw == E: batch reads, the corrupt one skipped
    assert pool.reads == []


async def test_qw_equal_e_copies_in_batches_and_reads_a_gap_on_its_own() -> None:
    bodies = {e: _body(e) for e in range(10)}
    a_has = {e: b for e, b in bodies.items() if e != 4}  # a lacks entry 4: its batch stops short
    pool = ScriptedPool({"a": a_has, "b": dict(bodies), "c": {}})
    md = LedgerMetadata.new(LEDGER, ("a", "b", "c"), write_quorum=3, ack_quorum=2)
    stats = await copy_fragment(
        _ctx(pool), FragmentCopy(md, 0, 9, ("a", "b", "c"), ("a", "b", "d")), CODEC, b"k", window=8
    )
    assert pool.stores["d"] == bodies
    assert stats.entries == 10
    assert pool.batches[0] == ("a", 0)
    assert len(pool.batches) + len(pool.reads) < 10  # far fewer requests than entries


async def test_an_entry_nobody_has_stops_the_copy() -> None:
    pool = ScriptedPool({"a": {}, "b": {}, "c": {}})
    with pytest.raises(EntryUnavailable, match="entry 0"):
        await copy_fragment(_ctx(pool), _fragment(("a", "b", "c"), ("a", "d", "c"), 2), CODEC, b"k", window=2)
    assert issubclass(EntryUnavailable, ReplicationError)


async def test_an_empty_fragment_copies_nothing() -> None:
    pool = ScriptedPool({})
    stats = await copy_fragment(
        _ctx(pool), _fragment(("a", "b", "c"), ("a", "d", "c"), -1), CODEC, b"k", window=2
    )
    assert stats.entries == 0
    assert pool.reads == []


async def test_a_rate_limit_spaces_the_copies() -> None:
    stores: dict[str, dict[int, bytes]] = {"a": {}, "b": {}, "c": {}}
    for e in range(6):
        for p in (e % 3, (e + 1) % 3):
            stores["abc"[p]][e] = _body(e)
    pool = ScriptedPool(stores)
    copied = [len(_body(e)) for e in (0, 1, 3, 4)]
    rate = sum(copied) / 0.4  # the four copies take 0.4 s of budget
    limiter = RateLimiter(rate)
    started = time.monotonic()
    await copy_fragment(
        _ctx(pool), _fragment(("a", "b", "c"), ("a", "d", "c"), 5), CODEC, b"k", window=4, limiter=limiter
    )
    elapsed = time.monotonic() - started
    assert elapsed >= (sum(copied) - max(copied)) / rate * 0.95  # the last one starts after the rest
    assert sorted(pool.stores["d"]) == [0, 1, 3, 4]
    unlimited = RateLimiter(0)
    started = time.monotonic()
    await unlimited.acquire(10**12)
    assert time.monotonic() - started < 0.05


async def test_the_check_finds_missing_and_corrupt_replicas() -> None:
    stores: dict[str, dict[int, bytes]] = {"a": {}, "b": {}, "c": {}}
    for e in range(6):
        for p in (e % 3, (e + 1) % 3):
            stores["abc"[p]][e] = _body(e)
    del stores["a"][0]  # a lost its first entry
    good = stores["c"][5]
    stores["c"][5] = good[:-1] + bytes([good[-1] ^ 1])  # c's last entry is corrupt
    md = LedgerMetadata.new(LEDGER, ("a", "b", "c"), write_quorum=2, ack_quorum=2).closed(5, 60)
    ctx = _ctx(ScriptedPool(stores))
    slots = asyncio.Semaphore(4)
    assert await check_ledger(ctx, md, {"a", "b", "c"}, slots, CODEC) == {"a", "c"}
    assert await check_ledger(ctx, md, {"b", "c"}, slots, CODEC) == {"c"}  # a unregistered: not probed
    open_md = LedgerMetadata.new(LEDGER, ("a", "b", "c"), write_quorum=2, ack_quorum=2)
    assert await check_ledger(ctx, open_md, {"a", "b", "c"}, slots, CODEC) == set()  # the writer's


async def test_an_unexpected_error_in_a_copy_fails_it_never_passes_with_an_entry_missing() -> None:
    """A bug (not a BKError) in one entry's copy must stop the copy: the CAS would otherwise list a
    replacement that lacks that entry."""

    class Buggy(ScriptedPool):
        async def request(self, bookie_id, make, timeout_s):  # type: ignore[no-untyped-def]
            request = make(1)
            if isinstance(request, m.BatchReadRequest):  # no batch: every entry is read on its own
                return m.BatchReadResponse(1, int(StatusCode.ENOENTRY))
            if isinstance(request, m.ReadEntryRequest) and request.entry_id == 0:
                raise RuntimeError("a bug in a read path")
            return await super().request(bookie_id, make, timeout_s)

    stores: dict[str, dict[int, bytes]] = {b: {} for b in "abc"}
    for entry_id in range(6):
        for position in (entry_id % 3, (entry_id + 1) % 3):
            stores["abc"[position]][entry_id] = _body(entry_id)
    stores["b"] = {}  # b is lost
    pool = Buggy(stores)
    with pytest.raises(RuntimeError, match="a bug in a read path"):
        await copy_fragment(_ctx(pool), _fragment(("a", "b", "c"), ("a", "d", "c"), 5), CODEC, b"k", window=1)


async def test_batched_copies_read_ahead_from_the_survivors_in_turn_and_a_refused_write_fails() -> None:
    """Qw == E: batches alternate between the survivors (the next one read while the current one is
    written); a replacement refusing one write (the callback path) fails the copy, never counted."""
    bodies = {e: _body(e) for e in range(30)}

    class Batches(ScriptedPool):
        async def request(self, bookie_id, make, timeout_s):  # type: ignore[no-untyped-def]
            request = make(1)
            if isinstance(request, m.BatchReadRequest):  # 10 entries per batch
                shorter = request._replace(max_count=min(10, request.max_count))
                return await super().request(bookie_id, lambda rid: shorter, timeout_s)
            if isinstance(request, m.AddEntryRequest) and request.entry_id == self.refuse:
                return m.AddEntryResponse(1, int(StatusCode.EIO))
            return await super().request(bookie_id, make, timeout_s)

    md = LedgerMetadata.new(LEDGER, ("a", "b", "c"), write_quorum=3, ack_quorum=2)
    fragment = FragmentCopy(md, 0, 29, ("a", "b", "c"), ("a", "b", "d"))
    pool = Batches({"a": dict(bodies), "b": dict(bodies), "c": {}})
    pool.refuse = -1  # type: ignore[attr-defined]
    stats = await copy_fragment(_ctx(pool), fragment, CODEC, b"k", window=4)
    assert stats.entries == 30
    assert pool.stores["d"] == bodies
    assert pool.batches == [("a", 0), ("b", 10), ("a", 20)]
    assert pool.reads == []

    pool = Batches({"a": dict(bodies), "b": dict(bodies), "c": {}})
    pool.refuse = 17  # type: ignore[attr-defined]
    with pytest.raises(ReplicationError, match="entry 17: replacement d"):
        await copy_fragment(_ctx(pool), fragment, CODEC, b"k", window=4)


async def test_a_striped_fragment_is_read_in_batches_per_stripe() -> None:
    """E3/Qw2, position 1 (b) replaced: its entries are those of stripes 0 (on a, b) and 1 (on b,
    c); each stripe is read with BATCH_READ of step 3 from its survivor, none entry by entry."""
    stores: dict[str, dict[int, bytes]] = {b: {} for b in ("a", "b", "c")}
    for e in range(60):
        for p in (e % 3, (e + 1) % 3):
            stores["abc"[p]][e] = _body(e)
    stores["b"] = {}  # lost
    pool = ScriptedPool(stores)
    stats = await copy_fragment(
        _ctx(pool), _fragment(("a", "b", "c"), ("a", "d", "c"), 59), CODEC, b"k", window=4
    )
    wanted = [e for e in range(60) if e % 3 in (0, 1)]
    assert sorted(pool.stores["d"]) == wanted
    assert all(pool.stores["d"][e] == _body(e) for e in wanted)
    assert stats.entries == len(wanted)
    assert pool.reads == []
    assert sorted(pool.batches) == [("a", 0), ("c", 1)]  # one batch per stripe, from its survivor


async def test_a_bookie_that_ignores_the_step_still_gives_a_whole_copy() -> None:
    """A bookie older than BATCH_READ's step answers consecutive entries (no echo): only the first
    body of each answer is taken, the copy is whole (just slower)."""

    class Older(ScriptedPool):
        async def request(self, bookie_id, make, timeout_s):  # type: ignore[no-untyped-def]
            request = make(1)
            if isinstance(request, m.BatchReadRequest) and request.step != 1:
                plain = request._replace(step=1)
                return await super().request(bookie_id, lambda rid: plain, timeout_s)
            return await super().request(bookie_id, make, timeout_s)

    stores: dict[str, dict[int, bytes]] = {b: {} for b in ("a", "b", "c")}
    for e in range(12):
        for p in (e % 3, (e + 1) % 3):
            stores["abc"[p]][e] = _body(e)
    stores["b"] = {}
    pool = Older(stores)
    await copy_fragment(_ctx(pool), _fragment(("a", "b", "c"), ("a", "d", "c"), 11), CODEC, b"k", window=4)
    assert pool.stores["d"] == {e: _body(e) for e in range(12) if e % 3 in (0, 1)}
