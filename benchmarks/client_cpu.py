"""The client's own CPU per entry, without bookies: the real LedgerHandle, BookiePool and
BookieConnection, with each connection's transport replaced by an in-process fake that answers
HELLO and acks every ADD one loop tick later (one ack frame per add, or with ``--add-acks`` one
ADD_ACKS response per tick, as a bookie that agreed to FEATURE_ADD_ACKS answers a journal group).

What it measures is the Python work of the write path (append, frame encoding, request
bookkeeping, ack decoding, in-order completion): no syscalls, no other process, so it is steady on
a noisy machine and fit for A/B runs and ``valgrind --tool=callgrind`` instruction counts. The
fake's own CPU time (``time.thread_time``) is measured and subtracted.

    python -m benchmarks.client_cpu --entries 200000 --reps 5
    python -m benchmarks.client_cpu --add-acks
    python -m benchmarks.client_cpu --ledgers 100000 --window 1 --entries 300000 --reps 3

With ``--opcodes`` it runs no timing: it counts the Python bytecodes each function executes per
entry (``sys.settrace`` with opcode events, two runs, the smaller subtracted), the fake included.
Deterministic (~30 s at ``--entries 10000``): a map of where the Python work of an entry is. Bytecodes
are not instructions (a ``LOAD_FAST`` is a few, a call hundreds): confirm any change with
callgrind.

With ``--load-loop SECS`` the adds come from ``bkaio bench``'s closed loop (``cli/bench/load.py``,
``--window`` slots per ledger, for SECS seconds) with the submit ``benchmarks.write`` gives it,
instead of a plain ``append`` per worker: the client process of the closed-loop write benchmark,
its load loop included. ``--entries`` is then ignored; count instructions per entry over two
spans (the difference of instructions over the difference of entries).

With ``--ledgers N`` the adds go round robin over N ledgers (``--window`` in flight per ledger, one
coroutine per slot), and the result also gives the client's memory per open ledger: traced Python
allocations after the ledgers are created and have written one entry, over N.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gc
import json
import os
import statistics
import struct
import sys
import time
import tracemalloc
import types
from typing import Any

import msgpack
import uvloop

from benchmarks._fake_transport import FakeTransport, frame_bodies
from bookkeeper_aio import BookKeeper, ClientConfig
from bookkeeper_aio.cli.bench import load
from bookkeeper_aio.client.connection import BookieConnection
from bookkeeper_aio.client.context import StaticDirectory
from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import FEATURE_ADD_ACKS, FRAME_BYTES_MAX, PROTOCOL_VERSION, OpCode
from metadata.ledger_manager import LedgerManager
from metadata.memory import MemoryStore

_LENGTH = struct.Struct(">I")
_ADD = int(OpCode.ADD_ENTRY)
_packb = msgpack.Packer(autoreset=True).pack


class FakeBookieTransport(FakeTransport):
    """Takes the client's frames; answers them on the next tick. ``busy_s`` is its own CPU time."""

    busy_s = 0.0
    write_lacs = 0

    def __init__(self, conn: BookieConnection, add_acks: bool) -> None:
        self.conn = conn
        self.add_acks = add_acks
        self.loop = asyncio.get_running_loop()
        self.frames: list[bytes] = []
        self.rids: list[int] = []
        self.scheduled = False

    def write(self, data: bytes) -> None:
        started = time.thread_time()
        data = bytes(data)
        for body, end in frame_bodies(data):
            if data[body + 1] == _ADD:  # [1, rid, lid, eid, ...]: only the ids are read
                rid, i = _int_at(data, body + 2)
                if self.add_acks:
                    self.rids.append(rid)
                else:
                    lid, i = _int_at(data, i)
                    eid, i = _int_at(data, i)
                    ack = _packb((_ADD, rid, 0, None, lid, eid))  # m.encode(AddEntryResponse(...))
                    self.frames.append(_LENGTH.pack(len(ack)) + ack)
            else:
                request = m.decode_request(data[body:end])
                if isinstance(request, m.WriteLacRequest):  # explicit LACs of slowly written ledgers
                    FakeBookieTransport.write_lacs += 1
                    lac = m.WriteLacResponse(request.request_id, 0, None, request.ledger_id)
                    self.frames.append(m.encode(lac))
                    continue
                assert isinstance(request, m.HelloRequest), request
                features = request.features & FEATURE_ADD_ACKS if self.add_acks else 0
                rid = request.request_id
                hello = m.HelloResponse(rid, 0, None, PROTOCOL_VERSION, "fake", FRAME_BYTES_MAX, features)
                self.frames.append(m.encode(hello))
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.answer)
        FakeBookieTransport.busy_s += time.thread_time() - started

    def answer(self) -> None:
        started = time.thread_time()
        self.scheduled = False
        frames, self.frames = self.frames, []
        if self.rids:
            frames.append(m.encode(m.AddAcksResponse(0, 0, None, self.rids)))
            self.rids = []
        data = b"".join(frames)
        FakeBookieTransport.busy_s += time.thread_time() - started
        self.conn.data_received(data)


def _int_at(data: bytes, i: int) -> tuple[int, int]:
    """A msgpack non-negative int at ``data[i]`` and the offset after it."""
    kind = data[i]
    if kind < 0x80:
        return kind, i + 1
    width = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}[kind]
    return int.from_bytes(data[i + 1 : i + 1 + width], "big"), i + 1 + width


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    ids = [f"fake-{i}" for i in range(args.ensemble)]
    bk = BookKeeper(
        LedgerManager(MemoryStore(), "/bench"),
        StaticDirectory(ids),
        config=ClientConfig.load(add_window_max=args.window),  # BKAIO_CLIENT_* env applies
    )
    pool = bk.context.pool

    async def connect(conn: BookieConnection) -> None:  # instead of TCP: the fake transport
        conn.connection_made(FakeBookieTransport(conn, args.add_acks))  # type: ignore[arg-type]

    pool._connect = connect  # type: ignore[method-assign]  # the benchmark's seam
    tracemalloc.start()
    traced0 = tracemalloc.get_traced_memory()[0]
    handles = []
    for start in range(0, args.ledgers, 64):
        batch = [
            bk.create_ledger(args.ensemble, args.qw, args.qa, password=b"bench")
            for _ in range(min(64, args.ledgers - start))
        ]
        handles.extend(await asyncio.gather(*batch))
    payload = os.urandom(args.size)
    await asyncio.gather(*(lh.append(payload) for lh in handles))
    await asyncio.sleep(0)
    bytes_per_ledger = (tracemalloc.get_traced_memory()[0] - traced0) / args.ledgers
    tracemalloc.stop()
    if args.gc_freeze:  # what `bkaio bench` does once its ledgers exist (docs/benchmarks.md)
        gc.freeze()
    per_worker = max(1, args.entries // (args.window * args.ledgers))

    async def worker(lh: Any) -> None:
        for _ in range(per_worker):
            await lh.append(payload)

    FakeBookieTransport.busy_s = 0.0
    FakeBookieTransport.write_lacs = 0
    lac0 = sum(lh.last_add_confirmed for lh in handles)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if args.load_loop:  # as benchmarks.write drives the client
        submits = [functools.partial(lh.append_async, payload) for lh in handles]
        nowait = [functools.partial(lh.append_nowait, payload) for lh in handles]
        span = load.Span(load.clock(), 0.0, args.load_loop)
        await load.drive(submits, span, window=args.window * args.ledgers, nowait=nowait)
    else:
        await asyncio.gather(*(worker(lh) for lh in handles for _ in range(args.window)))
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    entries = sum(lh.last_add_confirmed for lh in handles) - lac0
    fake_s = FakeBookieTransport.busy_s
    write_lacs = FakeBookieTransport.write_lacs
    for start in range(0, len(handles), 64):
        await asyncio.gather(*(lh.close() for lh in handles[start : start + 64]))
    await bk.close()
    gc.unfreeze()
    return {
        "client_cpu_us_per_entry": round((cpu_s - fake_s) / entries * 1e6, 3),
        "fake_us_per_entry": round(fake_s / entries * 1e6, 3),
        "entries": entries,
        "entries_s": round(entries / wall_s),
        "bytes_per_open_ledger": round(bytes_per_ledger),
        "write_lac_requests_per_entry": round(write_lacs / entries, 3),
    }


def opcodes_per_entry(args: argparse.Namespace) -> dict[str, float]:
    """Bytecodes executed per entry by each function (``file:qualified name``), most first: runs of
    ``args.entries`` and three times as many, the difference over twice ``args.entries``."""

    def counted(entries: int) -> collections.Counter[str]:
        counts: collections.Counter[str] = collections.Counter()

        def trace(frame: types.FrameType, event: str, arg: object) -> Any:
            frame.f_trace_opcodes = True
            code = frame.f_code
            key = f"{os.path.basename(code.co_filename)}:{code.co_qualname}"

            def count(frame: types.FrameType, event: str, arg: object) -> Any:
                if event == "opcode":
                    counts[key] += 1
                return count

            return count

        run_args = argparse.Namespace(**{**vars(args), "entries": entries})
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            sys.settrace(trace)
            try:
                runner.run(one_run(run_args))
            finally:
                sys.settrace(None)
        return counts

    small, large = counted(args.entries), counted(3 * args.entries)
    per_entry = {key: (large[key] - small[key]) / (2 * args.entries) for key in large}
    return dict(sorted(((k, round(v, 1)) for k, v in per_entry.items() if v >= 0.5), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--window", type=int, default=1000, help="adds in flight per ledger")
    ap.add_argument("--ledgers", type=int, default=1, help="ledgers written round robin")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the ledgers exist")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--ensemble", type=int, default=3)
    ap.add_argument("--qw", type=int, default=2)
    ap.add_argument("--qa", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--load-loop", type=float, default=0.0, metavar="SECS", help="drive through bkaio bench's closed loop"
    )
    ap.add_argument("--add-acks", action="store_true", help="the fake batches its acks (FEATURE_ADD_ACKS)")
    ap.add_argument(
        "--opcodes", action="store_true", help="no timing: Python bytecodes per entry by function (see above)"
    )
    args = ap.parse_args()
    if args.opcodes:
        per_function = opcodes_per_entry(args)
        total = round(sum(per_function.values()))
        print(json.dumps({"bytecodes_per_entry": total, "by_function": per_function}))
        return
    runs = []
    for _ in range(args.reps):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runs.append(runner.run(one_run(args)))
        print(json.dumps(runs[-1]), flush=True)
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(json.dumps({"median": median, "config": vars(args)}))


if __name__ == "__main__":
    main()
