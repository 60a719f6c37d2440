"""CPU per entry of a batch read, each side on its own and without sockets (fit for A/B runs on a
noisy machine, as ``client_cpu`` and ``bookie_cpu`` are for adds).

``--side bookie``: the real BookieServer (storage, journal, processor, its storage-reader thread)
in this process, fed through the real :class:`bookie.connection_handler.ServerConnection` by a fake
client: it writes one ledger of ``--entries`` entries, then keeps ``--in-flight`` BATCH_READs of
``--count`` entries (``--step`` apart) outstanding until it read the ledger ``--passes`` times.
Measured per entry read: the loop thread's CPU minus the fake's own (``loop_us_per_entry``) and the
storage-reader thread's from ``/proc`` (``reader_us_per_entry``).

``--side client``: the real client (BookKeeper, ReadHandle, EntryReader, BookieConnection) reading a
closed ledger of ``--entries`` entries whose bookies are in-process fakes: each keeps the bodies
written to it and answers a BATCH_READ one loop tick later with a frame encoded before the clock
started. Measured: the process's CPU minus the fakes' own, per entry handed to the caller
(``client_us_per_entry``); ``-E``/``--qw`` choose consecutive (``Qw == E``) or striped reads.

Neither side counts the kernel's share of a socket (the ``bkaio bench read`` figures do). The
bookie side sets the bookie process's malloc thresholds (bookie/malloc.py) as ``bookie`` does;
``--no-malloc-tuning`` leaves glibc's defaults.

    python -m benchmarks.read_cpu --side bookie --entries 100000 --reps 5
    python -m benchmarks.read_cpu --side client --qw 2 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import struct
import tempfile
import threading
import time
from typing import Any

import msgpack
import uvloop

from benchmarks._fake_transport import FakeTransport, frame_bodies
from benchmarks.bookie_cpu import FakeClientTransport, build_frames
from bookie.config import BookieConfig
from bookie.connection_handler import ServerConnection
from bookie.malloc import keep_big_buffers
from bookie.server import BookieServer
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.client.connection import BookieConnection
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import FEATURE_ADD_ACKS, FRAME_BYTES_MAX, PROTOCOL_VERSION, OpCode
from bookkeeper_aio.protocol.digest import master_key
from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore

PASSWORD = b"bench"
_LENGTH = struct.Struct(">I")
_ADD = int(OpCode.ADD_ENTRY)
_BATCH_READ = int(OpCode.BATCH_READ)
_packb = msgpack.Packer(autoreset=True).pack


def _thread_cpu_s(name: str) -> float:
    """CPU time of this process's threads called ``name*`` (from /proc)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith(name) and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# ------------------------------------------------------------------ bookie side
class FakeReader(FakeTransport):
    """The bookie's transport during the read phase: keeps ``in_flight`` BATCH_READs outstanding."""

    busy_s = 0.0

    def __init__(self, args: argparse.Namespace, ledger_id: int, done: asyncio.Future[None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.args = args
        self.ledger_id = ledger_id
        self.done = done
        self.key = master_key(PASSWORD)
        self.starts = [
            start for _ in range(args.passes) for start in _batch_starts(args.entries, args.count, args.step)
        ]
        self.next = 0
        self.entries = 0
        self.request_id = 1000
        self.conn: ServerConnection | None = None

    def request(self) -> bytes:
        start = self.starts[self.next]
        self.next += 1
        self.request_id += 1
        count = min(self.args.count, (self.args.entries - 1 - start) // self.args.step + 1)
        req = m.BatchReadRequest(
            self.request_id, self.ledger_id, start, count, 4 << 20, 0, self.key, self.args.step
        )
        return m.encode(req)

    def send(self, count: int) -> None:
        started = time.thread_time()
        frames = [self.request() for _ in range(min(count, len(self.starts) - self.next))]
        FakeReader.busy_s += time.thread_time() - started
        assert self.conn is not None
        if frames:
            self.conn.data_received(b"".join(frames))

    def write(self, data: bytes) -> None:
        started = time.thread_time()
        data = bytes(data)
        answers = 0
        for body, end in frame_bodies(data):
            response = msgpack.unpackb(data[body:end])
            if response[2] != 0:
                raise RuntimeError(f"the bookie answered {response[:4]!r}")
            self.entries += len(response[6])
            answers += 1
        FakeReader.busy_s += time.thread_time() - started
        if self.next < len(self.starts):
            self.loop.call_soon(self.send, answers)
        elif self.entries >= self.args.entries * self.args.passes and not self.done.done():
            self.done.set_result(None)


def _batch_starts(entries: int, count: int, step: int) -> list[int]:
    """First entries of the batches covering ``0..entries-1``: ``step`` stripes of ``count``."""
    starts = []
    for chunk in range(0, entries, count * step):
        starts += range(chunk, min(chunk + step, entries))
    return starts


async def bookie_run(args: argparse.Namespace, ledger_id: int) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="bench-read-cpu-", dir=args.dir)
    server = BookieServer(BookieConfig(data_dir=data_dir, bookie_id="bench", port=0))
    await server.start()
    try:
        assert server.processor is not None
        loop = asyncio.get_running_loop()
        # the ledger, written through the add path
        filled: asyncio.Future[None] = loop.create_future()
        writer = FakeClientTransport(build_frames(args.entries, args.size, ledger_id), 1000, 65536, filled)
        conn = ServerConnection(server.processor, server._limits, server._connections)  # the seam
        writer.conn = conn
        conn.connection_made(writer)  # type: ignore[arg-type]
        conn.data_received(m.encode(m.HelloRequest(0, PROTOCOL_VERSION, "bench", FEATURE_ADD_ACKS)))
        await asyncio.sleep(0.01)
        writer.credit = 1000
        writer.feed()
        await filled
        conn.close()
        # the reads, on a connection of their own
        done: asyncio.Future[None] = loop.create_future()
        reader = FakeReader(args, ledger_id, done)
        conn = ServerConnection(server.processor, server._limits, server._connections)
        reader.conn = conn
        conn.connection_made(reader)  # type: ignore[arg-type]
        FakeReader.busy_s = 0.0
        cpu0, thread0, t0 = time.thread_time(), _thread_cpu_s("storage-reader"), time.perf_counter()
        reader.send(args.in_flight)
        await done
        elapsed = time.perf_counter() - t0
        loop_s = time.thread_time() - cpu0 - FakeReader.busy_s
        reader_s = _thread_cpu_s("storage-reader") - thread0
        conn.close()
    finally:
        await server.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    entries = reader.entries
    return {
        "loop_us_per_entry": round(loop_s / entries * 1e6, 3),
        "reader_us_per_entry": round(reader_s / entries * 1e6, 3),
        "bookie_us_per_entry": round((loop_s + reader_s) / entries * 1e6, 3),
        "fake_us_per_entry": round(FakeReader.busy_s / entries * 1e6, 3),
        "entries_s": round(entries / elapsed),
    }


# ------------------------------------------------------------------ client side
class FakeBookie(FakeTransport):
    """A bookie in the client's process: keeps the bodies added to it, answers the next tick."""

    busy_s = 0.0
    answers: dict[tuple[int, int, int, int], bytes] = {}
    """Encoded BATCH_READ answer bodies by (ledger, start, count, step), made before the clock."""

    def __init__(self, conn: BookieConnection, store: dict[int, bytes]) -> None:
        self.conn = conn
        self.store = store
        self.loop = asyncio.get_running_loop()
        self.frames: list[bytes] = []
        self.scheduled = False

    def write(self, data: bytes) -> None:
        started = time.thread_time()
        data = bytes(data)
        for body, end in frame_bodies(data):
            request = m.decode_request(data[body:end])
            rid = request.request_id
            if isinstance(request, m.AddEntryRequest):
                self.store[request.entry_id] = request.body
                answer = m.AddEntryResponse(rid, 0, None, request.ledger_id, request.entry_id)
                self.frames.append(m.encode(answer))
            elif isinstance(request, m.BatchReadRequest):
                self.frames.append(self.batch(request))
            elif isinstance(request, m.WriteLacRequest):
                self.frames.append(m.encode(m.WriteLacResponse(rid, 0, None, request.ledger_id)))
            elif isinstance(request, m.HelloRequest):
                hello = m.HelloResponse(rid, 0, None, PROTOCOL_VERSION, "fake", FRAME_BYTES_MAX, 0)
                self.frames.append(m.encode(hello))
            else:
                raise RuntimeError(f"the fake bookie does not answer {request!r:.80}")
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.answer)
        FakeBookie.busy_s += time.thread_time() - started

    def batch(self, req: m.BatchReadRequest) -> bytes:
        """The answer, as ``m.encode`` makes it, with the request id put in a cached body."""
        shape = (req.ledger_id, req.start_entry_id, req.max_count, req.step)
        cached = FakeBookie.answers.get(shape)
        if cached is None:
            bodies = []
            start, step = req.start_entry_id, req.step
            for entry_id in range(start, start + req.max_count * step, step):
                if entry_id not in self.store:
                    break
                bodies.append(self.store[entry_id])
            response = m.BatchReadResponse(0, 0, None, req.ledger_id, start, bodies, -1, step)
            cached = FakeBookie.answers[shape] = m.encode(response)[4:]
        # [op, 0, ...] -> [op, rid, ...]: the request id is the array's second item (0 is one byte)
        body = cached[:2] + _packb(req.request_id) + cached[3:]
        return _LENGTH.pack(len(body)) + body

    def answer(self) -> None:
        started = time.thread_time()
        self.scheduled = False
        frames, self.frames = self.frames, []
        data = b"".join(frames)
        FakeBookie.busy_s += time.thread_time() - started
        self.conn.data_received(data)


async def client_run(args: argparse.Namespace) -> dict[str, Any]:
    ids = [f"fake-{i}" for i in range(args.ensemble)]
    stores: dict[str, dict[int, bytes]] = {bookie_id: {} for bookie_id in ids}
    bk = BookKeeper(LedgerManager(MemoryStore(), "/bench"), StaticDirectory(ids), config=ClientConfig.load())

    async def connect(conn: BookieConnection) -> None:  # instead of TCP: the fake transport
        conn.connection_made(FakeBookie(conn, stores[conn.bookie_id]))  # type: ignore[arg-type]

    bk.context.pool._connect = connect  # type: ignore[method-assign]  # the benchmark's seam
    lh = await bk.create_ledger(args.ensemble, args.qw, args.qa, password=PASSWORD)
    payload = os.urandom(args.size)
    await asyncio.gather(*[await lh.append_async(payload) for _ in range(args.entries)])
    await lh.close()
    rh = await bk.open_ledger(lh.id, password=PASSWORD)
    count = 0
    async for _entry in rh.read():  # a first pass fills the fakes' answer caches
        count += 1
    runs = []
    for _ in range(args.passes):
        FakeBookie.busy_s = 0.0
        cpu0, wall0 = time.process_time(), time.perf_counter()
        count = 0
        async for _entry in rh.read():
            count += 1
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        assert count == args.entries, count
        fake_s = FakeBookie.busy_s
        runs.append(((cpu_s - fake_s) / count * 1e6, fake_s / count * 1e6, count / wall_s))
    FakeBookie.answers.clear()
    await bk.close()
    return {
        "client_us_per_entry": round(statistics.median(r[0] for r in runs), 3),
        "fake_us_per_entry": round(statistics.median(r[1] for r in runs), 3),
        "entries_s": round(statistics.median(r[2] for r in runs)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=("bookie", "client"), default="bookie")
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--passes", type=int, default=3, help="reads of the whole ledger per rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--count", type=int, default=128, help="bookie: entries per BATCH_READ")
    ap.add_argument("--step", type=int, default=1, help="bookie: entries between two of a batch")
    ap.add_argument("--in-flight", type=int, default=4, help="bookie: BATCH_READs outstanding")
    ap.add_argument("--ensemble", "-E", type=int, default=3, help="client")
    ap.add_argument("--qw", type=int, default=3, help="client")
    ap.add_argument("--qa", type=int, default=2, help="client")
    ap.add_argument("--dir", default=None, help="bookie: parent of the temporary data dir")
    ap.add_argument("--no-malloc-tuning", action="store_true", help="bookie: glibc's default thresholds")
    args = ap.parse_args()
    if args.side == "bookie" and not args.no_malloc_tuning:
        keep_big_buffers()
    runs = []
    for rep in range(args.reps):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            run = bookie_run(args, rep + 1) if args.side == "bookie" else client_run(args)
            result = runner.run(run)
        print(json.dumps(result), flush=True)
        runs.append(result)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(json.dumps({"median": median, "config": vars(args), "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
