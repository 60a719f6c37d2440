"""The bookie's ADD hot path (the frames of a read in one ``Processor.dispatch_frames`` loop, inline
decode, storage and journal append, per-group batched completions) answers every request, and
journals every record, exactly as the generic path does."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest

from bookie.connection_handler import ConnectionLimits, ServerConnection
from bookie.journal import JournalConfig
from bookie.ledger_keys import KeyVerifier
from bookie.mode import ReadOnly
from bookie.processor import Processor
from bookie.storage import AddBatch, NoEntry, Storage, StorageConfig, durable_future
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import ReadFlag, StatusCode
from bookkeeper_aio.protocol.digest import key_check
from bookkeeper_aio.protocol.framing import LENGTH
from tests.unit.bookie.test_ledger_keys import Metadata

KEY = b"k" * 32


def entry(ledger_id: int, entry_id: int, lac: int, size: int = 40) -> bytes:
    payload = bytes((entry_id + i) & 0xFF for i in range(size))
    return struct.pack(">qqqq", ledger_id, entry_id, lac, len(payload)) + b"\0\0\0\0" + payload


def frame(*fields: Any) -> bytes:
    body = msgpack.packb(fields, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


class Transport:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def get_extra_info(self, name: str) -> None:
        return None

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...
    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None: ...
    def get_write_buffer_size(self) -> int:
        return 0  # written at once

    def close(self) -> None: ...


class Mode:
    reason = "test"

    def check_add(self, recovery: bool) -> None:
        if not recovery:
            raise ReadOnly("bookie is read-only (test)")


def requests() -> list[bytes]:
    good = [frame(1, rid, 1, rid, 0, KEY, entry(1, rid, rid - 1)) for rid in range(10)]
    return [
        b"".join(good),
        frame(1, 100, 1, 10, 0, KEY, entry(1, 10, 9)) + frame(1, 100, 1, 11, 0, KEY, entry(1, 11, 10)),
        frame(1, 101, 1, 12, 0, KEY, entry(1, 99, 11)),  # header names another entry
        frame(1, 102, 1, 12, 0, KEY, b"short"),
        frame(1, 103, 1, 12, 0, b"x" * 32, entry(1, 12, 11)),  # wrong master key: EUA
        frame(1, 104, 1, 12, 0, "text key", entry(1, 12, 11)),
        frame(1, 105, 1, 12, 256, KEY, entry(1, 12, 11)),
        frame(1, 106, 1, 12, 0, KEY, entry(1, 12, 11), "trailing"),  # trailing fields ignored
        frame(1, 107, 1, 13, 0, list(range(8)), entry(1, 13, 12)),  # nested array
        frame(1, 108, 1, -1, 0, KEY, entry(1, -1, 12)),
        frame(1, 109, 2, 0, 0, KEY, entry(2, 0, -1)),  # fenced ledger: EFENCED
        frame(1, 110, 2, 1, 1, KEY, entry(2, 1, 0)),  # recovery add: passes the fence
        frame(1, 111, 3, 0, 0, KEY, entry(3, 0, -1, size=70_000)),  # over the inline size
        b"".join(frame(1, 200 + e, 4, e, 0, KEY, entry(4, e, e - 1, size=30_000)) for e in range(10)),
        b"read-only",
        frame(1, 112, 1, 13, 0, KEY, entry(1, 13, 12)),  # EREADONLY
        frame(1, 113, 1, 14, 1, KEY, entry(1, 14, 13)),  # a recovery add passes
        b"writable",
        frame(1, 114, 1, 15, 0, KEY, entry(1, 15, 14)),
    ]


async def run(
    path: Path,
    add_acks: bool = False,
    stream: list[bytes] | None = None,
    chunk: int = 0,
    in_flight_max: int = 4096,
    segment_bytes: int = 210_000,
    record_bytes_max: int = 100_000,
) -> tuple[list[Any], bytes, dict[int, tuple[int, int, list[int]]]]:
    """Feed ``stream`` (default :func:`requests`) to one connection, each item as one read, or cut
    into reads of ``chunk`` bytes (frames split across reads, reads ending mid-frame)."""
    journal = JournalConfig(segment_bytes=segment_bytes, record_bytes_max=record_bytes_max)  # rolls
    storage = await Storage.open(StorageConfig(str(path), "b", journal=journal, checkpoint_interval_s=3600))
    processor = Processor(storage, "b", 5 << 20, mode=Mode())  # type: ignore[arg-type]
    fenced: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    storage.fence(2, KEY, lambda error: fenced.set_result(None))
    await fenced
    conn = ServerConnection(processor, ConnectionLimits(5 << 20, in_flight_max, 30.0), set())
    conn.add_acks = add_acks  # as after a HELLO that agreed on FEATURE_ADD_ACKS
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    reads: list[bytes] = []
    for data in requests() if stream is None else stream:
        if chunk and data not in (b"read-only", b"writable"):
            reads += [data[i : i + chunk] for i in range(0, len(data), chunk)]
        else:
            reads.append(data)
    for data in reads:
        if data in (b"read-only", b"writable"):
            processor.read_only = data == b"read-only"
            continue
        conn.data_received(data)
        for _ in range(2000):  # every answer before the next read (fsyncs are slow on a busy disk)
            await asyncio.sleep(0.001)
            if not conn.in_flight:
                break
    for _ in range(200):  # a permit-limited connection resumes as answers free permits
        if not conn.in_flight and not conn._buf:
            break
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.01)  # the last answers' flush (call_soon) may still be queued
    assert conn.in_flight == 0
    assert not conn.request_ids
    responses, buf = [], bytes(transport.data)
    while buf:
        (size,) = LENGTH.unpack_from(buf)
        responses.append(msgpack.unpackb(buf[4 : 4 + size]))
        buf = buf[4 + size :]
    ledgers = {
        lid: (state.lac, len(state.index), state.index.entry_ids()) for lid, state in storage.ledgers.items()
    }
    await storage.close()
    journal_dir = path / "journal"
    segments = b"".join((journal_dir / name).read_bytes() for name in sorted(os.listdir(journal_dir)))
    return responses, segments, ledgers


def generic_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ADD decoded by the generic validator: the codec's shortcut refuses them all."""

    def refuse(self: m.AddRequests, body: object) -> int:
        return -1

    monkeypatch.setattr(m.AddRequests, "take", refuse)


async def test_fast_path_matches_the_generic_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = await run(tmp_path / "fast")
    generic_only(monkeypatch)
    generic = await run(tmp_path / "generic")
    assert fast[0] == generic[0]
    assert fast[1] == generic[1]  # the same journal records at the same places
    assert fast[2] == generic[2]
    statuses = {response[1]: response[2] for response in fast[0]}
    assert [statuses[rid] for rid in range(10)] == [0] * 10
    assert [statuses[rid] for rid in range(101, 115)] == [
        *(404, 404, 502, 404, 404, 0, 404, 404, 504, 0, 0, 505, 0, 0)  # EBADREQ EUA EFENCED EREADONLY
    ]
    assert [statuses[rid] for rid in range(200, 210)] == [0] * 10
    assert fast[2][4] == (8, 10, list(range(10)))
    assert [r[2] for r in fast[0] if r[1] == 100] == [404, 0]  # the duplicate is refused, the first kept


async def test_add_acks_answer_the_same_requests_with_the_same_outcome(tmp_path: Path) -> None:
    """With FEATURE_ADD_ACKS agreed, every EOK add is named once in an ADD_ACKS response instead of
    its own answer; errors stay single answers; the journal and index are the same."""
    single = await run(tmp_path / "single")
    batched = await run(tmp_path / "batched", add_acks=True)
    assert batched[1] == single[1]
    assert batched[2] == single[2]

    def outcomes(responses: list[Any]) -> list[tuple[int, int]]:
        out = []
        for r in responses:
            if r[0] == 11:
                assert r[1:4] == [0, 0, None]
                out += [(rid, 0) for rid in r[4]]
            else:
                out.append((r[1], r[2]))
        return sorted(out)

    assert outcomes(batched[0]) == outcomes(single[0])
    in_add_acks = {rid for r in batched[0] if r[0] == 11 for rid in r[4]}
    assert {*range(10), *range(200, 210)} <= in_add_acks  # the inline path's adds (the generic
    # path, e.g. the 70 KB add, may still answer alone)
    assert any(r[0] == 11 and len(r[4]) >= 10 for r in batched[0])  # the first ten in one answer


async def test_the_before_ack_failpoint_is_passed_once_per_ack(tmp_path: Path) -> None:
    """The batched completion checks the failpoint table once per group, but while a failpoint is
    set it still passes ``bookie.before_ack`` once per ack (``count:N:kill`` counts acks)."""
    from bookkeeper_aio.common import failpoints as engine

    engine.configure("bookie.before_ack=count:1000000:kill")  # counted, never fires
    try:
        before = engine._hits.get("bookie.before_ack", 0)
        responses, _, _ = await run(tmp_path)
        acks = engine._hits.get("bookie.before_ack", 0) - before
    finally:
        engine.configure(None)
    assert acks == sum(1 for response in responses if response[2] == 0) == 26


async def generic_run(
    path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any
) -> tuple[list[Any], bytes, dict[int, tuple[int, int, list[int]]]]:
    with monkeypatch.context() as patch:
        generic_only(patch)
        return await run(path, **kwargs)


def mixed() -> list[bytes]:
    """Everything in one read: adds interleaved with other ops, errors, a duplicate, fences."""
    adds = [frame(1, rid, 1, rid, 0, KEY, entry(1, rid, rid - 1, size=3000)) for rid in range(40)]
    return [
        b"".join(
            [
                *adds[:5],
                frame(0, 300, 1, "test", 0),  # HELLO: another op in the middle of adds
                *adds[5:10],
                frame(1, 5, 1, 50, 0, KEY, entry(1, 50, 4)),  # duplicate of an add in flight
                frame(1, 301, 1, 51, 0, KEY, entry(1, 99, 4)),  # header names another entry
                frame(1, 302, 1, 52, 0, b"x" * 32, entry(1, 52, 4)),  # EUA
                frame(1, 303, 5, 0, 0, KEY, entry(5, 0, -1)),  # a new ledger: its key is journaled first
                frame(1, 304, 5, 1, 0, b"y" * 32, entry(5, 1, 0)),  # ... and enforced from then on
                frame(2, 305, 1, 0, 1, KEY, -1, 0),  # fencing read of ledger 1
                *adds[10:20],  # fenced: EFENCED
                frame(1, 306, 1, 60, 1, KEY, entry(1, 60, 9)),  # recovery add passes the fence
                frame(1, 307, 5, 2, 0, KEY, entry(5, 2, 1)),
                frame(1, 308, 6, 0, 0, b"z" * 32, entry(6, 0, -1)),  # a new ledger with another key
                frame(1, 309, 1, 61, 0, b"z" * 32, entry(1, 61, 9)),  # ... that is not ledger 1's: EUA
                *adds[20:],
            ]
        )
    ]


async def test_mixed_ops_in_one_read_match_frame_by_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = await run(tmp_path / "fast", stream=mixed())
    generic = await generic_run(tmp_path / "generic", monkeypatch, stream=mixed())
    assert fast[1:] == generic[1:]
    # The fencing read answers from a task (its place among the acks is timing): compare as sets.
    assert sorted(map(repr, fast[0])) == sorted(map(repr, generic[0]))
    statuses = [(r[1], r[2]) for r in fast[0]]
    assert (300, 0) in statuses
    assert (5, 404) in statuses
    assert (301, 404) in statuses
    assert (302, 502) in statuses
    assert (303, 0) in statuses
    assert (304, 502) in statuses
    assert (306, 0) in statuses
    assert (307, 0) in statuses
    assert (308, 0) in statuses
    assert (309, 502) in statuses
    assert {rid for rid, status in statuses if status == 504} == set(range(10, 40))


@pytest.mark.parametrize(("chunk", "items"), [(1, 3), (3, 12), (1000, 99), (4099, 99)])
async def test_frames_split_across_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, items: int
) -> None:
    """Reads ending mid-frame and mid-length-prefix: the same answers, journal and index as the
    generic path given the same reads (a frame completed by a read is answered before the next)."""
    stream = requests()[:items]
    generic = await generic_run(tmp_path / "generic", monkeypatch, stream=stream, chunk=chunk)
    fast = await run(tmp_path / "fast", stream=stream, chunk=chunk)
    assert fast == generic
    assert sum(1 for r in fast[0] if r[2] == 0) >= 10


@pytest.mark.parametrize("in_flight_max", [1, 3, 7])
async def test_the_permit_limit_reached_mid_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_flight_max: int
) -> None:
    """At ``in_flight_max`` the rest of the read stays in the buffer and is processed, in order, as
    answers free permits: the same answers, journal and index as the generic path under the same
    limit."""
    generic = await generic_run(tmp_path / "generic", monkeypatch, in_flight_max=in_flight_max)
    fast = await run(tmp_path / "fast", in_flight_max=in_flight_max)
    assert fast == generic
    statuses = {response[1]: response[2] for response in fast[0]}
    assert [statuses[rid] for rid in (*range(10), *range(200, 210))] == [0] * 20


async def test_the_fused_loop_stops_at_the_permit_limit(tmp_path: Path) -> None:
    journal = JournalConfig(segment_bytes=210_000, record_bytes_max=100_000)
    storage = await Storage.open(
        StorageConfig(str(tmp_path), "b", journal=journal, checkpoint_interval_s=3600)
    )
    processor = Processor(storage, "b", 5 << 20)
    conn = ServerConnection(processor, ConnectionLimits(5 << 20, 4, 30.0), set())
    conn.connection_made(Transport())  # type: ignore[arg-type]
    adds = [frame(1, rid, 1, rid, 0, KEY, entry(1, rid, rid - 1)) for rid in range(10)]
    conn.data_received(b"".join(adds) + adds[0][:3])
    assert conn.in_flight == 4
    assert bytes(conn._buf) == b"".join(adds[4:]) + adds[0][:3]  # unprocessed frames stay buffered
    assert conn._paused_by_permits
    await storage.close()


async def test_a_journal_roll_in_the_middle_of_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = [
        b"".join(frame(1, rid, 1, rid, 0, KEY, entry(1, rid, rid - 1, size=20_000)) for rid in range(60))
    ]
    fast = await run(tmp_path / "fast", stream=stream, segment_bytes=210_000)
    generic = await generic_run(tmp_path / "generic", monkeypatch, stream=stream, segment_bytes=210_000)
    assert fast == generic
    assert len(os.listdir(tmp_path / "fast" / "journal")) > 3  # rolled several times within the read
    assert [r[2] for r in fast[0]] == [0] * 60


async def test_a_record_over_the_journal_maximum_in_the_middle_of_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An add whose record exceeds the configured ``record_bytes_max`` (below the protocol's) is
    refused EIO at its place in the read; the adds around it are journaled as usual."""
    sizes = [1000, 1000, 12_000, 1000]
    stream = [
        b"".join(
            frame(1, rid, 1, rid, 0, KEY, entry(1, rid, rid - 1, size=size)) for rid, size in enumerate(sizes)
        )
    ]
    fast = await run(tmp_path / "fast", stream=stream, record_bytes_max=10_000)
    generic = await generic_run(tmp_path / "generic", monkeypatch, stream=stream, record_bytes_max=10_000)
    assert fast == generic
    assert sorted((r[1], r[2]) for r in fast[0]) == [(0, 0), (1, 0), (2, int(StatusCode.EIO)), (3, 0)]
    assert fast[2][1][2] == [0, 1, 3]


async def test_pressure_is_raised_by_the_read_that_crosses_it(tmp_path: Path) -> None:
    """A read whose adds take the journal backlog over ``queue_bytes_max`` calls ``on_pressure``
    once they are queued (the server then pauses every socket), and all its frames are journaled
    in order."""
    journal = JournalConfig(queue_bytes_max=50_000)
    storage = await Storage.open(
        StorageConfig(str(tmp_path), "b", journal=journal, checkpoint_interval_s=3600)
    )
    processor = Processor(storage, "b", 5 << 20)
    seen: list[tuple[bool, int]] = []
    storage.journal.on_pressure = lambda high: seen.append((high, storage.journal.queue_records))
    conn = ServerConnection(processor, ConnectionLimits(5 << 20, 4096, 30.0), set())
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(
        b"".join(frame(1, rid, 1, rid, 0, KEY, entry(1, rid, rid - 1, 5000)) for rid in range(30))
    )
    assert seen == [(True, 31)]  # its 30 adds and the ledger's key: records, not completions
    for _ in range(200):
        if not conn.in_flight:
            break
        await asyncio.sleep(0.005)
    assert conn.in_flight == 0
    assert storage.ledgers[1].index.entry_ids() == list(range(30))
    await storage.close()


async def test_a_long_polls_entry_gone_since_it_was_judged_present_leaves_the_lac_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long poll's piggybacked entry, present when the poll woke but gone by the read (its record
    re-keyed or forgotten meanwhile), is answered EOK with the LAC and no body, never ENOENTRY."""
    storage = await Storage.open(StorageConfig(str(tmp_path), "b", checkpoint_interval_s=3600))
    processor = Processor(storage, "b", 5 << 20)
    conn = ServerConnection(processor, ConnectionLimits(5 << 20, 64, 30.0), set())
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(b"".join(frame(1, rid, 1, rid, 0, KEY, entry(1, rid, rid - 1)) for rid in range(3)))
    for _ in range(200):
        if len(transport.data) >= 3 * 8:
            break
        await asyncio.sleep(0.01)
    transport.data.clear()

    async def gone(ledger_id: int, entry_id: int) -> Any:
        raise NoEntry(f"ledger {ledger_id} has no entry {entry_id}")

    monkeypatch.setattr(storage, "read_entry", gone)
    flags = ReadFlag.LONG_POLL | ReadFlag.ENTRY_PIGGYBACK
    poll = m.encode(m.ReadEntryRequest(50, 1, 1, flags, KEY, previous_lac=0, timeout_ms=1000))
    conn.data_received(poll)  # encode() frames it
    for _ in range(200):
        if transport.data:
            break
        await asyncio.sleep(0.01)
    (size,) = LENGTH.unpack_from(transport.data, 0)
    answer = m.decode_response(bytes(transport.data[4 : 4 + size]))
    assert isinstance(answer, m.ReadEntryResponse)
    assert (answer.request_id, answer.status, answer.body, answer.lac) == (50, StatusCode.EOK, None, 1)
    await storage.close()


async def test_a_keyless_record_takes_no_key_metadata_refutes(tmp_path: Path) -> None:
    """A record that holds no key (a keyless fence's) would adopt the first key a fence or a
    WRITE_LAC shows it: that key is checked against metadata first, and a wrong one gets EUA and
    leaves the record keyless; the ledger's real key is then taken."""
    real, junk = b"R" * 32, b"J" * 32
    storage = await Storage.open(StorageConfig(str(tmp_path), "b", checkpoint_interval_s=3600))
    storage.keys = KeyVerifier(storage, Metadata({9: key_check(real)}))
    fenced: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    storage.fence(9, None, lambda error: fenced.set_result(None))
    await fenced
    assert storage.ledger(9).master_key is None
    processor = Processor(storage, "b", 5 << 20)
    conn = ServerConnection(processor, ConnectionLimits(5 << 20, 64, 30.0), set())
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]

    async def answer(request: Any) -> Any:
        transport.data.clear()
        conn.data_received(m.encode(request))
        for _ in range(500):
            if transport.data:
                break
            await asyncio.sleep(0.01)
        (size,) = LENGTH.unpack_from(transport.data, 0)
        return m.decode_response(bytes(transport.data[4 : 4 + size]))

    refused = await answer(m.ReadEntryRequest(1, 9, -1, ReadFlag.FENCE_LEDGER, junk))
    assert refused.status == StatusCode.EUA
    assert storage.ledger(9).master_key is None
    taken = await answer(m.ReadEntryRequest(2, 9, -1, ReadFlag.FENCE_LEDGER, real))
    assert taken.status in (StatusCode.EOK, StatusCode.ENOENTRY)
    assert storage.ledger(9).master_key == real
    await storage.close()


class _Replies(AddBatch):
    """Adds' completions into ``target`` (a list); a refused add fails the test."""

    __slots__ = ()

    def on_error(self, request_id: int, error: BaseException) -> None:
        raise AssertionError(f"add {request_id} refused: {error!r}")

    def on_durable(self, error: BaseException | None) -> None:
        self.target.append(error)


def _adds(ledger_id: int, entry_ids: list[int]) -> m.AddRequests:
    adds = m.AddRequests()
    for eid in entry_ids:
        rid = ledger_id * 1000 + eid
        assert adds.take(msgpack.packb((1, rid, ledger_id, eid, 0, KEY, entry(ledger_id, eid, eid - 1)))) >= 0
    return adds


async def test_later_reads_of_a_group_go_on_the_run_only_when_back_to_back(tmp_path: Path) -> None:
    """A later socket read's adds of the same connection and ledger, in the same journal group, go
    on the same run (one index loop per run); not when any record was journaled between them (a
    new ledger's key): the index would then point past the entry. Every entry reads back intact."""
    storage = await Storage.open(StorageConfig(str(tmp_path), "b", checkpoint_interval_s=3600))
    try:
        done: list[BaseException | None] = []
        storage.add_run(_adds(1, [0, 1]), done, _Replies)
        storage.add_run(_adds(1, [2, 3]), done, _Replies)  # back to back: the same run
        storage.ledger_for_write(7, KEY)  # a MASTER_KEY record with no completion of its own
        storage.add_run(_adds(1, [4]), done, _Replies)  # after it: a run of its own
        storage.add_run(_adds(5, [0]), done, _Replies)  # a new ledger: its key, then its run
        storage.add_run(_adds(1, [5, 6]), done, _Replies)  # back to back, but another ledger's run
        batch = storage.journal.last_callback
        assert isinstance(batch, _Replies)
        runs = [(run.state.ledger_id, batch.entry_ids[run.start : run.stop]) for run in batch.runs]
        assert runs == [(1, [0, 1, 2, 3]), (1, [4]), (5, [0]), (1, [5, 6])]
        synced, callback = durable_future(asyncio.get_running_loop())
        storage.force(callback)
        await synced
        assert done == [None]
        for lid, eid in [(1, e) for e in range(7)] + [(5, 0)]:
            assert bytes((await storage.read_entry(lid, eid))[1]) == entry(lid, eid, eid - 1)
        assert storage.ledgers[1].piggyback_lac == 5
    finally:
        await storage.close()
