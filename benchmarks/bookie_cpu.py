"""The bookie event loop's own CPU per add, without sockets: the real BookieServer (storage,
journal with its writer thread and fdatasync, processor) in this process, fed by an in-process
fake client through the real :class:`bookie.connection_handler.ServerConnection`.

The fake keeps ``--window`` adds in flight: it hands the connection its frames in reads of
``--read-bytes`` (as a socket read would), and on each answer it reads more on the next loop
tick. Measured: the loop thread's CPU time (``time.thread_time``) minus the fake's own, per add;
the journal writer thread is reported apart (``writer_us_per_entry``, from ``/proc``). No TCP,
no other process: steady on a noisy machine, fit for A/B runs of the bookie's add path.

    python -m benchmarks.bookie_cpu --entries 200000 --reps 5
    python -m benchmarks.bookie_cpu --no-add-acks      # one ADD answer per add
    python -m benchmarks.bookie_cpu --rate 3333 --per-read 3 --entries 20000   # per-group costs
    python -m benchmarks.bookie_cpu --ledgers 10000 --window 1000 --entries 50000  # many ledgers

With ``--rate`` the fake is an open loop instead: ``--per-read`` frames every ``per_read / rate``
seconds (a client flushing once per tick at a fixed rate), so groups are small and the per-group
and per-wake-up costs (the writer hand-off, the completion, the answer) dominate; the loop's CPU is
then also given per journal group (``loop_us_per_group``).

With ``--ledgers N`` the adds go round robin over N ledgers (entry 0 of each, then entry 1 of
each, ...), as a client writing to many ledgers sends them: every socket read, journal group and
answer then holds one add per ledger, so per-run and per-ledger costs are paid per add. Each
ledger's first add (which creates its record and journals its key) is made before the measured
span, so the figures are the steady state of ledgers the bookie holds.

``--opcodes`` counts the Python opcodes the bookie runs per add and per group instead (loop thread
and journal writer apart, the fake's own left out): slow, but the same count on a busy machine as
on a quiet one, for A/B runs of small changes; ``by_function`` maps them to the functions that ran
them (at least half an opcode per add). Times are meaningless in that mode.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import uvloop

from benchmarks._fake_transport import FakeTransport, frame_bodies
from bookie.config import BookieConfig
from bookie.connection_handler import ServerConnection
from bookie.server import BookieServer
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import FEATURE_ADD_ACKS, PROTOCOL_VERSION, AddFlag
from bookkeeper_aio.protocol.digest import DigestType, EntryCodec, master_key

PASSWORD = b"bench"


class Opcodes:
    """Python opcodes run per thread while ``counting`` and not inside the fake (``--opcodes``),
    and per function (``file:qualified name``, the writer thread's marked ``[writer]``)."""

    counting = False
    fake = False
    loop = 0
    writer = 0
    by_function: collections.Counter[str] = collections.Counter()

    @classmethod
    def start(cls) -> None:
        """Trace this thread (the loop) and threads started from now on (the journal writer)."""
        loop_thread = threading.get_ident()

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            frame.f_trace_opcodes = True
            if event == "opcode" and cls.counting and not cls.fake:
                code = frame.f_code
                key = f"{os.path.basename(code.co_filename)}:{code.co_qualname}"
                if threading.get_ident() == loop_thread:
                    cls.loop += 1
                else:
                    cls.writer += 1
                    key += " [writer]"
                cls.by_function[key] += 1
            return tracer

        sys.settrace(tracer)
        threading.settrace(tracer)

    @staticmethod
    def stop() -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]


class FakeClientTransport(FakeTransport):
    """The bookie's transport: counts the answered adds and feeds the next frames a tick later.
    ``busy_s`` is its own CPU time (subtracted)."""

    busy_s = 0.0

    def __init__(self, frames: list[bytes], window: int, read_bytes: int, done: asyncio.Future[None]):
        self.loop = asyncio.get_running_loop()
        self.frames = frames
        self.next = 0
        self.window = window
        self.read_bytes = read_bytes
        self.answered = 0
        self.credit = 0
        self.done = done
        self.scheduled = False
        self.conn: ServerConnection | None = None
        self.paced = False
        self.t0 = 0.0

    def write(self, data: bytes) -> None:
        Opcodes.fake = True
        started = time.thread_time()
        data = bytes(data)
        for body, end in frame_bodies(data):
            response = m.decode_response(data[body:end])
            if response.status != 0:
                raise RuntimeError(f"the bookie answered {response!r}")
            if isinstance(response, m.AddAcksResponse):
                count = len(response.request_ids)
            else:  # an ADD answer, or HELLO's (not an add)
                count = 1 if isinstance(response, m.AddEntryResponse) else 0
            self.answered += count
            self.credit += count
        if self.answered >= len(self.frames) and not self.done.done():
            self.done.set_result(None)
        elif not self.scheduled and not self.paced:
            self.scheduled = True
            self.loop.call_soon(self.feed)
        FakeClientTransport.busy_s += time.thread_time() - started
        Opcodes.fake = False

    def feed_paced(self, period_s: float, per_read: int) -> None:
        """Open loop: ``per_read`` frames every ``period_s`` (paced from the start: no drift), in
        one read, whatever was answered."""
        Opcodes.fake = True
        started = time.thread_time()
        frames = self.frames[self.next : self.next + per_read]
        self.next += len(frames)
        if self.next < len(self.frames):
            due = self.t0 + (self.next // per_read) * period_s
            self.loop.call_at(due, self.feed_paced, period_s, per_read)
        FakeClientTransport.busy_s += time.thread_time() - started
        Opcodes.fake = False
        assert self.conn is not None
        self.conn.data_received(b"".join(frames))

    def feed(self) -> None:
        """Hand the connection up to ``credit`` more frames, in reads of ``read_bytes``."""
        Opcodes.fake = True
        started = time.thread_time()
        self.scheduled = False
        end = min(self.next + self.credit, len(self.frames))
        chunks: list[bytes] = []
        batch: list[bytes] = []
        size = 0
        for frame in self.frames[self.next : end]:
            batch.append(frame)
            size += len(frame)
            if size >= self.read_bytes:
                chunks.append(b"".join(batch))
                batch, size = [], 0
        if batch:
            chunks.append(b"".join(batch))
        self.credit -= end - self.next
        self.next = end
        FakeClientTransport.busy_s += time.thread_time() - started
        Opcodes.fake = False
        assert self.conn is not None
        for chunk in chunks:
            self.conn.data_received(chunk)


def build_frames(
    count: int, size: int, ledger_id: int, ledgers: int = 1, first_entry: int = 0
) -> list[bytes]:
    """``count`` add frames: entries from ``first_entry`` on, round robin over ``ledgers`` ledgers
    (ids from ``ledger_id``); request ids from ``first_entry * ledgers + 1`` (unique per phase)."""
    codec = EntryCodec(DigestType.CRC32C, PASSWORD)
    payload = os.urandom(size)
    key = master_key(PASSWORD)
    frames = []
    for n in range(count):
        entry_id, lid = first_entry + n // ledgers, ledger_id + n % ledgers
        body = codec.encode(lid, entry_id, entry_id - 1, (entry_id + 1) * size, payload)
        rid = first_entry * ledgers + n + 1
        frames.append(m.encode_add_request(rid, lid, entry_id, AddFlag.NONE, key, body))
    return frames


def _writer_cpu_s() -> float:
    """CPU time of this process's journal writer thread (from /proc; 0 where there is none)."""
    for thread in threading.enumerate():
        if thread.name == "journal-writer" and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                return 0.0
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


async def one_run(args: argparse.Namespace, ledger_id: int) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="bench-bookie-cpu-", dir=args.dir)
    server = BookieServer(BookieConfig(data_dir=data_dir, bookie_id="bench", port=0))
    if args.opcodes:
        Opcodes.loop = Opcodes.writer = 0
        Opcodes.by_function.clear()
        Opcodes.start()  # before the journal's writer thread starts
    await server.start()
    try:
        assert server.processor is not None
        first = 1 if args.ledgers > 1 else 0  # many ledgers: their first adds are made unmeasured
        frames = build_frames(args.entries, args.size, ledger_id * 10_000_000, args.ledgers, first)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        transport = FakeClientTransport(frames, args.window, args.read_bytes, done)
        conn = ServerConnection(server.processor, server._limits, server._connections)  # the seam
        transport.conn = conn
        conn.connection_made(transport)  # type: ignore[arg-type]
        features = 0 if args.no_add_acks else FEATURE_ADD_ACKS
        hello = m.encode(m.HelloRequest(0, PROTOCOL_VERSION, "bench", features))
        conn.data_received(hello)
        await asyncio.sleep(0.01)
        if first:  # every ledger's first add (its record and key), then the measured frames
            transport.frames = build_frames(args.ledgers, args.size, ledger_id * 10_000_000, args.ledgers)
            transport.credit = args.window
            transport.feed()
            await done
            transport.done = done = loop.create_future()
            transport.frames, transport.next, transport.answered = frames, 0, 0
        FakeClientTransport.busy_s = 0.0
        transport.credit = args.window
        journal = server.processor.storage.journal
        groups0 = journal.groups_written
        cpu0, writer0, t0 = time.thread_time(), _writer_cpu_s(), time.perf_counter()
        Opcodes.counting = True
        if args.rate:
            transport.paced = True
            transport.t0 = asyncio.get_running_loop().time()
            transport.feed_paced(args.per_read / args.rate, args.per_read)
        else:
            transport.feed()
        await done
        Opcodes.counting = False
        elapsed = time.perf_counter() - t0
        loop_s = time.thread_time() - cpu0 - FakeClientTransport.busy_s
        writer_s = _writer_cpu_s() - writer0
        groups = journal.groups_written - groups0
        conn.close()
    finally:
        await server.close()
        Opcodes.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    if args.opcodes:
        counts = sorted(Opcodes.by_function.items(), key=lambda kv: -kv[1])
        return {
            "by_function": {key: round(n / args.entries, 1) for key, n in counts if n * 2 >= args.entries},
            "loop_opcodes_per_entry": round(Opcodes.loop / args.entries, 1),
            "writer_opcodes_per_entry": round(Opcodes.writer / args.entries, 1),
            "records_per_group": round(args.entries / max(groups, 1), 2),
            "loop_opcodes_per_group": round(Opcodes.loop / max(groups, 1)),
            "writer_opcodes_per_group": round(Opcodes.writer / max(groups, 1)),
        }
    return {
        "loop_us_per_entry": round(loop_s / args.entries * 1e6, 3),
        "writer_us_per_entry": round(writer_s / args.entries * 1e6, 3),
        "fake_us_per_entry": round(FakeClientTransport.busy_s / args.entries * 1e6, 3),
        "entries_s": round(args.entries / elapsed),
        "records_per_group": round(args.entries / max(groups, 1), 2),
        "loop_us_per_group": round(loop_s / max(groups, 1) * 1e6, 2),
        "writer_us_per_group": round(writer_s / max(groups, 1) * 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--ledgers", type=int, default=1, help="adds round robin over this many ledgers")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--read-bytes", type=int, default=65536, help="bytes per fake socket read")
    ap.add_argument("--rate", type=float, default=0.0, help="open loop at this many adds/s (0: closed)")
    ap.add_argument("--per-read", type=int, default=3, help="with --rate: frames per fake socket read")
    ap.add_argument("--opcodes", action="store_true", help="count Python opcodes instead of CPU time")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="parent of the temporary data dirs")
    ap.add_argument("--no-add-acks", action="store_true", help="do not agree on FEATURE_ADD_ACKS")
    args = ap.parse_args()
    runs = []
    for rep in range(args.reps):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(one_run(args, rep + 1))
        print(json.dumps(result), flush=True)
        runs.append(result)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "by_function"}
    print(json.dumps({"median": median, "config": vars(args)}))


if __name__ == "__main__":
    main()
