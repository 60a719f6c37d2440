"""Truncation, retention, cursors, sequenced logs, imports and log operations on real bookies + etcd."""

from __future__ import annotations

import asyncio

import pytest

from bookkeeper_aio import (
    BKInterfaceError,
    BookKeeper,
    LogFenced,
    LogPosition,
    LogRecord,
    LogTruncated,
    MetadataConflict,
    NoSuchLedger,
    NoSuchLog,
    append_ledgers,
    commit_cursor,
    committed_batch,
    delete_cursor,
    delete_log,
    describe_log,
    list_logs,
    open_log_reader,
    open_log_writer,
    read_cursors,
    truncate_log,
)
from bookkeeper_aio.log import writer as writer_module
from bookkeeper_aio.log._common import log_manager
from metadata import log_metadata
from tests.integration.log.conftest import CONFIG, Cluster
from tests.unit.log.test_log_list_size import roll_until_full

pytestmark = pytest.mark.etcd

QUORUM = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}


async def _read_all(bk: BookKeeper, name: str, **kwargs: object) -> list[LogRecord]:
    reader = await open_log_reader(bk, name, password=b"pw", **kwargs)  # type: ignore[arg-type]
    return [record async for record in reader]


async def _write_ledgers(
    bk: BookKeeper, name: str, ledgers: int, per_ledger: int, **kwargs: object
) -> list[LogPosition]:
    """A log of ``ledgers`` ledgers (rolled explicitly), ``per_ledger`` records each; the writer
    stays open on the last one and is returned through the positions' last ledger."""
    writer = await open_log_writer(bk, name, **QUORUM, **kwargs)  # type: ignore[arg-type]
    positions = []
    for ledger in range(ledgers):
        for i in range(per_ledger):
            position = await writer.append(f"{ledger}-{i}".encode())
            assert position is not None
            positions.append(position)
        if ledger < ledgers - 1:
            await writer.roll()
    await writer.close()
    return positions


async def test_truncation_drops_whole_ledgers_and_readers_say_so(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    positions = await _write_ledgers(bk, "t", 4, 3)
    ledgers = sorted({p.ledger_id for p in positions})
    before = await describe_log(bk, "t")
    assert [e.first_offset for e in before.ledgers] == [0, 3, 6, 9]
    assert [e.last_entry_id for e in before.ledgers] == [2, 2, 2, 2]
    first = await truncate_log(bk, "t", LogPosition(ledgers[2], 1), password=b"pw")
    assert first == LogPosition(ledgers[2], 0)  # whole ledgers only: ledger 2 stays entire
    info = await describe_log(bk, "t")
    assert [e.ledger_id for e in info.ledgers] == ledgers[2:]
    assert info.truncated_before == ledgers[2]
    assert info.ledgers[0].first_offset == 6  # offsets survive the cut
    for gone in ledgers[:2]:  # deleted, not only unlisted
        with pytest.raises(NoSuchLedger):
            await bk.open_ledger(gone, password=b"pw")
    assert [r.position for r in await _read_all(bk, "t")] == positions[6:]
    resume = LogPosition(ledgers[2], 3)  # one past ledger 2's last record: where a cursor resumes
    assert [r.position for r in await _read_all(bk, "t", start=resume)] == positions[9:]
    with pytest.raises(LogTruncated, match=r"'t'.*truncated.*start from 'earliest'") as caught:
        await open_log_reader(bk, "t", start=positions[0], password=b"pw")
    assert caught.value.first_position == (ledgers[2], 0)
    # a ledger the log does not list is refused; forced, truncation still never removes the last one
    with pytest.raises(BKInterfaceError, match="not in the log"):
        await truncate_log(bk, "t", LogPosition(ledgers[-1] + 100, 0), password=b"pw")
    await truncate_log(bk, "t", LogPosition(ledgers[-1] + 100, 0), password=b"pw", force=True)
    assert [e.ledger_id for e in (await describe_log(bk, "t")).ledgers] == ledgers[-1:]


async def test_a_reader_inside_a_truncated_ledger_gets_log_truncated(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    positions = await _write_ledgers(bk, "mid", 3, 4)
    reader = await open_log_reader(bk, "mid", password=b"pw")
    first = await anext(reader)
    assert first.position == positions[0]
    await truncate_log(bk, "mid", positions[-1], password=b"pw")
    with pytest.raises(LogTruncated, match="being read"):
        async for _ in reader:
            pass


async def test_cursors_hold_back_truncation_and_retention(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    positions = await _write_ledgers(bk, "c", 4, 2)
    ledgers = sorted({p.ledger_id for p in positions})
    await commit_cursor(bk, "c", "billing", positions[3])  # consumed into ledger 2 (of 4)
    await commit_cursor(bk, "c", "audit", positions[5])
    assert await read_cursors(bk, "c") == {"audit": positions[5], "billing": positions[3]}
    assert await truncate_log(bk, "c", positions[-1], password=b"pw") == LogPosition(ledgers[1], 0)
    assert await delete_cursor(bk, "c", "billing")
    assert not await delete_cursor(bk, "c", "billing")
    assert await truncate_log(bk, "c", positions[-1], password=b"pw") == LogPosition(ledgers[2], 0)
    with pytest.raises(BKInterfaceError, match="cursor name"):
        await commit_cursor(bk, "c", "a/b", positions[0])
    with pytest.raises(NoSuchLog):
        await commit_cursor(bk, "nope", "x", positions[0])


async def test_retention_by_size_runs_after_rolls(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "r", retention_bytes=250, **QUORUM)  # type: ignore[arg-type]
    for _ledger in range(5):
        for _ in range(10):
            await writer.append(b"x" * 10)  # 100 bytes per ledger
        await writer.roll()
    info = await describe_log(bk, "r")
    closed = [e for e in info.ledgers if e.state == "closed"]
    assert sum(e.length or 0 for e in closed) <= 250
    assert len(closed) == 2
    assert info.ledgers[0].first_offset == 30
    await writer.close()
    assert len(await _read_all(bk, "r")) == 20


async def test_a_truncation_by_another_client_does_not_fence_the_writer(
    cluster: Cluster, bk: BookKeeper
) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "live", **QUORUM)  # type: ignore[arg-type]
    await writer.append(b"a")
    await writer.roll()
    await writer.append(b"b")
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        await truncate_log(other, "live", LogPosition(writer.ledger_id, 0), password=b"pw")
    await writer.roll()  # its CAS meets the truncated list and applies again
    await writer.append(b"c")
    await writer.close()
    assert [r.payload for r in await _read_all(bk, "live")] == [b"b", b"c"]


async def test_sequenced_log_skips_duplicates_across_a_takeover(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    first = await open_log_writer(bk, "seq", sequenced=True, **QUORUM)  # type: ignore[arg-type]
    for sequence in range(1, 4):
        assert await first.append(f"v{sequence}".encode(), sequence=sequence) is not None
    assert await first.append(b"again", sequence=2) is None  # a duplicate is not written
    with pytest.raises(BKInterfaceError, match="sequenced"):
        await first.append(b"no sequence")
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        second = await open_log_writer(other, "seq", **QUORUM)  # type: ignore[arg-type]
        assert second.sequenced
        assert second.last_sequence == 3  # learned from the log's last record
        assert await second.append(b"v3 retried", sequence=3) is None
        assert await second.append(b"v4", sequence=4) is not None
        await second.close()
    with pytest.raises(LogFenced):
        await first.append(b"late", sequence=5)
    records = await _read_all(bk, "seq")
    assert [(r.sequence, r.payload) for r in records] == [(1, b"v1"), (2, b"v2"), (3, b"v3"), (4, b"v4")]


async def test_reader_drops_a_duplicate_a_fenced_writer_left(cluster: Cluster, bk: BookKeeper) -> None:
    """The fenced writer's append reached the bookies (outcome unknown to it); its retry by the new
    leader under the same sequence is dropped by readers."""
    await cluster.start(3)
    positions = await _write_ledgers(bk, "dup", 1, 0, sequenced=True)
    assert positions == []
    writer = await open_log_writer(bk, "dup", **QUORUM)  # type: ignore[arg-type]
    await writer.append(b"one", sequence=1)
    writer._last_sequence = 0  # what a new leader that missed record 1 would believe
    await writer.append(b"one again", sequence=1)
    await writer.append(b"two", sequence=2)
    await writer.close()
    assert [(r.sequence, r.payload) for r in await _read_all(bk, "dup")] == [(1, b"one"), (2, b"two")]


async def test_latest_and_end_bound_a_reader(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    positions = await _write_ledgers(bk, "b", 3, 3)
    assert [r.position for r in await _read_all(bk, "b", end=positions[5])] == positions[:5]
    assert [r.position for r in await _read_all(bk, "b", start=positions[2], end=positions[3])] == [
        positions[2]
    ]
    assert await _read_all(bk, "b", start="latest") == []
    writer = await open_log_writer(bk, "b", **QUORUM)  # type: ignore[arg-type]
    reader = await open_log_reader(bk, "b", start="latest", follow=True, password=b"pw")
    appended = await writer.append(b"new")
    got = await asyncio.wait_for(anext(reader), 10)
    assert (got.position, got.payload) == (appended, b"new")
    await reader.aclose()
    await writer.close()


async def test_import_of_closed_ledgers_is_exactly_once(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    live = await open_log_writer(bk, "imp", **QUORUM)  # type: ignore[arg-type]
    await live.append(b"live")
    last = (await describe_log(bk, "imp")).ledgers[-1].ledger_id
    made = []
    for batch in range(2):
        handle = await bk.create_ledger(3, 2, 2, password=b"pw", after_ledger_id=last)
        await handle.append(f"batch-{batch}".encode())
        await handle.close()
        made.append(handle.id)
    assert await append_ledgers(bk, "imp", made, password=b"pw", commit=("job-1", 7))
    version = (await describe_log(bk, "imp")).version
    # the same call again (its answer lost): these very ledgers are in, nothing changes
    assert await append_ledgers(bk, "imp", made, password=b"pw", commit=("job-1", 7))
    assert (await describe_log(bk, "imp")).version == version
    replayed = await bk.create_ledger(3, 2, 2, password=b"pw", after_ledger_id=max(made))
    await replayed.append(b"batch-1 again")
    await replayed.close()  # a replayed batch wrote its rows again, to a new ledger
    assert not await append_ledgers(bk, "imp", [replayed.id], password=b"pw", commit=("job-1", 7))
    assert (await describe_log(bk, "imp")).version == version
    assert await committed_batch(bk, "imp", "job-1") == 7
    assert await committed_batch(bk, "imp", "job-2") is None
    with pytest.raises(LogFenced):  # the import took the log over
        await live.append(b"after")
    payloads = [r.payload for r in await _read_all(bk, "imp")]
    assert payloads == [b"live", b"batch-0", b"batch-1"]
    stale = await bk.create_ledger(3, 2, 2, password=b"pw")  # no after_ledger_id: an old id block
    await stale.close()
    if stale.id < max(made):
        with pytest.raises(MetadataConflict, match="not above"):
            await append_ledgers(bk, "imp", [stale.id], password=b"pw")
    unclosed = await bk.create_ledger(3, 2, 2, password=b"pw", after_ledger_id=replayed.id)
    with pytest.raises(BKInterfaceError, match="not closed"):
        await append_ledgers(bk, "imp", [unclosed.id], password=b"pw")


async def test_an_importer_id_over_the_cap_is_refused_before_anything_changes(
    cluster: Cluster, bk: BookKeeper
) -> None:
    """The list's room counts the commit tokens: an importer id of a megabyte would leave none."""
    await cluster.start(3)
    live = await open_log_writer(bk, "imp-cap", **QUORUM)  # type: ignore[arg-type]
    await live.append(b"live")
    before = await describe_log(bk, "imp-cap")
    handle = await bk.create_ledger(3, 2, 2, password=b"pw", after_ledger_id=before.ledgers[-1].ledger_id)
    await handle.append(b"batch")
    await handle.close()
    with pytest.raises(BKInterfaceError, match="importer id of 257 bytes > 256"):
        await append_ledgers(bk, "imp-cap", [handle.id], password=b"pw", commit=("i" * 257, 1))
    assert (await describe_log(bk, "imp-cap")).version == before.version
    assert await live.append(b"still the writer") is not None  # not taken over
    assert await append_ledgers(bk, "imp-cap", [handle.id], password=b"pw", commit=("i" * 256, 1))
    assert await committed_batch(bk, "imp-cap", "i" * 256) == 1


async def test_new_ledgers_sort_after_the_list_even_from_an_old_id_block(
    cluster: Cluster, bk: BookKeeper
) -> None:
    """Two clients hold different id blocks; whoever takes over, ids grow along the list."""
    await cluster.start(3)
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        for round_ in range(3):
            client = bk if round_ % 2 == 0 else other
            writer = await open_log_writer(client, "ids", **QUORUM)  # type: ignore[arg-type]
            await writer.append(f"{round_}".encode())
            await writer.close()
    ids = (await describe_log(bk, "ids")).ledgers
    assert [e.ledger_id for e in ids] == sorted(e.ledger_id for e in ids)
    assert [r.payload for r in await _read_all(bk, "ids")] == [b"0", b"1", b"2"]


async def test_list_and_delete_logs(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    positions = await _write_ledgers(bk, "a", 2, 1)
    await _write_ledgers(bk, "b", 1, 1)
    await commit_cursor(bk, "a", "c1", positions[0])
    assert await list_logs(bk) == ["a", "b"]
    await delete_log(bk, "a", password=b"pw")
    assert await list_logs(bk) == ["b"]
    with pytest.raises(NoSuchLog):
        await describe_log(bk, "a")
    for position in positions:
        with pytest.raises(NoSuchLedger):
            await bk.open_ledger(position.ledger_id, password=b"pw")
    with pytest.raises(NoSuchLog):
        await read_cursors(bk, "a")
    assert await log_manager(bk).read_cursors("a") == {}  # the keys are gone too


async def test_bad_limits_and_arguments(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    with pytest.raises(BKInterfaceError, match="roll_bytes_max"):
        await open_log_writer(bk, "x", roll_bytes_max=0, **QUORUM)  # type: ignore[arg-type]
    writer = await open_log_writer(bk, "x", **QUORUM)  # type: ignore[arg-type]
    with pytest.raises(BKInterfaceError, match="not sequenced"):
        await writer.append(b"p", sequence=1)
    with pytest.raises(BKInterfaceError, match="end must be"):
        await open_log_reader(bk, "x", end=(1, 2))  # type: ignore[arg-type]


async def test_a_full_writer_rolls_again_once_another_client_truncates(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The list's cap made small (2 KiB: a few dozen ledgers) to fill it on real bookies: a writer
    whose automatic rolls are refused (LogFull) rolls again after `bkaio log truncate`-style
    truncation by another client, read from etcd (before, its own copy kept saying full)."""
    monkeypatch.setattr(log_metadata, "ENCODED_BYTES_MAX", 2048)
    monkeypatch.setattr(writer_module, "ROLL_RETRY_S", 0.05)
    monkeypatch.setattr(writer_module, "ROLL_FULL_RETRY_S_MAX", 0.2)
    await cluster.start(3)
    writer = await open_log_writer(bk, "full", **QUORUM, roll_entries_max=2)  # type: ignore[arg-type]
    await roll_until_full(writer)
    full = writer.ledger_ids
    async with BookKeeper.connect(cluster.url, config=CONFIG) as other:
        await truncate_log(other, "full", LogPosition(full[-5], 0), password=b"pw")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while writer.ledger_ids[-1] == full[-1] and loop.time() < deadline:
        await writer.append(b"y")
        await asyncio.sleep(0.02)
    assert writer.ledger_ids[0] == full[-5]
    assert writer.ledger_ids[-1] > full[-1]  # an automatic roll found the room
    await writer.close()
    assert [r.payload for r in await _read_all(bk, "full")][-1] == b"y"
