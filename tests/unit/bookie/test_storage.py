"""Storage: durable adds, fence, LAC, restart replay, checkpoints, torn tails, guards."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import shutil
import struct
from pathlib import Path

import pytest

from bookie import journal_format as fmt
from bookie.checkpoint import CheckpointCorrupt
from bookie.cookie import CookieMismatch
from bookie.fileio import OS_FILE_IO, FileIO
from bookie.journal import JournalConfig, JournalError
from bookie.ledger_state import LONG_POLL_WAITERS_PER_LEDGER_MAX, WakeReason
from bookie.processor import batch_bytes_max
from bookie.storage import (
    AddBatch,
    EntryCorrupt,
    Fenced,
    NoEntry,
    NoLedger,
    Storage,
    StorageConfig,
    Unauthorized,
    durable_future,
)
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import BATCH_READ_COUNT_MAX

from .fakes import FaultyFileIO

KEY = b"k" * 32
JOURNAL = JournalConfig(segment_bytes=256 * 1024, record_bytes_max=8192)


def body(ledger_id: int, entry_id: int, lac: int, payload: bytes = b"") -> bytes:
    payload = payload or f"entry-{ledger_id}-{entry_id}".encode()
    return struct.pack(">qqqq", ledger_id, entry_id, lac, len(payload)) + b"\0\0\0\0" + payload


def config(path: Path, bookie_id: str = "bookie-1") -> StorageConfig:
    return StorageConfig(data_dir=str(path), bookie_id=bookie_id, journal=JOURNAL, checkpoint_interval_s=3600)


class Done(AddBatch):
    """Completion of a test's adds: ``target`` is the future their outcome goes to."""

    __slots__ = ()

    def on_error(self, request_id: int, error: BaseException) -> None:
        self.target.set_exception(error)

    def on_durable(self, error: BaseException | None) -> None:
        if error is None:
            self.target.set_result(None)
        else:
            self.target.set_exception(error)


def start_add(
    storage: Storage, ledger_id: int, entry_id: int, entry: bytes, *, recovery: bool = False, key: bytes = KEY
) -> asyncio.Future[None]:
    """Journal one add (its own reply target); the future completes once it is durable."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    requests = m.AddRequests()
    requests.append(m.AddEntryRequest(entry_id, ledger_id, entry_id, int(recovery), key, entry))
    storage.add_run(requests, future, Done)
    return future


async def add(
    storage: Storage,
    ledger_id: int,
    entry_id: int,
    *,
    recovery: bool = False,
    key: bytes = KEY,
    payload: bytes = b"",
) -> None:
    entry = body(ledger_id, entry_id, entry_id - 1, payload)
    await start_add(storage, ledger_id, entry_id, entry, recovery=recovery, key=key)


async def durable(start: object) -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    start(lambda error: future.set_result(None) if error is None else future.set_exception(error))  # type: ignore[operator]
    await future


async def test_add_then_read_back(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for i in range(20):
        await add(storage, 1, i)
    assert (await storage.read_entry(1, 7))[1] == body(1, 7, 6)
    assert (await storage.read_entry(1, -1)) == (19, body(1, 19, 18))
    assert storage.ledger(1).lac == 18
    assert await storage.read_range(1, 5, 3, 1 << 20) == [body(1, i, i - 1) for i in (5, 6, 7)]
    with pytest.raises(NoEntry):
        await storage.read_entry(1, 20)
    with pytest.raises(NoLedger):
        await storage.read_entry(2, 0)
    await storage.close()


async def test_read_range__with_a_step_reads_one_bookies_stripe(tmp_path: Path) -> None:
    """A striped bookie (E3/Qw2, index 0) holds entries 0, 2, 3, 5, 6, 8, ...: a step of 3 from 0
    reads its share 0, 3, 6, ... and stops at the first of those it lacks."""
    storage = await Storage.open(config(tmp_path))
    held = [i for i in range(12) if (0 - i) % 3 < 2 and i != 9]
    for i in held:
        await add(storage, 1, i)
    assert await storage.read_range(1, 0, 100, 1 << 20, 3) == [body(1, i, i - 1) for i in (0, 3, 6)]
    assert await storage.read_range(1, 2, 2, 1 << 20, 3) == [body(1, i, i - 1) for i in (2, 5)]
    assert await storage.read_range(1, 0, 100, 1 << 20) == [body(1, 0, -1)]  # consecutive: stops at 1
    await storage.close()


async def test_read_range_bounded_by_bytes_returns_at_least_one(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for i in range(5):
        await add(storage, 1, i)
    assert len(await storage.read_range(1, 0, 100, 1)) == 1
    assert len(await storage.read_range(1, 0, 2, 1 << 20)) == 2
    await storage.close()


@pytest.mark.parametrize("size", [1, 200, 300, 70_000])
def test_a_batch_answer_within_its_body_bound_fits_the_frame(size: int) -> None:
    """The bound the bookie gives read_range leaves room for each body's msgpack header: the
    fullest answer it allows (the most entries, the most body bytes) is a frame within the limit."""
    frame_bytes_max = 5 << 20
    bound = batch_bytes_max(frame_bytes_max, 1 << 30, BATCH_READ_COUNT_MAX)
    count = min(BATCH_READ_COUNT_MAX, max(1, bound // size))
    bodies = [b"x" * size] * count
    bodies[-1] = b"x" * (size + bound - count * size)  # the rest of the bound in the last body
    frame = m.encode_batch_read_ok(1, 1, 0, bodies, 0, 1)
    assert len(frame) - 4 <= frame_bytes_max
    assert batch_bytes_max(frame_bytes_max, 100, 1) == 100  # the reader's own bound wins


async def test_master_key_checked(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    with pytest.raises(Unauthorized):
        await add(storage, 1, 1, key=b"x" * 32)
    await storage.close()


async def test_a_refusing_journal_adopts_no_key_and_registers_no_ledger(tmp_path: Path) -> None:
    """A new ledger's key (first write) or fence (unknown ledger) is taken into memory only once
    its record is journaled: a failed journal leaves neither behind (a read of such a ledger
    must still answer NoLedger, not an empty ledger's NoEntry)."""
    fileio = FaultyFileIO()
    storage = await Storage.open(config(tmp_path), fileio)
    await add(storage, 1, 0)
    fileio.fail_sync = True
    with pytest.raises(JournalError):
        await add(storage, 1, 1)  # the journal fails, and refuses from now on
    with pytest.raises(JournalError):
        storage.ledger_for_write(2, KEY)
    with pytest.raises(JournalError):
        storage.fence(3, None, lambda error: None)
    assert sorted(storage.ledgers) == [1]
    with pytest.raises(NoLedger):
        await storage.read_entry(2, 0)
    await storage.close()


async def test_fence_rejects_adds_but_not_recovery_adds(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    await durable(lambda cb: storage.fence(1, KEY, cb))
    with pytest.raises(Fenced):
        await add(storage, 1, 1)
    await add(storage, 1, 1, recovery=True)
    await durable(lambda cb: storage.fence(1, None, cb))  # idempotent
    await storage.close()


async def test_restart_keeps_entries_fence_key_and_lac(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for i in range(10):
        await add(storage, 1, i)
    await durable(lambda cb: storage.write_lac(1, KEY, 42, b"lacbody", cb))
    await durable(lambda cb: storage.fence(1, KEY, cb))
    await durable(lambda cb: storage.fence(99, None, cb))  # unknown ledger: created fenced
    storage.abort()  # no final checkpoint: state must come from replay alone
    storage = await Storage.open(config(tmp_path))
    state = storage.ledger(1)
    assert state.fenced
    assert state.lac == 42
    assert state.lac_body == b"lacbody"
    assert state.master_key == KEY
    assert storage.ledger(99).fenced
    assert [(await storage.read_entry(1, i))[1] for i in range(10)] == [body(1, i, i - 1) for i in range(10)]
    with pytest.raises(Fenced):
        await add(storage, 1, 10)
    with pytest.raises(Unauthorized):
        await add(storage, 1, 10, recovery=True, key=b"y" * 32)
    await storage.close()


async def test_checkpoint_then_replay_only_the_rest(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for i in range(10):
        await add(storage, 1, i)
    assert await storage.checkpoint()
    assert not await storage.checkpoint()  # nothing moved
    for i in range(10, 15):
        await add(storage, 1, i)
    storage.abort()
    storage = await Storage.open(config(tmp_path))
    assert storage.ledger(1).index.last_entry_id == 14
    assert (await storage.read_entry(1, 12))[1] == body(1, 12, 11)
    await storage.close()
    storage = await Storage.open(config(tmp_path))  # after a clean close: all from the checkpoint
    assert len(storage.ledger(1).index) == 15
    await storage.close()


async def _checkpointed(storage: Storage) -> None:
    """Until the checkpoint on disk covers everything journaled (the storage's own task writes
    it); bounded, so a policy that never fires fails instead of hanging."""
    for _ in range(200):
        if storage.checkpointed_position == storage.journal.synced_position:
            return
        await asyncio.sleep(0.05)
    synced = storage.journal.synced_position
    raise AssertionError(f"no checkpoint: {storage.checkpointed_position} vs {synced}")


async def test_what_a_restart_replayed_is_checkpointed_at_once(tmp_path: Path) -> None:
    """Issue 19: an idle bookie used to keep the old checkpoint after replaying (its position was
    taken for the end of the replay), so each crash of a crash loop replayed the whole tail again.
    The replayed records are checkpointed right after the start, well before the interval."""
    storage = await Storage.open(config(tmp_path))  # checkpoint_interval_s=3600
    for i in range(30):
        await add(storage, 1, i)
    storage.abort()
    storage = await Storage.open(config(tmp_path))
    assert storage.checkpointed_position != storage.journal.synced_position  # replay started before
    await _checkpointed(storage)
    storage.abort()
    storage = await Storage.open(config(tmp_path))
    assert storage.checkpointed_position == storage.journal.synced_position  # nothing left to replay
    assert [(await storage.read_entry(1, i))[1] for i in (0, 29)] == [body(1, 0, -1), body(1, 29, 28)]
    await storage.close()


@pytest.mark.parametrize("bound", ["records", "bytes"])
async def test_a_checkpoint_is_due_after_so_many_journal_records_or_bytes(tmp_path: Path, bound: str) -> None:
    """Replay after a crash is bounded by the checkpoint policy whatever the write rate: the journal
    growing by ``checkpoint_journal_records`` / ``_bytes`` since the last checkpoint makes one due
    long before the interval."""
    limits = {"checkpoint_journal_records": 20} if bound == "records" else {"checkpoint_journal_bytes": 4096}
    storage = await Storage.open(dataclasses.replace(config(tmp_path), **limits))
    assert not storage.checkpoint_due(0.0)  # nothing journaled
    for i in range(5):
        await add(storage, 1, i)
    assert not storage.checkpoint_due(0.0)
    assert storage.checkpoint_due(3600.0)  # the interval
    for i in range(5, 40):
        await add(storage, 1, i, payload=b"p" * 200)
    await _checkpointed(storage)  # the policy's own task wrote it: the interval is an hour
    assert not storage.checkpoint_due(0.0)
    await storage.close()


async def test_records_journaled_without_a_completion_count_towards_a_checkpoint(tmp_path: Path) -> None:
    """Compaction's copies (and a new ledger's key) are journaled with no completion of their own,
    then one sync: they grow what a restart replays as much as adds do, so they count towards
    ``checkpoint_journal_records`` (they used to count as one, the sync)."""
    storage = await Storage.open(dataclasses.replace(config(tmp_path), checkpoint_journal_records=20))
    for i in range(25):  # as bookie/compaction.py copies live records
        storage.journal.append((fmt.encode_entry(body(1, i, i - 1)),), None)
    await durable(storage.journal.sync)
    assert storage.journal.records_written == 25
    assert storage.checkpoint_due(0.0)
    await storage.close()


async def test_a_failed_checkpoint_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk a half-written checkpoint copy would keep its space (a whole checkpoint,
    ~100 MB at a million ledgers) and eat the reserve the journal needs."""
    storage = await Storage.open(config(tmp_path))
    for i in range(50):
        await add(storage, 1, i)
    await storage.write_checkpoint()
    await add(storage, 1, 50)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="No space"):
        await storage.write_checkpoint()
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == ["checkpoint"]

    def rename(src: str, dst: str) -> None:
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(storage.fileio, "rename", rename)  # a failed rename: the copy goes too
    with pytest.raises(OSError, match="Input/output"):
        await storage.write_checkpoint()
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == ["checkpoint"]
    await storage.write_checkpoint()
    await storage.close()


async def test_corrupt_checkpoint_refuses(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    await storage.close()
    path = tmp_path / "index" / "checkpoint"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt):
        await Storage.open(config(tmp_path))


async def test_segments_roll_and_everything_replays(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    payload = b"p" * 4000
    for i in range(200):
        await add(storage, 1, i, payload=payload)
    storage.abort()
    assert len(os.listdir(tmp_path / "journal")) > 3
    storage = await Storage.open(config(tmp_path))
    assert [(await storage.read_entry(1, i))[1] for i in range(200)] == [
        body(1, i, i - 1, payload) for i in range(200)
    ]
    await storage.close()


def patch(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes in place (damage on disk)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _journal_file(path: Path) -> Path:
    return path / "journal" / fmt.segment_name(1)


def _flip_last_byte(storage: Storage, path: Path, ledger_id: int, entry_id: int) -> None:
    """Damage an entry's journal record on disk: its last byte flipped (its checksum fails)."""
    location = storage.ledger(ledger_id).index.get(entry_id)
    assert location is not None
    offset = location.offset + location.length - 1
    patch(_journal_file(path), offset, bytes([_journal_file(path).read_bytes()[offset] ^ 0xFF]))


async def test_torn_tail_sweep_every_offset_in_last_three_records(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    storage = await Storage.open(config(origin))
    for i in range(50):
        await add(storage, 1, i)
    ends = [loc.offset + loc.length for _, loc in storage.ledger(1).index.items()]
    storage.abort()
    segment = _journal_file(origin).read_bytes()
    first_cut = ends[46]  # start of record 47
    for cut in range(first_cut, ends[49]):
        work = tmp_path / f"cut-{cut}"
        shutil.copytree(origin, work)
        os.truncate(_journal_file(work), cut)
        assert len(segment) > cut
        storage = await Storage.open(config(work))
        expected = sum(1 for end in ends if end <= cut)
        assert storage.ledger(1).index.last_entry_id == expected - 1, cut
        in_limbo = cut not in ends  # a cut that zeroed bytes: in limbo (bookie/limbo.py)
        assert (storage.limbo is not None) == in_limbo, cut
        # the journal continues cleanly after the cut (a recovery add passes limbo)
        await add(storage, 1, expected, recovery=in_limbo)
        storage.abort()
        storage = await Storage.open(config(work))
        assert storage.ledger(1).index.last_entry_id == expected, cut
        storage.abort()
        shutil.rmtree(work)


async def test_corrupt_middle_record_refuses_to_start(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for i in range(10):
        await add(storage, 1, i)
    location = storage.ledger(1).index.get(3)
    assert location is not None
    storage.abort()
    patch(_journal_file(tmp_path), location.offset + 30, b"\xff\xfe")
    with pytest.raises(fmt.JournalCorrupt, match="refusing to start"):
        await Storage.open(config(tmp_path))


async def _roll(storage: Storage) -> None:
    """GC's roll of the current segment (once the next one is created ahead of time)."""
    rolled, done = durable_future(asyncio.get_running_loop())
    deadline = asyncio.get_running_loop().time() + 5
    while not storage.journal.roll(done):
        assert asyncio.get_running_loop().time() < deadline, "the next segment never became ready"
        await asyncio.sleep(0.01)
    await rolled


async def test_damage_in_the_last_group_before_a_roll_refuses_to_start(tmp_path: Path) -> None:
    """After a roll the next segment holds its header alone, written once the rolled segment's
    last group was synced: damage there is damage to acknowledged data, never a torn tail to cut."""
    storage = await Storage.open(config(tmp_path))
    for i in range(5):
        await add(storage, 1, i)
    await _roll(storage)
    location = storage.ledger(1).index.get(4)
    assert location is not None
    assert location.segment_id == 1
    storage.abort()
    patch(_journal_file(tmp_path), location.offset + location.length - 3, b"\xff")
    with pytest.raises(fmt.JournalCorrupt, match="refusing to start"):
        await Storage.open(config(tmp_path))


async def test_after_a_roll_and_a_restart_the_journal_goes_on_in_the_next_segment(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    await _roll(storage)
    await storage.close()
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 1)
    location = storage.ledger(1).index.get(1)
    assert location is not None
    assert location.segment_id == 2  # not back in the rolled segment (GC rolled it to reclaim it)
    await storage.close()


async def test_no_checkpoint_with_segments_already_deleted_refuses_to_start(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    await _roll(storage)
    await add(storage, 3, 0)
    await storage.close()
    os.remove(_journal_file(tmp_path))  # as GC deletes a covered segment; then the checkpoint is lost
    os.remove(tmp_path / "index" / "checkpoint")
    with pytest.raises(fmt.JournalCorrupt, match="no index checkpoint"):
        await Storage.open(config(tmp_path))


async def test_a_forgotten_ledger_with_records_in_flight_stays_forgotten_after_a_crash(
    tmp_path: Path,
) -> None:
    """GC forgets a fenced ledger while one of its records is journaled but not durable, then
    checkpoints: that checkpoint must cover the record, or replay brings the ledger back from it
    alone, with no key and no fence."""
    storage = await Storage.open(config(tmp_path))
    for i in range(5):
        await add(storage, 7, i)
    await durable(lambda cb: storage.fence(7, KEY, cb))
    await storage.write_checkpoint()
    in_flight, done = durable_future(asyncio.get_running_loop())
    storage.write_lac(7, KEY, 3, b"", done)  # journaled, not durable yet
    assert storage.forget_ledger(7)
    await storage.write_checkpoint()
    await in_flight
    storage.abort()  # kill -9
    storage = await Storage.open(config(tmp_path))
    assert 7 not in storage.ledgers
    await storage.close()


async def test_a_ledger_forgotten_while_a_checkpoint_waits_for_its_sync_stays_forgotten(
    tmp_path: Path,
) -> None:
    """GC forgets in slices, loop turns apart: a checkpoint may start between two, wait for its
    sync, and meanwhile a record of ledger 7 is journaled and 7 forgotten. The checkpoint must sync
    again before it takes its position, or replay brings 7 back with no key and no fence."""
    storage = await Storage.open(config(tmp_path))
    for i in range(5):
        await add(storage, 7, i)
    await add(storage, 8, 0)
    await durable(lambda cb: storage.fence(7, KEY, cb))
    await storage.write_checkpoint()
    assert storage.forget_ledger(8)  # the first slice's forget
    checkpoint = asyncio.create_task(storage.write_checkpoint())
    await asyncio.sleep(0)  # the checkpoint waits for its sync
    in_flight, done = durable_future(asyncio.get_running_loop())
    storage.write_lac(7, KEY, 3, b"", done)  # journaled after the sync was asked for
    assert storage.forget_ledger(7)  # the next slice's forget
    await checkpoint
    await in_flight
    storage.abort()  # kill -9 before any later checkpoint
    storage = await Storage.open(config(tmp_path))
    assert 7 not in storage.ledgers, "a forgotten ledger came back (no key, no fence)"
    await storage.close()


async def test_corrupt_record_read_is_eio_not_no_entry(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for i in range(3):
        await add(storage, 1, i)
    _flip_last_byte(storage, tmp_path, 1, 1)
    with pytest.raises(EntryCorrupt):
        await storage.read_entry(1, 1)
    await storage.close()


class NothingCached(FileIO):
    """The disk as seen when the page cache holds nothing: every read goes to the reader thread."""

    def __init__(self) -> None:
        self.blocking_reads = 0

    def pread_nowait(self, fd: int, length: int, offset: int) -> None:
        return None

    def pread(self, fd: int, length: int, offset: int) -> bytes:
        self.blocking_reads += 1
        return super().pread(fd, length, offset)


class CannotTell(NothingCached):
    """A file seam whose ``pread_nowait`` can never find cached bytes, and says so."""

    reads_nowait = False

    def pread_nowait(self, fd: int, length: int, offset: int) -> None:
        raise AssertionError("asked for cached bytes it said it cannot tell")


async def test_a_file_seam_that_cannot_tell_cached_bytes_is_not_asked(tmp_path: Path) -> None:
    fileio = CannotTell()
    storage = await Storage.open(config(tmp_path), fileio)
    for i in range(3):
        await add(storage, 1, i)
    assert await storage.read_range(1, 0, 100, 1 << 20) == [body(1, i, i - 1) for i in range(3)]
    assert await storage.read_entry(1, 2) == (2, body(1, 2, 1))
    assert fileio.blocking_reads == 2
    await storage.close()


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "reader-thread"])
async def test_a_batch_stops_before_a_corrupt_record_and_fails_on_a_corrupt_first(
    tmp_path: Path, cached: bool
) -> None:
    """docs/protocol.md §7.6: a batch stops at the first entry the bookie cannot read (a short
    batch); when that is its first entry the read fails (EIO, never ENOENTRY). The same whether
    the records are read on the loop (cached) or on the reader thread."""
    fileio = OS_FILE_IO if cached else NothingCached()
    storage = await Storage.open(config(tmp_path), fileio)
    for i in range(8):
        await add(storage, 1, i)
    assert await storage.read_range(1, 0, 100, 1 << 20) == [body(1, i, i - 1) for i in range(8)]
    _flip_last_byte(storage, tmp_path, 1, 5)
    assert await storage.read_range(1, 2, 100, 1 << 20) == [body(1, i, i - 1) for i in (2, 3, 4)]
    with pytest.raises(EntryCorrupt, match="fails its checksum"):
        await storage.read_range(1, 5, 100, 1 << 20)
    with pytest.raises(EntryCorrupt, match="fails its checksum"):
        await storage.read_entry(1, 5)
    assert await storage.read_range(1, 6, 100, 1 << 20) == [body(1, i, i - 1) for i in (6, 7)]
    if not cached:
        assert isinstance(fileio, NothingCached)
        assert fileio.blocking_reads > 0
    await storage.close()


async def test_a_record_the_index_misplaces_is_eio(tmp_path: Path) -> None:
    """An index entry pointing at another entry's (valid) record is damage: EIO, never that body."""
    storage = await Storage.open(config(tmp_path))
    for i in range(3):
        await add(storage, 1, i)
    index = storage.ledger(1).index
    other = index.get(2)
    assert other is not None
    index.put(1, *other)
    with pytest.raises(EntryCorrupt, match="index points at another record"):
        await storage.read_entry(1, 1)
    assert await storage.read_range(1, 0, 100, 1 << 20) == [body(1, 0, -1)]  # a short batch
    await storage.close()


async def test_cookie_guards_the_data_dir(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    await add(storage, 1, 0)
    with pytest.raises(BlockingIOError):
        await Storage.open(config(tmp_path))  # the directory is locked by the running bookie
    await storage.close()
    with pytest.raises(CookieMismatch, match="belongs to bookie"):
        await Storage.open(config(tmp_path, bookie_id="bookie-2"))
    os.remove(tmp_path / "COOKIE")
    with pytest.raises(CookieMismatch, match="no COOKIE"):
        await Storage.open(config(tmp_path))


async def test_long_poll_waiters_wake_on_advance_fence_and_timeout(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    loop = asyncio.get_running_loop()
    await add(storage, 1, 0)
    state = storage.ledger(1)
    reasons: list[WakeReason] = []
    state.add_waiter(-1, 5.0, reasons.append, loop)
    state.add_waiter(0, 0.05, reasons.append, loop)
    await add(storage, 1, 1)  # piggybacks LAC 0: wakes the waiter at -1 only
    assert reasons == [WakeReason.ADVANCED]
    await asyncio.sleep(0.1)
    assert reasons == [WakeReason.ADVANCED, WakeReason.TIMEOUT]
    state.add_waiter(5, 5.0, reasons.append, loop)
    await durable(lambda cb: storage.fence(1, None, cb))
    assert reasons[-1] is WakeReason.FENCED
    assert not state.waiters
    for _ in range(LONG_POLL_WAITERS_PER_LEDGER_MAX):
        assert state.add_waiter(100, 5.0, reasons.append, loop) is not None
    assert state.add_waiter(100, 5.0, reasons.append, loop) is None
    for waiter in list(state.waiters):
        waiter.cancel()
    await storage.close()


def test_fast_add_response_encoding_matches_the_protocol() -> None:
    from bookkeeper_aio.protocol import messages as m

    for rid, lid, eid in [(0, 0, 0), (1, 2, 3), (2**64 - 1, 2**63 - 1, 2**63 - 1), (300, 70000, 2**40)]:
        assert m.encode_add_ok(rid, lid, eid) == m.encode(m.AddEntryResponse(rid, 0, None, lid, eid))


async def test_journal_shorter_than_the_checkpoint_refuses(tmp_path: Path) -> None:
    storage = await Storage.open(config(tmp_path))
    for i in range(5):
        await add(storage, 1, i)
    await storage.close()  # final checkpoint covers all five entries
    os.truncate(_journal_file(tmp_path), 100)
    with pytest.raises(fmt.JournalCorrupt, match="index checkpoint covers"):
        await Storage.open(config(tmp_path))
    os.truncate(_journal_file(tmp_path), 0)
    with pytest.raises(fmt.JournalCorrupt, match="index checkpoint covers"):
        await Storage.open(config(tmp_path))


async def test_a_segment_header_torn_inside_its_id_is_cut_as_a_torn_start(tmp_path: Path) -> None:
    """Simulation race seed 2677: the first fdatasync of a segment failed, so its header was never
    synced, and a power cut kept its first 12 bytes (magic, version, then zeros where the id goes).
    Nothing acknowledged lies behind it: the bookie starts, cuts it, and the journal goes on."""
    storage = await Storage.open(config(tmp_path))
    storage.abort()
    header = fmt.encode_segment_header(1, 0)
    _journal_file(tmp_path).write_bytes(header[:12] + bytes(4096))
    storage = await Storage.open(config(tmp_path))
    try:
        await add(storage, 1, 0)
    finally:
        storage.abort()
    storage = await Storage.open(config(tmp_path))
    try:
        assert (await storage.read_entry(1, 0))[1] == body(1, 0, -1)
    finally:
        storage.abort()


def _format_2_segment(segment_id: int, groups: list[list[bytes]]) -> bytes:
    """A journal segment as a bookie of journal format 2 wrote it: its header says version 2, its
    ENTRY records are of type 1 (the ids before the body, the CRC32C over length, type and body)."""
    out = fmt.SEGMENT_HEADER.pack(fmt.SEGMENT_MAGIC, 2, segment_id)
    for records in groups:
        out += fmt.encode_group_header(segment_id, len(out), sum(len(r) for r in records))
        out += b"".join(records)
    return out + bytes(4096)


@pytest.mark.parametrize("restart", ["abort", "close"])
async def test_a_format_2_journal_replays_and_the_journal_goes_on_in_a_format_3_segment(
    tmp_path: Path, restart: str
) -> None:
    """Journals on disk from before format 3: their records replay and read back (a read's batch
    spans both formats), the journal appends nothing to the old segment but goes on in the next
    one, whose header says version 3, and a restart (from replay alone, or from the checkpoint a
    close writes) reads both."""
    storage = await Storage.open(config(tmp_path))
    storage.abort()
    old = [fmt.encode_master_key(1, KEY)] + [fmt.encode_entry_v2(1, i, body(1, i, i - 1)) for i in range(3)]
    later = [fmt.encode_entry_v2(1, i, body(1, i, i - 1)) for i in range(3, 5)]
    segment = _format_2_segment(1, [old, later])
    _journal_file(tmp_path).write_bytes(segment)
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.ledger(1).lac == 3
        assert await storage.read_range(1, 0, 10, 1 << 20) == [body(1, i, i - 1) for i in range(5)]
        await add(storage, 1, 5)
        await add(storage, 1, 6)
        location = storage.ledger(1).index.get(5)
        assert location is not None
        assert location.segment_id == 2
    finally:
        if restart == "abort":
            storage.abort()
        else:
            await storage.close()
    assert _journal_file(tmp_path).read_bytes() == segment  # the old segment as it was
    new = (tmp_path / "journal" / fmt.segment_name(2)).read_bytes()
    assert fmt.segment_format(new) == fmt.SEGMENT_VERSION  # 3's records, the header of 4 (previous end)
    scan = fmt.scan(new, fmt.SEGMENT_HEADER_BYTES, 2)
    assert [r.type for r in scan.records] == [fmt.RecordType.ENTRY] * 2
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.journal.segment_id == 2  # the newest segment is of this format: appends go on there
        assert await storage.read_range(1, 0, 10, 1 << 20) == [body(1, i, i - 1) for i in range(7)]
        assert storage.ledger(1).lac == 5
    finally:
        storage.abort()


async def test_a_damaged_format_2_record_is_eio_and_a_torn_format_2_tail_is_cut(tmp_path: Path) -> None:
    """The old format keeps its checks: a flipped byte of a format-2 record read is EIO, and a torn
    final group of format 2 is cut (the entries before it stay)."""
    storage = await Storage.open(config(tmp_path))
    storage.abort()
    groups = [[fmt.encode_master_key(1, KEY), fmt.encode_entry_v2(1, 0, body(1, 0, -1))]]
    groups += [[fmt.encode_entry_v2(1, i, body(1, i, i - 1))] for i in (1, 2)]
    segment = bytearray(_format_2_segment(1, groups))
    last = len(segment) - 4096 - len(groups[-1][0])
    segment[last + 20 :] = bytes(len(segment) - last - 20)  # the last group torn mid-record
    _journal_file(tmp_path).write_bytes(bytes(segment))
    storage = await Storage.open(config(tmp_path))
    try:
        assert storage.ledger(1).index.get(2) is None
        _flip_last_byte(storage, tmp_path, 1, 1)
        with pytest.raises(EntryCorrupt):
            await storage.read_entry(1, 1)
        assert (await storage.read_entry(1, 0))[1] == body(1, 0, -1)
    finally:
        storage.abort()
