"""Logs (ledger chains, docs/replication.md §7) on real bookies and real etcd."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from bookkeeper_aio import (
    BookKeeper,
    LogFenced,
    LogPosition,
    LogRecord,
    NoSuchLog,
    open_log_reader,
    open_log_writer,
)
from metadata.errors import MetadataFormatError
from metadata.keys import ClusterKeys
from metadata.log_manager import LogManager
from metadata.log_metadata import LogLedgerState
from tests.integration.log.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd

QUORUM = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}


async def _read_all(bk: BookKeeper, name: str, **kwargs: object) -> list[LogRecord]:
    reader = await open_log_reader(bk, name, password=b"pw", **kwargs)  # type: ignore[arg-type]
    return [record async for record in reader]


async def test_append_and_read_back_across_rolls(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "orders", **QUORUM)  # type: ignore[arg-type]
    expected: list[tuple[LogPosition, bytes]] = []
    for chunk in range(4):  # 3 explicit rolls
        futures = [await writer.append_async(f"r{chunk}-{i}".encode()) for i in range(5)]
        expected += [(await f, f"r{chunk}-{i}".encode()) for i, f in enumerate(futures)]
        if chunk < 3:
            await writer.roll()
    await writer.close()
    records = await _read_all(bk, "orders")
    assert [(r.position, r.payload) for r in records] == expected
    assert len({p.ledger_id for p, _ in expected}) == 4
    assert [p for p, _ in expected] == sorted(p for p, _ in expected)
    md = (await LogManager(cluster.meta.store, cluster.root).read("orders")).metadata
    assert len(md.ledgers) == 4
    assert all(e.state is LogLedgerState.CLOSED for e in md.ledgers)
    # from a position: inclusive, across the following ledgers
    start = expected[7][0]
    assert [r.position for r in await _read_all(bk, "orders", start=start)] == [p for p, _ in expected[7:]]


async def test_automatic_roll_by_entry_count(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "auto", roll_entries_max=3, **QUORUM)  # type: ignore[arg-type]
    # the roll runs in the background (appends go on to the old ledger until its CAS succeeded):
    # append until one landed in a later ledger
    positions = []
    while len({p.ledger_id for p in positions}) < 2 and len(positions) < 500:
        positions.append(await writer.append(f"{len(positions)}".encode()))
    await writer.close()
    assert len({p.ledger_id for p in positions}) >= 2
    assert positions == sorted(positions)
    assert len(writer.ledger_ids) >= 2
    records = await _read_all(bk, "auto")
    assert [r.payload for r in records] == [f"{i}".encode() for i in range(len(positions))]


async def test_takeover_fences_the_old_writer(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    acked: list[tuple[LogPosition, bytes]] = []
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk_a:
        writer_a = await open_log_writer(bk_a, "events", **QUORUM)  # type: ignore[arg-type]
        for i in range(5):
            acked.append((await writer_a.append(f"a{i}".encode()), f"a{i}".encode()))
        await writer_a.roll()  # A's previous ledger is closed; the fenced pair is (closed, open)
        for i in range(5, 8):
            acked.append((await writer_a.append(f"a{i}".encode()), f"a{i}".encode()))

        # a reader while A writes: a prefix of the acked records (the open ledger up to its LAC)
        live = await _read_all(bk, "events")
        assert [(r.position, r.payload) for r in live] == acked[: len(live)]
        assert len(live) >= 5

        writer_b = await open_log_writer(bk, "events", **QUORUM)  # type: ignore[arg-type]
        with pytest.raises(LogFenced, match="'events'") as caught:
            await writer_a.append(b"lost")
        assert caught.value.outcome_unknown  # sent, then refused: as the ledger API marks it
        with pytest.raises(LogFenced):  # stopped for good
            await writer_a.append(b"lost again")
        with pytest.raises(LogFenced):
            await writer_a.roll()
        for i in range(3):
            acked.append((await writer_b.append(f"b{i}".encode()), f"b{i}".encode()))
        await writer_a.close()
        await writer_b.close()
    records = await _read_all(bk, "events")
    assert [(r.position, r.payload) for r in records] == acked


async def test_concurrent_opens_leave_one_consistent_list(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    first = await open_log_writer(bk, "race", **QUORUM)  # type: ignore[arg-type]
    await first.append(b"x")
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk2:
        w1, w2 = await asyncio.gather(
            open_log_writer(bk, "race", **QUORUM),  # type: ignore[arg-type]
            open_log_writer(bk2, "race", **QUORUM),  # type: ignore[arg-type]
        )
        md = (await LogManager(cluster.meta.store, cluster.root).read("race")).metadata
        ids = md.ledger_ids
        assert len(ids) == len(set(ids)) == 3
        assert ids[0] == first.ledger_id
        assert {w1.ledger_id, w2.ledger_id} == set(ids[1:])
        # the one that opened first was fenced by the second: exactly one can append
        outcomes = await asyncio.gather(w1.append(b"1"), w2.append(b"2"), return_exceptions=True)
        assert sum(isinstance(o, LogFenced) for o in outcomes) == 1
        assert sum(isinstance(o, LogPosition) for o in outcomes) == 1
        winner = next(o for o in outcomes if isinstance(o, LogPosition))
        assert winner.ledger_id == ids[-1]
        await w1.close()
        await w2.close()
    with pytest.raises(LogFenced, match="'race'"):  # superseded: its close finds the list changed
        await first.close()
    payloads = [r.payload for r in await _read_all(bk, "race")]
    assert payloads[0] == b"x"
    assert len(payloads) == 2


async def test_unknown_log_and_corrupt_key(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    with pytest.raises(NoSuchLog, match="'nope'"):
        await open_log_reader(bk, "nope")
    with pytest.raises(NoSuchLog, match="'nope'"):
        await open_log_writer(bk, "nope", create=False, **QUORUM)  # type: ignore[arg-type]
    await cluster.meta.store.put(ClusterKeys(cluster.root).log("broken"), b"\x00garbage")
    with pytest.raises(MetadataFormatError, match="log 'broken'"):
        await open_log_reader(bk, "broken")
    with pytest.raises(MetadataFormatError, match="log 'broken'"):
        await open_log_writer(bk, "broken", **QUORUM)  # type: ignore[arg-type]


async def test_roll_while_appends_wait_for_a_window_slot(cluster: Cluster) -> None:
    await cluster.start(3)
    async with BookKeeper.connect(cluster.url, config=dataclasses.replace(CONFIG, add_window_max=2)) as bk:
        writer = await open_log_writer(bk, "busy", **QUORUM)  # type: ignore[arg-type]
        tasks = [asyncio.create_task(writer.append(f"{i}".encode())) for i in range(30)]
        await asyncio.sleep(0)
        await writer.roll()
        positions = await asyncio.gather(*tasks)
        await writer.close()
        records = await _read_all(bk, "busy")
    assert sorted(r.payload for r in records) == sorted(f"{i}".encode() for i in range(30))
    assert sorted(positions) == [r.position for r in records]
