"""A hostile client in its own process, for the attack tests (tests/integration/bookie/test_attacks.py)
and their canary: it floods one or more bookies for ``--seconds`` and prints one JSON line of what
came back. Its own process, so its CPU does not come out of the canary's event loop (the issue's
measurements pinned the attacker to its own core the same way).

    python -m tests.harness.attacker KIND --target HOST:PORT [--target ...] --seconds S [options]

SIGTERM stops it early (it still prints its summary); SIGUSR1 drops every connection and stops
attacking, SIGUSR2 starts again (the canary measures its baseline in between: a pause by SIGSTOP
alone would leave the requests already sent queued at the bookie, which goes on refusing them).

Kinds (each connection keeps ``--window`` requests in flight, new ones as answers arrive):

- ``fence-unknown`` / ``add-unknown``: fences / adds of random ledger ids nobody created, junk key
- ``squat``: fences (first half) and adds (second half) of the ids ``--ids FIRST:COUNT``, junk key
- ``wrong-key``: reads, fences, adds, LAC reads, WRITE_LAC, FORCE and entry lists of ``--ledger``
  with a junk key
- ``no-auth``: connections that send a read without authenticating, again as soon as closed
- ``tls-stall``: TCP connections to a TLS port that never start their handshake, again when closed
- ``unread-reads``: reads of entry 0 of ``--ledger`` with the right key (``--key-hex``), whose
  answers are never read (the connection's reading is paused from the start)
- ``idle``: TCP connections that send nothing, again when closed (the ``tls-stall`` loop, plaintext)
- ``garbage``: frames of ``--frame-kib`` KiB that are not msgpack (the bookie closes), again when closed
- ``trailing`` / ``bad-utf8``: requests with bytes after the request, and HELLOs whose client
  name is not UTF-8 (docs/protocol.md §1: EBADREQ, the connection goes on)

The summary: ``sent``, ``answers`` (by status name), ``connections`` opened, ``attempts``
(tls-stall: connections tried), ``closed`` (by the bookie), ``reset`` (tls-stall: of those closed,
the ones closed by a reset), ``refused`` (connections that failed at once, or were closed before any
answer; tls-stall: within ``REFUSED_WITHIN_S``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import random
import signal
import ssl
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack
import uvloop

from bookkeeper_aio.protocol import messages as m
from bookkeeper_aio.protocol.codes import ReadFlag, StatusCode
from bookkeeper_aio.protocol.digest import EntryCodec

JUNK = b"J" * 32
CODEC = EntryCodec("crc32c")
RANDOM_IDS_FROM = 1 << 40
"""Random ledger ids are drawn above this: far from any id the tests' clients are handed."""

REFUSED_WITHIN_S = 0.5
Frame = Callable[[int], bytes]
"""Makes the request frame with the given request id."""


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _fence(ledger_id: int) -> Frame:
    return lambda rid: m.encode(m.ReadEntryRequest(rid, ledger_id, -1, int(ReadFlag.FENCE_LEDGER), JUNK))


def _add(ledger_id: int, entry_id: int = 0) -> Frame:
    body = CODEC.encode(ledger_id, entry_id, entry_id - 1, 0, b"junk")
    return lambda rid: m.encode(m.AddEntryRequest(rid, ledger_id, entry_id, 0, JUNK, body))


def _requests(args: argparse.Namespace) -> Callable[[], Frame]:
    """The next request of ``args.kind`` (an endless supply)."""
    kind = args.kind
    if kind in ("fence-unknown", "add-unknown"):
        make = _fence if kind == "fence-unknown" else _add
        return lambda: make(random.randrange(RANDOM_IDS_FROM, 1 << 62))
    if kind == "squat":
        first, count = (int(part) for part in args.ids.split(":"))
        ids = itertools.cycle(range(first, first + count))
        half = first + count // 2
        return lambda: (lambda i: _fence(i) if i < half else _add(i))(next(ids))
    if kind == "wrong-key":
        lid = args.ledger
        body = CODEC.encode(lid, 0, -1, 0, b"junk")
        makes: list[Frame] = [
            lambda rid: m.encode(m.ReadEntryRequest(rid, lid, 0, 0, JUNK)),
            _fence(lid),
            lambda rid: m.encode(m.AddEntryRequest(rid, lid, 0, 0, JUNK, body)),
            lambda rid: m.encode(m.ReadLacRequest(rid, lid, JUNK)),
            lambda rid: m.encode(m.WriteLacRequest(rid, lid, JUNK, 0)),
            lambda rid: m.encode(m.ForceLedgerRequest(rid, lid, JUNK)),
            lambda rid: m.encode(m.GetListOfEntriesRequest(rid, lid, JUNK)),
        ]
        cycle = itertools.cycle(makes)
        return lambda: next(cycle)
    if kind == "unread-reads":
        lid, key = args.ledger, bytes.fromhex(args.key_hex)
        return lambda: lambda rid: m.encode(m.ReadEntryRequest(rid, lid, 0, 0, key))
    if kind == "garbage":
        garbage = _frame(b"\xc1" * (args.frame_kib * 1024))  # not msgpack: no request id to answer
        return lambda: lambda rid: garbage
    if kind == "trailing":
        return lambda: lambda rid: _frame(msgpack.packb([4, rid, 1]) + b"\x00" * 64)
    if kind == "bad-utf8":
        # a HELLO [0, rid, 1, client_name] whose name is two bytes that are not UTF-8
        return lambda: lambda rid: _frame(b"\x94" + msgpack.packb([0, rid, 1])[1:] + b"\xa2\xff\xfe")
    raise SystemExit(f"unknown kind {kind!r}")


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.answers: collections.Counter[str] = collections.Counter()
        self.connections = 0
        self.attempts = 0
        """Connections tried (tls-stall): opened, or failed at once."""
        self.closed = 0
        self.reset = 0
        """Closed by a reset (tls-stall: held by the bookie's tarpit, then reset)."""
        self.refused = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "answers": dict(self.answers),
            "connections": self.connections,
            "attempts": self.attempts,
            "closed": self.closed,
            "reset": self.reset,
            "refused": self.refused,
        }


def _status_name(status: int) -> str:
    try:
        return StatusCode(status).name
    except ValueError:
        return str(status)


class Flood(asyncio.Protocol):
    """One connection keeping ``window`` requests in flight."""

    def __init__(
        self, next_request: Callable[[], Frame], window: int, tally: Tally, *, unread: bool = False
    ) -> None:
        self.unread = unread
        """Never read the answers: the window is sent once, and left unanswered."""
        self.next_request = next_request
        self.window = window
        self.tally = tally
        self.ids = itertools.count(1)
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.done = asyncio.get_running_loop().create_future()
        self.answered = 0
        self.stopping = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.unread:
            transport.pause_reading()  # type: ignore[attr-defined]
        self._send(self.window)

    def _send(self, count: int) -> None:
        if self.stopping or self.transport is None or self.transport.is_closing():
            return
        frames = [self.next_request()(next(self.ids)) for _ in range(count)]
        self.tally.sent += count
        self.transport.write(b"".join(frames))

    def data_received(self, data: bytes) -> None:
        if self.unread:  # uvloop reads once after connection_made, paused or not: ignore, pause again
            assert self.transport is not None
            self.transport.pause_reading()
            return
        self.buf += data
        pos = 0
        got = 0
        while len(self.buf) - pos >= 4:
            (size,) = struct.unpack_from(">I", self.buf, pos)
            if len(self.buf) - pos - 4 < size:
                break
            answer = msgpack.unpackb(bytes(self.buf[pos + 4 : pos + 4 + size]), strict_map_key=False)
            pos += 4 + size
            if answer[0] == int(m.RESPONSE_OP[m.AddAcksResponse]):
                got += len(answer[4])
                self.tally.answers["EOK"] += len(answer[4])
            else:
                got += 1
                self.tally.answers[_status_name(answer[2])] += 1
        del self.buf[:pos]
        self.answered += got
        self._send(got)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.stopping:
            self.tally.closed += 1
            if not self.answered:
                self.tally.refused += 1
        if not self.done.done():
            self.done.set_result(None)

    def stop(self) -> None:
        self.stopping = True
        if self.transport is not None:
            self.transport.abort()


async def _flood(target: tuple[str, int], args: argparse.Namespace, tally: Tally, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    next_request = _requests(args)
    while loop.time() < deadline:
        try:
            _, flood = await loop.create_connection(
                lambda: Flood(next_request, args.window, tally, unread=args.kind == "unread-reads"),
                *target,
                ssl=_client_tls(args),
                **_source(args),
            )
        except OSError:
            tally.refused += 1
            await asyncio.sleep(0.05)
            continue
        tally.connections += 1
        try:
            await asyncio.wait_for(asyncio.shield(flood.done), max(0.0, deadline - loop.time()))
        except (TimeoutError, asyncio.CancelledError):
            flood.stop()
            return
        await asyncio.sleep(0.01)  # closed by the bookie: again


async def _no_auth(target: tuple[str, int], args: argparse.Namespace, tally: Tally, deadline: float) -> None:
    """Connect, ask for a read without AUTH, wait for the answer and the close; again."""
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            reader, writer = await asyncio.open_connection(*target, ssl=_client_tls(args), **_source(args))
        except OSError:
            tally.refused += 1
            await asyncio.sleep(0.05)
            continue
        tally.connections += 1
        writer.write(m.encode(m.ReadEntryRequest(1, 1, 0, 0, JUNK)))
        tally.sent += 1
        try:
            async with asyncio.timeout(max(0.1, deadline - loop.time())):
                data = await reader.read(65536)
                if len(data) > 4:
                    answer = msgpack.unpackb(data[4:], strict_map_key=False)
                    tally.answers[_status_name(answer[2])] += 1
                if await reader.read(65536) == b"":
                    tally.closed += 1
        except (TimeoutError, ConnectionError, ValueError):
            pass
        except asyncio.CancelledError:
            writer.close()
            return
        writer.close()


async def _tls_stall(
    target: tuple[str, int], args: argparse.Namespace, tally: Tally, deadline: float
) -> None:
    """Hold a TCP connection that never starts its TLS handshake until the bookie closes it; again.
    One the bookie closes within ``REFUSED_WITHIN_S`` counts as refused."""
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        tally.attempts += 1
        try:
            reader, writer = await asyncio.open_connection(*target, **_source(args))
        except OSError:
            tally.refused += 1
            await asyncio.sleep(0.05)
            continue
        tally.connections += 1
        opened = loop.time()
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                await reader.read(65536)
            tally.closed += 1
        except TimeoutError:
            pass
        except ConnectionError as exc:
            tally.closed += 1
            if isinstance(exc, ConnectionResetError):
                tally.reset += 1
        except asyncio.CancelledError:
            writer.close()
            return
        if loop.time() - opened < REFUSED_WITHIN_S:
            tally.refused += 1
            await asyncio.sleep(0.05)  # refused: do not spin
        writer.close()


def _source(args: argparse.Namespace) -> dict[str, Any]:
    return {"local_addr": (args.source_host, 0)} if args.source_host else {}


def _client_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.tls_ca:
        return None
    context = ssl.create_default_context(cafile=args.tls_ca)
    context.check_hostname = False  # the attacker trusts the CA, not the name: it wants a session
    return context


async def run(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.seconds
    tally = Tally()
    worker = {"no-auth": _no_auth, "tls-stall": _tls_stall, "idle": _tls_stall}.get(args.kind, _flood)
    targets = [(host, int(port)) for host, port in (t.rsplit(":", 1) for t in args.target)]
    tasks: list[asyncio.Task[None]] = []
    stopped = asyncio.Event()

    def start() -> None:
        if not tasks and not stopped.is_set():
            tasks.extend(
                loop.create_task(worker(target, args, tally, deadline))
                for target in targets
                for _ in range(args.connections)
            )

    def pause() -> None:  # every worker drops its connection (a cancelled worker closes it)
        for task in tasks:
            task.cancel()
        tasks.clear()

    def stop() -> None:
        stopped.set()
        pause()

    loop.add_signal_handler(signal.SIGTERM, stop)  # stop, report
    loop.add_signal_handler(signal.SIGUSR1, pause)
    loop.add_signal_handler(signal.SIGUSR2, start)
    started = time.perf_counter()
    start()
    while not stopped.is_set() and loop.time() < deadline:
        running = list(tasks)
        if running and all(task.done() for task in running):
            break  # every worker finished on its own (its deadline)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), 0.1)
    pause()
    await asyncio.sleep(0)  # the cancelled workers close their connections
    return {"kind": args.kind, "seconds": round(time.perf_counter() - started, 3), **tally.as_json()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind")
    ap.add_argument("--target", action="append", required=True, help="HOST:PORT of a bookie (repeatable)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--connections", type=int, default=4, help="connections per target")
    ap.add_argument("--window", type=int, default=256, help="requests in flight per connection")
    ap.add_argument("--ids", default="1:100", help="squat: FIRST:COUNT")
    ap.add_argument("--ledger", type=int, default=1, help="wrong-key: the ledger attacked")
    ap.add_argument("--key-hex", default="", help="unread-reads: the ledger's key, in hex")
    ap.add_argument("--frame-kib", type=int, default=1024, help="garbage: the size of each frame")
    ap.add_argument("--tls-ca", default="", help="connect over TLS trusting this CA")
    ap.add_argument(
        "--source-host", default="", help="connect from this local address (127.0.0.2: another peer)"
    )
    ap.add_argument("--cpu", type=int, default=-1, help="pin this process to one CPU (-1: do not)")
    args = ap.parse_args(argv)
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    print(json.dumps(uvloop.run(run(args))), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
