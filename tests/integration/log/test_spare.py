"""The spare ledger (bookkeeper_aio.log.writer): created ahead of a roll, recorded in the list,
used by the roll, deleted by a close or by whoever takes the log over. Real bookies, real etcd."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import (
    BookKeeper,
    LogFenced,
    delete_log,
    describe_log,
    open_log_reader,
    open_log_writer,
)
from bookkeeper_aio.log.writer import LogWriter
from metadata.errors import MetadataUnavailable
from metadata.log_manager import LogManager
from metadata.log_metadata import LogMetadata
from tests.integration.log.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd

QUORUM = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}
ROLL = 200
"""Larger than the appends of any test but the last: no automatic roll runs by surprise."""


async def _list(cluster: Cluster, name: str) -> LogMetadata:
    return (await LogManager(cluster.meta.store, cluster.root).read(name)).metadata


async def _spare_recorded(cluster: Cluster, name: str) -> int:
    """Waits until the list records a spare; its id."""
    for _ in range(500):
        spare = (await _list(cluster, name)).spare
        if spare is not None:
            return spare
        await asyncio.sleep(0.01)
    raise AssertionError(f"log {name!r}: no spare recorded")


async def _append_until_failure(writer: LogWriter) -> None:
    for i in range(ROLL):
        await writer.append(f"late-{i}".encode())


async def _append(writer: LogWriter, first: int, count: int) -> int:
    """Appends ``first`` .. ``first + count - 1`` (pipelined); the next number."""
    futures = [await writer.append_async(f"{i}".encode()) for i in range(first, first + count)]
    await asyncio.gather(*futures)
    return first + count


async def _writer_with_spare(bk: BookKeeper, cluster: Cluster, name: str) -> tuple[LogWriter, int]:
    """A writer that made half a ledger of appends (the spare's trigger), and its spare's id."""
    writer = await open_log_writer(bk, name, roll_entries_max=ROLL, **QUORUM)  # type: ignore[arg-type]
    assert (await _list(cluster, name)).spare is None  # nothing ahead of time at the open
    await _append(writer, 0, ROLL // 2)
    return writer, await _spare_recorded(cluster, name)


async def test_the_roll_moves_to_the_spare_and_close_deletes_the_next_one(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    writer, spare = await _writer_with_spare(bk, cluster, "spare-roll")
    first = writer.ledger_id
    assert spare > first
    assert await bk.context.ledgers.exists(spare)
    assert spare not in (await _list(cluster, "spare-roll")).ledger_ids  # not part of the log
    assert (await describe_log(bk, "spare-roll")).spare == spare
    assert await writer.roll() == spare  # the automatic roll takes it the same way
    assert writer.ledger_id == spare
    md = await _list(cluster, "spare-roll")
    assert md.ledger_ids == (first, spare)
    assert md.spare is None
    count = await _append(writer, ROLL // 2, ROLL // 2)  # half way again: the next spare
    next_spare = await _spare_recorded(cluster, "spare-roll")
    assert next_spare > spare
    await writer.close()
    md = await _list(cluster, "spare-roll")
    assert md.spare is None
    assert md.ledger_ids == (first, spare)
    assert not await bk.context.ledgers.exists(next_spare)  # the close deleted it
    reader = await open_log_reader(bk, "spare-roll", password=b"pw")
    assert [r.payload async for r in reader] == [f"{i}".encode() for i in range(count)]


async def test_a_takeover_deletes_the_previous_leaders_spare(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    writer_a, spare = await _writer_with_spare(bk, cluster, "spare-takeover")
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk_b:
        writer_b = await open_log_writer(bk_b, "spare-takeover", **QUORUM)  # type: ignore[arg-type]
        md = await _list(cluster, "spare-takeover")
        assert md.spare is None
        assert spare not in md.ledger_ids
        assert md.ledger_ids[-1] == writer_b.ledger_id
        assert not await bk.context.ledgers.exists(spare)
        with pytest.raises(LogFenced):
            await _append_until_failure(writer_a)  # the roll A would start cannot list anything either
        await writer_a.close()  # fenced: deletes nothing the new leader holds
        await writer_b.append(b"b")
        await writer_b.close()
        reader = await open_log_reader(bk_b, "spare-takeover", password=b"pw")
        payloads = [r.payload async for r in reader]
    assert payloads[: ROLL // 2] == [f"{i}".encode() for i in range(ROLL // 2)]
    assert payloads[-1] == b"b"


async def test_deleting_the_log_deletes_its_spare(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    writer, spare = await _writer_with_spare(bk, cluster, "spare-delete")
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk_b:
        await delete_log(bk_b, "spare-delete", password=b"pw")
    assert not await bk.context.ledgers.exists(spare)
    with pytest.raises(LogFenced):
        await writer.append(b"after the delete")
    await writer.close()


async def test_a_spare_on_an_unreachable_bookie_is_replaced_by_a_fresh_ledger(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.start(4)
    writer, spare = await _writer_with_spare(bk, cluster, "spare-stale")
    pool = bk.context.pool
    spare_md = await bk.context.ledgers.read(spare)
    down = spare_md.metadata.ensemble_for(0)[0]
    real = pool.reconnect_delay_s
    monkeypatch.setattr(pool, "reconnect_delay_s", lambda b: 5.0 if b == down else real(b))
    new = await writer.roll()
    assert new != spare
    assert new > spare
    md = await _list(cluster, "spare-stale")
    assert md.ledger_ids[-1] == new
    assert md.spare is None
    assert not await bk.context.ledgers.exists(spare)
    monkeypatch.undo()
    await writer.append(b"in the fresh ledger")
    await writer.close()


async def test_a_failed_spare_is_retried_after_a_pause_and_the_roll_makes_its_own(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "spare-fails", roll_entries_max=100, **QUORUM)  # type: ignore[arg-type]
    first = writer.ledger_id
    attempts = []

    async def unavailable(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise MetadataUnavailable("etcd is down (test)")

    monkeypatch.setattr(bk, "create_ledger", unavailable)
    await _append(writer, 0, 90)  # past half way: every one of these appends finds no spare
    await asyncio.sleep(0.05)
    assert len(attempts) == 1  # then one per ROLL_RETRY_S, not one per append
    assert (await _list(cluster, "spare-fails")).spare is None
    monkeypatch.undo()
    new = await writer.roll()  # the roll creates its own ledger
    assert new > first
    assert (await _list(cluster, "spare-fails")).ledger_ids == (first, new)
    await writer.close()
