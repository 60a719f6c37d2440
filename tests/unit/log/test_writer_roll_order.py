"""A roll keeps the log a prefix of what its writer sent (fake bookies, MemoryStore): appends go to
the new ledger only once every append to the old one is acknowledged, and an append that failed
once sent stops the writer, so no record ever follows one that may be missing."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import (
    BKError,
    LogFenced,
    LogPosition,
    open_log_reader,
    open_log_writer,
)
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.log.writer import LogWriter
from bookkeeper_aio.protocol import messages as m
from tests.harness.fake_bookie import FakeCluster, Reply
from tests.unit.log.fakes import world


def _script(cluster: FakeCluster, ledger_id: int, entry_id: int, reply: Reply) -> None:
    def script(request: m.Request) -> Reply | None:
        if isinstance(request, m.AddEntryRequest) and (request.ledger_id, request.entry_id) == (
            ledger_id,
            entry_id,
        ):
            return reply
        return None

    for bookie_id in cluster.ids:
        cluster.by_id(bookie_id).script = script


async def _listed(writer: LogWriter, old: int) -> None:
    """Until the roll's CAS listed its new ledger (the switch to it comes after)."""
    for _ in range(1000):
        if writer.ledger_ids[-1] != old:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the roll never listed its new ledger")


async def test_the_new_ledger_is_written_only_once_the_old_one_drained() -> None:
    async with world(clients=1) as w:
        cluster, (bk,) = w.cluster, w.clients
        writer = await open_log_writer(bk, "ordered")
        for i in range(4):
            await writer.append(b"a%d" % i)
        old = writer.ledger_id
        release = asyncio.Event()
        _script(cluster, old, 4, Reply.hold(release))
        held = await writer.append_async(b"a4")
        roll = asyncio.create_task(writer.roll())
        await _listed(writer, old)
        later = asyncio.ensure_future(writer.append(b"b0"))  # waits for the switch: nothing sent
        await asyncio.sleep(0.05)
        new = writer.ledger_ids[-1]
        assert writer.ledger_id == old
        assert not later.done()
        assert not any(
            isinstance(request, m.AddEntryRequest) and request.ledger_id == new
            for bookie_id in cluster.ids
            for request in cluster.by_id(bookie_id).requests
        )
        order: list[LogPosition | None] = []
        held.add_done_callback(lambda done: order.append(done.result()))
        later.add_done_callback(lambda done: order.append(done.result()))  # type: ignore[arg-type]
        release.set()
        await roll
        await later
        assert order == [LogPosition(old, 4), LogPosition(new, 0)]
        await writer.close()
        read = [record.payload async for record in await open_log_reader(bk, "ordered")]
        assert read == [b"a0", b"a1", b"a2", b"a3", b"a4", b"b0"]


async def test_an_append_that_failed_before_the_switch_stops_the_writer() -> None:
    """Sequence 5 is lost in the old ledger (its bookies time out, none can replace them): the
    writer stops, sequence 6 is never written after it, and a new writer takes the retry of 5."""
    async with world() as w:
        cluster, (bk, other) = w.cluster, w.clients
        writer = await open_log_writer(bk, "sequenced", sequenced=True)
        for sequence in range(1, 5):
            await writer.append(b"r%d" % sequence, sequence=sequence)
        old = writer.ledger_id
        _script(cluster, old, 4, Reply.drop())
        lost = await writer.append_async(b"r5", sequence=5)
        roll = asyncio.create_task(writer.roll())
        await _listed(writer, old)
        directory = bk.context.directory
        assert isinstance(directory, StaticDirectory)
        directory.writable = []  # no bookie to replace the old ledger's
        with pytest.raises(LogFenced):
            await writer.append(b"r6", sequence=6)
        with pytest.raises(BKError):
            await lost
        with pytest.raises(BKError):
            await roll
        with pytest.raises(LogFenced):
            await writer.append(b"r6", sequence=6)
        await writer.close()
        successor = await open_log_writer(other, "sequenced")
        assert successor.last_sequence == 4
        assert await successor.append(b"r5", sequence=5) is not None
        assert await successor.append(b"r6", sequence=6) is not None
        await successor.close()
        read = [record.sequence async for record in await open_log_reader(other, "sequenced")]
        assert read == [1, 2, 3, 4, 5, 6]


async def test_a_roll_cancelled_while_the_old_ledger_drains_still_closes_it() -> None:
    """The roll's caller gives up (``wait_for``) while an add to the old ledger is pending: the
    roll goes on in the background, switches once the add is acknowledged, and closes the old
    ledger, so a reader reaches the records after it while the writer still lives."""
    async with world(clients=2) as w:
        cluster, (bk, other) = w.cluster, w.clients
        writer = await open_log_writer(bk, "cancelled")
        await writer.append(b"a0")
        old = writer.ledger_id
        release = asyncio.Event()
        _script(cluster, old, 1, Reply.hold(release))
        held = await writer.append_async(b"a1")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(writer.roll(), 0.3)  # listed, waiting for a1
        new = writer.ledger_ids[-1]
        assert new != old
        release.set()
        assert await held == LogPosition(old, 1)
        assert await writer.append(b"b0") == LogPosition(new, 0)
        await writer.append(b"b1")  # carries b0's LAC
        for _ in range(1000):
            info = (await other.context.ledgers.read(old)).metadata
            if info.last_entry_id is not None:
                break
            await asyncio.sleep(0.005)
        assert info.last_entry_id == 1  # closed at a1, not left OPEN
        read = [record.payload async for record in await open_log_reader(other, "cancelled")]
        assert read[:3] == [b"a0", b"a1", b"b0"]
        await writer.close()
        read = [record.payload async for record in await open_log_reader(other, "cancelled")]
        assert read == [b"a0", b"a1", b"b0", b"b1"]
