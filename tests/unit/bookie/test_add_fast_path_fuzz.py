"""Differential fuzz: the add hot path (the codec's ADD shortcut, one ``Storage.add_run`` per run of
adds in a read) vs the generic path (every ADD through the generic validator, one add at a time).

Random streams: adds of many sizes (segment rolls, records over record_bytes_max), new ledgers
(key records), WRITE_LAC (key + LAC records), FORCE_LEDGER, fencing reads, HELLO, malformed and
duplicate frames; random read chunking. Compared: journal bytes, responses, and every index
location; then each indexed entry is read back (offset/segment check) and the journal replayed.

Deterministic: the journal's groups depend on when the writer thread's fdatasync returns, so with a
real thread the journal bytes of two runs differed under load. Both runs write each group inline
on the event loop instead (:class:`InlineThreads`), its completion queued like the thread's: the
groups then follow from the streams and the loop alone. So do reads: the first read of a segment
goes to the reader executor (no descriptor open yet), and on a real thread the LAC its answer
carries depended on how far the loop got meanwhile (seed 25 once the journal's ENTRY records
shrank by 16 bytes and moved the segment rolls); they run at once, on the loop, instead.
Time is the loop's own, and it moves only when the test steps it (:class:`SteppedLoop`): with
``group_wait_ms > 0`` a group goes out on a timer, and on the real clock whether a request was
answered before a later frame reused its id (accepted) or not (refused as a duplicate) depended on
the machine's load (seed 5 journaled entry 5077 in one run and refused it in the other).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import msgpack
import pytest

from bookie import journal_format as fmt
from bookie.connection_handler import ConnectionLimits, ServerConnection
from bookie.journal import JournalConfig
from bookie.processor import Processor
from bookie.storage import Storage, StorageConfig
from bookie.threads import OsThreads, Worker
from bookkeeper_aio.protocol.framing import LENGTH
from tests.unit.bookie.test_add_fast_path import KEY, Transport, entry, frame, generic_only


class _InlineWorker:
    """The journal writer's worker without a thread: each group is written and synced at once, on
    the loop; the journal queues its completion (``call_soon_threadsafe`` from the loop's own thread:
    the next iteration), at a place that depends on nothing but the loop."""

    def __init__(self, handle: Callable[[Any], None]) -> None:
        self.submit = handle

    def stop(self) -> None:
        pass


class _InlineExecutor(Executor):
    """An executor that runs each call at once, on the caller's thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the awaiting caller
            future.set_exception(exc)
        return future


class InlineThreads(OsThreads):
    """An inline journal writer and reader; real executors for the rest (recovery)."""

    def start_worker(self, handle: Callable[[Any], None], name: str) -> Worker:
        return _InlineWorker(handle)

    def executor(self, name: str) -> Executor:
        return _InlineExecutor() if name == "storage-reader" else super().executor(name)


INLINE = InlineThreads()


class SteppedLoop(asyncio.SelectorEventLoop):
    """An event loop whose time moves only in :meth:`step`: its timers (the journal's timed groups)
    fire after the same frames in every run, however slow the machine. Threads (recovery at open,
    the checkpoint at close) still wake it as usual."""

    def __init__(self) -> None:
        super().__init__()
        self._now_s = 0.0

    def time(self) -> float:
        return self._now_s

    async def step(self, seconds: float) -> None:
        """Move time on by ``seconds``, then let one iteration run (the timers now due among it)."""
        self._now_s += seconds
        await asyncio.sleep(0)


class SteppedClock:
    """The clock seam read from the running :class:`SteppedLoop` (the journal measures how long
    its group has waited with it)."""

    __slots__ = ("monotonic", "wall")

    def __init__(self, loop: SteppedLoop) -> None:
        self.monotonic: Callable[[], float] = loop.time
        self.wall: Callable[[], float] = loop.time


READ_STEP_S = 0.0005
"""Time between two reads of the stream: a 2 ms timed group gathers the frames of four reads."""


def stream(seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    frames: list[bytes] = []
    next_eid: dict[int, int] = {1: 0}
    for rid in range(1, rnd.randint(50, 300) + 1):
        r = rnd.random()
        if r < 0.70:
            lid = rnd.choice(list(next_eid)) if rnd.random() < 0.9 else rnd.randint(1, 30)
            eid = next_eid.get(lid, 0)
            next_eid[lid] = eid + 1
            size = rnd.choice([40, 500, 3000, 9000, 9900, 9950, 12_000])
            flags = 1 if rnd.random() < 0.1 else 0
            key = KEY if rnd.random() < 0.95 else b"z" * 32
            frames.append(frame(1, rid, lid, eid, flags, key, entry(lid, eid, eid - 1, size=size)))
        elif r < 0.75:
            frames.append(frame(5, rid, rnd.randint(1, 40), KEY, rnd.randint(0, 5)))  # WRITE_LAC
        elif r < 0.80:
            frames.append(frame(8, rid, rnd.randint(1, 40), KEY))  # FORCE_LEDGER
        elif r < 0.83:
            frames.append(frame(2, rid, rnd.randint(1, 40), 0, 1, KEY, -1, 0))  # fencing read
        elif r < 0.86:
            frames.append(frame(0, rid, 1, "x", 0))  # HELLO
        elif r < 0.90:
            frames.append(frame(1, rid, 1, 999, 0, KEY, b"short"))  # malformed add
        elif r < 0.93:
            frames.append(frame(1, max(rid - 1, 0), 1, 5000 + rid, 0, KEY, entry(1, 5000 + rid, 0)))  # dup
        else:
            lid = rnd.randint(40, 60)  # a new ledger in the middle of the read
            next_eid.setdefault(lid, 0)
            eid = next_eid[lid]
            next_eid[lid] = eid + 1
            frames.append(
                frame(1, rid, lid, eid, 0, KEY, entry(lid, eid, eid - 1, size=rnd.choice([40, 9000])))
            )
    data = b"".join(frames)
    # cut into reads of random sizes: frames split across reads, many frames in one read
    reads, pos = [], 0
    while pos < len(data):
        n = rnd.choice([len(data), 1, 7, 100, 5000, 30_000, 100_000])
        reads.append(data[pos : pos + n])
        pos += n
    return reads


async def run(path: Path, reads: list[bytes], wait_ms: float, queue_max: int) -> Any:
    journal = JournalConfig(
        segment_bytes=25_000, record_bytes_max=10_000, group_wait_ms=wait_ms, queue_bytes_max=queue_max
    )
    config = StorageConfig(str(path), "b", journal=journal, checkpoint_interval_s=3600)
    loop = asyncio.get_running_loop()
    assert isinstance(loop, SteppedLoop)
    clock = SteppedClock(loop)
    storage = await Storage.open(config, threads=INLINE, clock=clock)
    processor = Processor(storage, "b", 5 << 20)
    pressure: list[bool] = []
    storage.journal.on_pressure = pressure.append
    conn = ServerConnection(processor, ConnectionLimits(5 << 20, 64, 30.0), set())
    transport = Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    for data in reads:
        conn.data_received(data)
        await loop.step(READ_STEP_S)
    for _ in range(2000):
        if not conn.in_flight and not conn._buf:
            break
        await loop.step(0.002)
    for _ in range(10):  # the last answers' flush (call_soon) may still be queued
        await loop.step(0.002)
    assert conn.in_flight == 0
    responses, buf = [], bytes(transport.data)
    while buf:
        (size,) = LENGTH.unpack_from(buf)
        responses.append(repr(msgpack.unpackb(buf[4 : 4 + size])))
        buf = buf[4 + size :]
    index = {}
    for lid, state in sorted(storage.ledgers.items()):
        for eid in state.index.entry_ids():
            index[(lid, eid)] = tuple(state.index.get(eid))
            got_eid, _ = await storage.read_entry(lid, eid)  # checks CRC + ledger/entry at offset
            assert got_eid == eid
    await storage.close()
    journal_dir = path / "journal"
    segments = b"".join((journal_dir / n).read_bytes() for n in sorted(os.listdir(journal_dir)))
    records = []
    for n in sorted(os.listdir(journal_dir)):
        data = (journal_dir / n).read_bytes()
        sid = fmt.parse_segment_name(n)
        result = fmt.scan(data, fmt.SEGMENT_HEADER_BYTES, sid)
        assert result.tail is fmt.Tail.CLEAN, (n, result)
        records += [(r.type, bytes(r.body)) for r in result.records]
    # replay: the same index after a restart
    storage = await Storage.open(config, threads=INLINE, clock=clock)
    replayed = {}
    for lid, state in sorted(storage.ledgers.items()):
        for eid in state.index.entry_ids():
            replayed[(lid, eid)] = tuple(state.index.get(eid))
    await storage.close()
    assert replayed == index
    return sorted(responses), segments, index, pressure, records


SEEDS = [*range(6), *(pytest.param(seed, marks=pytest.mark.slow) for seed in range(6, 40))]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("wait_ms", "queue_max"), [(0.0, 64 << 20), (2.0, 30_000)])
def test_fused_path_matches_the_generic_path_on_random_streams(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, wait_ms: float, queue_max: int
) -> None:
    reads = stream(seed)
    with asyncio.Runner(loop_factory=SteppedLoop) as runner:
        fast = runner.run(run(tmp_path / "fast", reads, wait_ms, queue_max))
    with monkeypatch.context() as patch, asyncio.Runner(loop_factory=SteppedLoop) as runner:
        generic_only(patch)
        generic = runner.run(run(tmp_path / "generic", reads, wait_ms, queue_max))
    assert fast[4] == generic[4]  # the same records in the same order
    # the same groups (adaptive, or timed on the stepped clock), so the same bytes and places
    assert fast[1] == generic[1]
    assert fast[2] == generic[2]
    # the same answers, reads included: whether an entry is durable yet, and the LAC an answer
    # carries, follow from the frames and the steps alone
    assert fast[0] == generic[0]
    if queue_max < 1 << 20:
        assert True in fast[3]  # backpressure was raised
