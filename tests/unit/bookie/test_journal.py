"""Journal group commit: durability before callbacks, ordering, grouping, rolls, failures."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from bookie import journal_format as fmt
from bookie.fileio import OS_FILE_IO
from bookie.journal import Journal, JournalConfig, JournalError
from bookie.journal_format import Position

from .fakes import FaultyFileIO

SMALL = JournalConfig(segment_bytes=64 * 1024, record_bytes_max=4096)


def _record(i: int, size: int = 100) -> tuple[bytes, ...]:
    payload = fmt.LEDGER_ENTRY.pack(1, i) + bytes([i % 256]) * size
    return fmt.encode_entry_head(payload), payload


def _read_all(directory: Path) -> list[tuple[int, int]]:
    out = []
    for name in sorted(os.listdir(directory)):
        segment_id = fmt.parse_segment_name(name)
        assert segment_id is not None
        data = (directory / name).read_bytes()
        if fmt.check_segment_header(data, segment_id) is not fmt.SegmentHeader.VALID:
            continue
        scan = fmt.scan(data, fmt.SEGMENT_HEADER_BYTES, segment_id)
        assert scan.tail is fmt.Tail.CLEAN
        out += [fmt.parse_ledger_entry(r.body) for r in scan.records]
    return out


async def test_callbacks_fire_after_sync_in_order_on_the_loop(tmp_path: Path) -> None:
    fileio = FaultyFileIO()
    fileio.sync_gate = threading.Event()
    journal = Journal(fileio, str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    done: list[int] = []
    loop_thread = threading.current_thread()

    def callback(i: int) -> object:
        def cb(error: BaseException | None) -> None:
            assert error is None
            assert threading.current_thread() is loop_thread
            done.append(i)

        return cb

    for i in range(10):
        journal.append(_record(i), callback(i))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert done == []  # the sync has not returned: nothing may be acknowledged
    fileio.sync_gate.set()
    await journal.close()
    assert done == list(range(10))
    assert fileio.sync_threads == {next(iter(fileio.sync_threads))}
    assert next(iter(fileio.sync_threads)).startswith("journal-writer")
    assert _read_all(tmp_path) == [(1, i) for i in range(10)]


async def test_records_are_counted_with_or_without_a_completion(tmp_path: Path) -> None:
    """``records_written`` (the checkpoint policy's bound, bookie_journal_records_total) counts
    records: those appended with no completion (compaction's copies, a ledger's key) too, and a
    sync, a completion of no record, not."""
    journal = Journal(OS_FILE_IO, str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    for i in range(30):
        journal.append(_record(i), None)
    acked: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    journal.append(_record(30), acked.set_result)
    assert journal.queue_records == 31
    synced: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    journal.sync(synced.set_result)
    assert await acked is None
    assert await synced is None
    assert journal.records_written == 31
    assert journal.group_records.snapshot()[1] == 31  # the sum over the groups
    assert journal.queue_records == 0
    await journal.close()
    assert _read_all(tmp_path) == [(1, i) for i in range(31)]


async def test_records_gather_while_a_sync_is_in_flight(tmp_path: Path) -> None:
    fileio = FaultyFileIO()
    fileio.sync_gate = threading.Event()
    journal = Journal(fileio, str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    journal.append(_record(0), None)
    await asyncio.sleep(0.02)  # group 1 is now blocked in its sync
    for i in range(1, 50):
        journal.append(_record(i), None)
    fileio.sync_gate.set()
    await journal.close()
    assert journal.groups_written == 2
    assert _read_all(tmp_path) == [(1, i) for i in range(50)]


async def test_segments_roll_and_replay_in_order(tmp_path: Path) -> None:
    journal = Journal(FaultyFileIO(), str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    positions = [journal.append(_record(i, 3000), None) for i in range(100)]
    await journal.close()
    assert len({segment_id for segment_id, _ in positions}) > 3
    assert _read_all(tmp_path) == [(1, i) for i in range(100)]


async def test_sync_barrier_waits_for_earlier_records(tmp_path: Path) -> None:
    journal = Journal(FaultyFileIO(), str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    order: list[str] = []
    journal.append(_record(0), lambda e: order.append("record"))
    journal.sync(lambda e: order.append("barrier"))
    await journal.close()
    assert order == ["record", "barrier"]


async def test_sync_failure_fails_callbacks_and_later_appends(tmp_path: Path) -> None:
    fileio = FaultyFileIO()
    fileio.fail_sync = True
    journal = Journal(fileio, str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    errors: list[BaseException | None] = []
    journal.append(_record(0), errors.append)
    await asyncio.sleep(0.1)
    assert len(errors) == 1
    assert isinstance(errors[0], JournalError)
    with pytest.raises(JournalError):
        journal.append(_record(1), None)
    await journal.close()


async def test_timed_policy_waits_then_flushes(tmp_path: Path) -> None:
    config = JournalConfig(segment_bytes=64 * 1024, record_bytes_max=4096, group_wait_ms=30)
    journal = Journal(FaultyFileIO(), str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), config)
    done: list[float] = []
    loop = asyncio.get_running_loop()
    start = loop.time()
    journal.append(_record(0), lambda e: done.append(loop.time() - start))
    await asyncio.sleep(0.2)
    assert done
    assert done[0] >= 0.025
    await journal.close()


async def test_pressure_signalled_over_queue_bound(tmp_path: Path) -> None:
    fileio = FaultyFileIO()
    fileio.sync_gate = threading.Event()
    config = JournalConfig(segment_bytes=256 * 1024, record_bytes_max=4096, queue_bytes_max=10_000)
    journal = Journal(fileio, str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), config)
    signals: list[bool] = []
    journal.on_pressure = signals.append
    journal.append(_record(0), None)
    await asyncio.sleep(0.02)
    for i in range(1, 200):
        journal.append(_record(i), None)
    assert signals == [True]
    fileio.sync_gate.set()
    await journal.close()
    assert signals == [True, False]


async def test_oversized_record_refused(tmp_path: Path) -> None:
    journal = Journal(FaultyFileIO(), str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    with pytest.raises(JournalError):
        journal.append(_record(0, 5000), None)
    await journal.close()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="segment_bytes"):
        JournalConfig(segment_bytes=1000).validate()
    with pytest.raises(ValueError, match="group_wait_ms"):
        JournalConfig(group_wait_ms=-1).validate()


async def _rolled(journal: Journal) -> BaseException | None:
    """Roll (retrying while the next segment is being created ahead) and wait until durable."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BaseException | None] = loop.create_future()
    deadline = loop.time() + 5
    while not journal.roll(lambda error: done.done() or done.set_result(error)):
        assert loop.time() < deadline, "the next segment never became ready"
        await asyncio.sleep(0.01)
    return await done


async def test_roll_ends_the_segment_and_the_journal_goes_on_in_the_next(tmp_path: Path) -> None:
    """A roll (GC, for a mostly dead current segment) is a natural roll on disk: the old segment
    ends in zeros, the next one holds the records after it; it needs the next segment created
    ahead of time, and is refused on a segment without a record."""
    journal = Journal(FaultyFileIO(), str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    assert not journal.roll(lambda error: None)  # nothing in segment 1 yet
    before = [journal.append(_record(i), None) for i in range(5)]
    assert {segment for segment, _ in before} == {1}
    assert await _rolled(journal) is None
    assert journal.segment_id == 2
    assert journal.synced_position == Position(2, fmt.SEGMENT_HEADER_BYTES)  # nothing pending in 1
    assert not journal.roll(lambda error: None)  # segment 2 holds no record yet
    after = [journal.append(_record(i), None) for i in range(5, 10)]
    assert {segment for segment, _ in after} == {2}
    await journal.close()
    end = journal.synced_position
    assert end.segment_id == 2
    assert _read_all(tmp_path) == [(1, i) for i in range(10)]

    # restarted where it stopped (as replay would say): rolling needs its next segment created
    # ahead, which an idle journal is asked for by the refused roll itself
    journal = Journal(FaultyFileIO(), str(tmp_path), end, SMALL)
    assert not journal.next_segment_ready
    assert await _rolled(journal) is None
    journal.append(_record(10), None)
    await journal.close()
    assert _read_all(tmp_path) == [(1, i) for i in range(11)]


async def test_roll_with_records_pending_completes_them_first(tmp_path: Path) -> None:
    fileio = FaultyFileIO()
    journal = Journal(fileio, str(tmp_path), Position(1, fmt.SEGMENT_HEADER_BYTES), SMALL)
    journal.append(_record(0), None)
    await asyncio.sleep(0.05)  # the next segment is created ahead after this group
    assert journal.next_segment_ready
    fileio.sync_gate = threading.Event()
    order: list[str] = []
    journal.append(_record(1), lambda e: order.append("in flight"))
    await asyncio.sleep(0.02)  # its group waits in its fdatasync
    journal.append(_record(2), lambda e: order.append("gathering"))
    assert journal.roll(lambda e: order.append("rolled"))
    journal.append(_record(3), lambda e: order.append("after the roll"))
    fileio.sync_gate.set()
    await journal.close()
    assert order == ["in flight", "gathering", "rolled", "after the roll"]
    assert _read_all(tmp_path) == [(1, i) for i in range(4)]
