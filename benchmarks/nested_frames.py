"""The event loop beside request frames of nested values: a real bookie process, one connection
sending 54 KB frames whose last field is a tree of 50,625 empty arrays of 15 (shaped as a
READ_ENTRY's, or as an ADD_ENTRY's, which the add shortcut unpacks whole first), 64 at a time and
reconnecting whenever the bookie closes it; a second connection, from the same address, reads an
entry every 10 ms. Measured: that read's latency (p50, p99, max), which the decoding of the frames
holds up, and how many frames the attacker got to send.

    python -m benchmarks.nested_frames --shape read --seconds 3 --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import struct
import tempfile
import time
from typing import Any

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import OpCode
from tests.harness.bookie_proc import BookieProcess
from tests.integration.bookie.wire import KEY, entry_body

LEDGER = 5


def _tree(depth: int) -> bytes:
    return b"\x90" if depth == 0 else b"\x9f" + _tree(depth - 1) * 15


def nested_frame(request_id: int, shape: str) -> bytes:
    rid = m._pack(request_id)
    if shape == "add":  # [op, request id, ledger, entry, flags, key, <tree>]
        body = bytes([0x97, OpCode.ADD_ENTRY]) + rid + b"\x01\x00\x00\xc4\x01k" + _tree(4)
    else:  # [op, request id, ledger, <tree>]
        body = bytes([0x94, OpCode.READ_ENTRY]) + rid + b"\x01" + _tree(4)
    return struct.pack(">I", len(body)) + body


async def _answer(reader: asyncio.StreamReader) -> bytes:
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    return await reader.readexactly(size)


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="bench-nested-")
    try:
        return await _measure(args, data_dir)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


async def _measure(args: argparse.Namespace, data_dir: str) -> dict[str, Any]:
    with BookieProcess(data_dir + "/b", bookie_id="b0") as proc:
        host, port = proc.start()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(m.encode(m.AddEntryRequest(1, LEDGER, 0, 0, KEY, entry_body(LEDGER, 0, b"probe"))))
        assert m.decode_response(await _answer(reader)).status == 0
        sent = 0
        stop = time.perf_counter() + args.seconds

        async def attack() -> None:
            nonlocal sent
            while time.perf_counter() < stop:
                try:
                    attacker_reader, attacker = await asyncio.open_connection(host, port)
                    for _ in range(64):
                        attacker.write(nested_frame(sent + 1, args.shape))
                        sent += 1
                        await attacker.drain()
                    while True:
                        await _answer(attacker_reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    continue

        task = asyncio.create_task(attack())
        latencies = []
        for i in range(int(args.seconds * 80)):
            start = time.perf_counter()
            writer.write(m.encode(m.ReadEntryRequest(10 + i, LEDGER, 0, 0, KEY)))
            await _answer(reader)
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.01)
        task.cancel()
        latencies.sort()
        return {
            "frames_sent": sent,
            "p50_ms": latencies[len(latencies) // 2] * 1e3,
            "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3,
            "max_ms": latencies[-1] * 1e3,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["read", "add"], default="read")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs = [asyncio.run(one_run(args)) for _ in range(args.reps)]
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(json.dumps({"shape": args.shape, "runs": runs, "median": medians}, indent=1))


if __name__ == "__main__":
    main()
