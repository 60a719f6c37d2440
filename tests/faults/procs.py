"""Workloads as separate OS processes, so they can be killed with SIGKILL like a real client.

    python -m tests.faults.procs writer URL HISTORY --shape 3,2,2 [--rate 400] [--window 16]
    python -m tests.faults.procs recover URL LEDGER_ID

``writer`` creates one ledger and appends unique values to it, pipelined, until it is killed or an
add fails (then it stops appending and waits to be killed). It records its history as JSON lines
in HISTORY, each line written with one unbuffered ``write`` (a SIGKILL loses at most the line being
formed, never a line half-written): ``{"ledger": id}`` once created, ``{"invoke": value}`` before
an append is sent, ``{"ok": value, "entry": id}`` only after the append was acknowledged,
``{"fail": value, "unknown": bool}`` when it failed. An ack whose line was not written yet when the
process died counts as indeterminate, which the checker treats as "may be there": never a false
"lost". ``load_writer_history`` merges such a file into a :class:`~tests.faults.history.History`.

``recover`` opens LEDGER_ID with recovery (fence, find the last entry, close), retrying while the
error is retriable, and prints one JSON line ``{"last": id}`` (or ``{"error": ...}`` and exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import uvloop

from bookkeeper_aio import BKError, BookKeeper, ClientConfig
from bookkeeper_aio.common.logging_setup import configure_logging
from tests.faults.history import AddOp, History, Outcome

PASSWORD = b"f"  # the password tests/faults/cluster.py recovers and reads with
CONFIG = ClientConfig(
    add_timeout_s=1.5,
    read_timeout_s=1.5,
    connect_timeout_s=1.0,
    reconnect_backoff_max_s=0.3,
    explicit_lac_interval_ms=50,
)
RECOVER_DEADLINE_S = 60.0


class _Lines:
    """JSON lines, each in one unbuffered write (O_APPEND)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def put(self, row: dict[str, object]) -> None:
        os.write(self.fd, (json.dumps(row) + "\n").encode())


async def writer(url: str, history: str, shape: tuple[int, int, int], rate: float, window: int) -> None:
    lines = _Lines(history)
    name = Path(history).stem
    async with BookKeeper.connect(url, config=CONFIG) as bk:
        handle = await bk.create_ledger(*shape, password=PASSWORD)
        lines.put({"ledger": handle.id})
        print(json.dumps({"ledger": handle.id}), flush=True)
        slots = asyncio.Semaphore(window)
        failed = asyncio.Event()

        def done(value: str, future: asyncio.Future[int]) -> None:
            slots.release()
            if future.cancelled():
                return
            error = future.exception()
            if error is None:
                lines.put({"ok": value, "entry": future.result()})
            else:
                unknown = not isinstance(error, BKError) or error.outcome_unknown
                lines.put({"fail": value, "unknown": unknown, "error": type(error).__name__})
                failed.set()

        sequence = 0
        started = time.monotonic()
        while not failed.is_set():
            await slots.acquire()
            value = f"{name}-{sequence}"
            sequence += 1
            lines.put({"invoke": value})
            try:
                future = await handle.append_async(value.encode())
            except BKError as error:
                lines.put({"fail": value, "unknown": error.outcome_unknown, "error": type(error).__name__})
                break
            future.add_done_callback(lambda f, value=value: done(value, f))
            ahead = sequence / rate - (time.monotonic() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)
        await asyncio.Event().wait()  # stopped appending: wait for the SIGKILL


async def recover(url: str, ledger_id: int) -> int:
    deadline = time.monotonic() + RECOVER_DEADLINE_S
    async with BookKeeper.connect(url, config=CONFIG) as bk:
        while True:
            try:
                handle = await bk.open_ledger(ledger_id, password=PASSWORD, recovery=True)
            except BKError as error:
                if not error.retriable or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
                continue
            return handle.last_add_confirmed


def load_writer_history(path: Path, history: History) -> int | None:
    """Merge one writer's file into ``history``; returns its ledger id (None: it made none).
    A line cut by the SIGKILL (the last one, not newline-terminated) is ignored."""
    ledger_id: int | None = None
    ops: dict[str, AddOp] = {}
    writer = path.stem
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        row = json.loads(line)
        if "ledger" in row:
            ledger_id = row["ledger"]
        elif "invoke" in row:
            assert ledger_id is not None
            ops[row["invoke"]] = history.invoke(writer, ledger_id, row["invoke"].encode())
        elif "ok" in row:
            history.ok(ops[row["ok"]], row["entry"])
        elif "fail" in row:
            op = ops[row["fail"]]
            op.outcome, op.completed_s = (Outcome.INFO if row["unknown"] else Outcome.FAIL), history.clock()
    return ledger_id


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.procs")
    commands = parser.add_subparsers(dest="command", required=True)
    w = commands.add_parser("writer")
    w.add_argument("url")
    w.add_argument("history")
    w.add_argument("--shape", default="3,2,2")
    w.add_argument("--rate", type=float, default=400.0, help="appends per second at most")
    w.add_argument("--window", type=int, default=16, help="appends in flight at most")
    r = commands.add_parser("recover")
    r.add_argument("url")
    r.add_argument("ledger", type=int)
    args = parser.parse_args(argv)
    configure_logging(stream=sys.stderr)  # stdout carries the JSON answers
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        if args.command == "writer":
            ensemble, wq, aq = (int(part) for part in args.shape.split(","))
            runner.run(writer(args.url, args.history, (ensemble, wq, aq), args.rate, args.window))
            return
        try:
            last = runner.run(recover(args.url, args.ledger))
        except BKError as error:
            print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
            sys.exit(1)
        print(json.dumps({"last": last}), flush=True)


if __name__ == "__main__":
    main()
