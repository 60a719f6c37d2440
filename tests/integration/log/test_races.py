"""Races between a log's writers, readers and its truncation, made deterministic: the second
party's whole operation runs at the exact point where the first one is between two steps (a wrapper
around the first one's next step, or the test's own order of calls). Real bookies, real etcd."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from bookkeeper_aio import BookKeeper, LogFenced, LogPosition, open_log_reader, open_log_writer, truncate_log
from bookkeeper_aio.log._common import recover_ledgers
from bookkeeper_aio.log.records import last_sequence
from tests.integration.log.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd

QUORUM: dict[str, Any] = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}


async def _three_ledgers(bk: BookKeeper, name: str) -> tuple[list[LogPosition], Any]:
    """A log [L1 CLOSED, L2 CLOSED, L3 OPEN] with its writer still open, and the acked positions."""
    writer = await open_log_writer(bk, name, **QUORUM)
    positions = []
    for chunk in range(3):
        for i in range(3):
            position = await writer.append(f"{chunk}-{i}".encode())
            assert position is not None
            positions.append(position)
        if chunk < 2:
            await writer.roll()
    return positions, writer


async def test_a_truncation_between_an_opens_list_read_and_its_recovery(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new writer read [L1, L2, L3] and is about to fence the last two (L2, L3); a truncation
    before L3 lands first and deletes L2. The open must start over on the new list (the seed: on a
    changed list, start again), not fail on the deleted ledger."""
    await cluster.start(3)
    positions, old_writer = await _three_ledgers(bk, "cut")
    third = positions[6].ledger_id
    landed: list[LogPosition | None] = []

    async def truncate_first(bk_: BookKeeper, ledger_ids: tuple[int, ...], password: bytes) -> Any:
        if not landed:
            async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
                landed.append(await truncate_log(other, "cut", LogPosition(third, 0), password=b"pw"))
        return await recover_ledgers(bk_, ledger_ids, password)

    monkeypatch.setattr("bookkeeper_aio.log.writer.recover_ledgers", truncate_first)
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk2:
        new_writer = await open_log_writer(bk2, "cut", **QUORUM)
        assert landed == [LogPosition(third, 0)]  # the truncation did land in between
        position = await new_writer.append(b"after")
        await new_writer.close()
    reader = await open_log_reader(bk, "cut", password=b"pw")
    read = [record.position async for record in reader]
    assert read == [*positions[6:], position]
    assert old_writer is not None


async def test_a_truncation_between_an_opens_cas_and_its_last_sequence_read(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "seq", sequenced=True, **QUORUM)
    for sequence in range(5):
        await writer.append(f"{sequence}".encode(), sequence=sequence)
    await writer.close()  # [L1 CLOSED]: the next open lists [L1, L2 OPEN] and reads L1's last record
    landed: list[LogPosition | None] = []

    async def truncate_first(bk_: BookKeeper, md: Any, password: bytes) -> int | None:
        if not landed:
            cut = LogPosition(md.ledgers[-1].ledger_id, 0)  # everything before the new ledger
            async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
                landed.append(await truncate_log(other, "seq", cut, password=b"pw"))
        return await last_sequence(bk_, md, password)

    monkeypatch.setattr("bookkeeper_aio.log.records.last_sequence", truncate_first)
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk2:
        new_writer = await open_log_writer(bk2, "seq", **QUORUM)
        assert len(landed) == 1  # the truncation did land in between
        assert new_writer.last_sequence == 4
        assert await new_writer.append(b"dup", sequence=4) is None  # still a duplicate
        assert await new_writer.append(b"5", sequence=5) is not None
        await new_writer.close()


async def test_a_reader_waiting_past_the_end_of_a_ledger_a_takeover_closes(
    cluster: Cluster, bk: BookKeeper
) -> None:
    """A following reader that starts at the open ledger's next entry (nothing there yet); a
    takeover closes that ledger at its current end, so the entry never comes there: the reader
    moves on to the new writer's ledger and hands out exactly its records."""
    await cluster.start(3)
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk_a:
        writer_a = await open_log_writer(bk_a, "edge", **QUORUM)
        last = None
        for i in range(3):
            last = await writer_a.append(f"a{i}".encode())
        assert last is not None
        start = LogPosition(last.ledger_id, last.entry_id + 1)
        reader = await open_log_reader(bk, "edge", start=start, password=b"pw", follow=True)
        async with contextlib.aclosing(reader):
            writer_b = await open_log_writer(bk, "edge", **QUORUM)  # recovers A's ledger at a2
            expected = [await writer_b.append(f"b{i}".encode()) for i in range(2)]
            async with asyncio.timeout(10):
                got = [await anext(reader) for _ in range(2)]
            assert [r.position for r in got] == expected
            assert [r.payload for r in got] == [b"b0", b"b1"]
            await writer_b.close()
            with contextlib.suppress(LogFenced):
                await writer_a.close()
