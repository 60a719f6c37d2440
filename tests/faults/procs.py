"""Workloads as separate OS processes, so they can be killed with SIGKILL like a real client.

    python -m tests.faults.procs writer URL HISTORY --shape 3,2,2 [--rate 400] [--window 16]
    python -m tests.faults.procs recover URL LEDGER_ID
    python -m tests.faults.procs logwriter URL LOG HISTORY [--rate 150] [--roll-entries 10] [--seed N]

``writer`` creates one ledger and appends unique values to it, pipelined, until it is killed or an
add fails (then it stops appending and waits to be killed). It records its history as JSON lines
in HISTORY, each line written with one unbuffered ``write`` (a SIGKILL loses at most the line being
formed, never a line half-written): ``{"ledger": id}`` once created, ``{"invoke": value}`` before
an append is sent, ``{"ok": value, "entry": id}`` only after the append was acknowledged,
``{"fail": value, "unknown": bool}`` when it failed. An ack whose line was not written yet when the
process died counts as indeterminate, which the checker treats as "may be there": never a false
"lost". ``load_writer_history`` merges such a file into a :class:`~tests.faults.history.History`.

``logwriter`` fights for the leadership of the log LOG: it opens it as writer (`open_log_writer`,
which fences whoever led before), appends unique values pipelined (rolling every ``--roll-entries``)
until an append fails — fenced by another writer, or a fault — then waits a random moment and opens
it again, for ever (until killed). Its HISTORY lines: ``{"leader": ledger}`` once it leads (a
takeover), ``{"ledger": id}`` when a roll moved its appends to a new ledger, ``{"invoke": value}``,
``{"ok": value, "ledger": l, "entry": e}`` (the position the ack returned), ``{"fail": ...}`` as
above; ``load_log_writer_history`` merges it into a :class:`~tests.faults.history.LogHistory`.

``recover`` opens LEDGER_ID with recovery (fence, find the last entry, close), retrying while the
error is retriable, and prints one JSON line ``{"last": id}`` (or ``{"error": ...}`` and exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

import uvloop

from bookkeeper_aio import BKError, BookKeeper, ClientConfig, LogPosition, LogWriter, open_log_writer
from bookkeeper_aio.common.logging_setup import configure_logging
from tests.faults.history import AddOp, History, LogAppend, LogHistory, Outcome

PASSWORD = b"f"  # the password tests/faults/cluster.py recovers and reads with
CONFIG = ClientConfig(
    add_timeout_s=1.5,
    read_timeout_s=1.5,
    connect_timeout_s=1.0,
    reconnect_backoff_max_s=0.3,
    explicit_lac_interval_ms=50,
)
REPO = Path(__file__).resolve().parents[2]
RECOVER_DEADLINE_S = 60.0
PENDING_WAIT_S = 10.0
CLOSE_WAIT_S = 10.0


async def spawn(log: Path, *args: str) -> asyncio.subprocess.Process:
    """``python -m tests.faults.procs ARGS`` (from the tests' side), its log lines (stderr) appended
    to ``log``, its JSON answers on its stdout (a pipe)."""
    with open(log, "ab") as err:  # noqa: ASYNC230 -- a local file, opened once per process
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.faults.procs", *args,
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=err, stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, "BKAIO_LOG_FORMAT": "json", "BKAIO_LOG_LEVEL": "warning"},
        )  # fmt: skip


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


async def log_writer(
    url: str, log_name: str, history: str, rate: float, window: int, roll_entries: int, seed: int
) -> None:
    lines = _Lines(history)
    name = Path(history).stem
    rng = random.Random(seed)
    sequence = 0
    async with BookKeeper.connect(url, config=CONFIG) as bk:
        print(json.dumps({"started": name}), flush=True)
        while True:
            try:
                writer = await open_log_writer(bk, log_name, password=PASSWORD, roll_entries_max=roll_entries)
            except BKError as error:
                lines.put({"open_failed": type(error).__name__})
                await asyncio.sleep(rng.uniform(0.1, 0.5))
                continue
            lines.put({"leader": writer.ledger_id})
            sequence = await _lead(writer, lines, name, sequence, rate, window)
            await asyncio.sleep(rng.uniform(0.2, 1.0))  # then fight for the log again


async def _lead(writer: LogWriter, lines: _Lines, name: str, sequence: int, rate: float, window: int) -> int:
    """Append until an append fails (fenced, or a fault); then close what is left. The next
    sequence number."""
    slots = asyncio.Semaphore(window)
    failed = asyncio.Event()
    pending: set[asyncio.Future[LogPosition | None]] = set()
    ledger_id = writer.ledger_id

    def done(value: str, future: asyncio.Future[LogPosition | None]) -> None:
        slots.release()
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            position = future.result()
            assert position is not None  # no sequence numbers here: never a skipped duplicate
            lines.put({"ok": value, "ledger": position[0], "entry": position[1]})
        else:
            unknown = not isinstance(error, BKError) or error.outcome_unknown
            lines.put({"fail": value, "unknown": unknown, "error": type(error).__name__})
            failed.set()

    started, count = time.monotonic(), 0
    while not failed.is_set():
        await slots.acquire()
        if failed.is_set():
            break
        value = f"{name}-{sequence}"
        sequence += 1
        lines.put({"invoke": value})
        try:
            future = await writer.append_async(value.encode())
        except BKError as error:
            lines.put({"fail": value, "unknown": error.outcome_unknown, "error": type(error).__name__})
            break
        if writer.ledger_id != ledger_id:  # a roll listed it and moved the appends there
            ledger_id = writer.ledger_id
            lines.put({"ledger": ledger_id})
        pending.add(future)
        future.add_done_callback(pending.discard)
        future.add_done_callback(lambda f, value=value: done(value, f))
        count += 1
        ahead = count / rate - (time.monotonic() - started)
        if ahead > 0:
            await asyncio.sleep(ahead)
    if pending:
        await asyncio.wait(pending, timeout=PENDING_WAIT_S)
    with contextlib.suppress(BKError, TimeoutError):  # fenced: nothing to do; else a later open fences it
        await asyncio.wait_for(writer.close(), CLOSE_WAIT_S)
    return sequence


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


def load_log_writer_history(path: Path, history: LogHistory) -> None:
    """Merge one log writer's file into ``history`` (a last line cut by the SIGKILL is ignored)."""
    ops: dict[str, LogAppend] = {}
    writer = path.stem
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        row = json.loads(line)
        if "leader" in row:
            history.leader(writer, row["leader"])
        elif "ledger" in row and "ok" not in row:
            history.owned(writer, row["ledger"])
        elif "invoke" in row:
            ops[row["invoke"]] = history.invoke(writer, row["invoke"].encode())
        elif "ok" in row:
            history.ok(ops[row["ok"]], (row["ledger"], row["entry"]))
        elif "fail" in row:
            op = ops[row["fail"]]
            op.outcome, op.completed_s = (Outcome.INFO if row["unknown"] else Outcome.FAIL), history.clock()
            op.error = row["error"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.procs")
    commands = parser.add_subparsers(dest="command", required=True)
    w = commands.add_parser("writer")
    w.add_argument("url")
    w.add_argument("history")
    w.add_argument("--shape", default="3,2,2")
    w.add_argument("--rate", type=float, default=400.0, help="appends per second at most")
    w.add_argument("--window", type=int, default=16, help="appends in flight at most")
    lw = commands.add_parser("logwriter")
    lw.add_argument("url")
    lw.add_argument("log")
    lw.add_argument("history")
    lw.add_argument("--rate", type=float, default=150.0, help="appends per second at most, per tenure")
    lw.add_argument("--window", type=int, default=16, help="appends in flight at most")
    lw.add_argument("--roll-entries", type=int, default=10, help="roll after this many appends")
    lw.add_argument("--seed", type=int, default=0, help="its pauses between tenures")
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
        if args.command == "logwriter":
            runner.run(
                log_writer(
                    args.url, args.log, args.history, args.rate, args.window, args.roll_entries, args.seed
                )
            )
            return
        try:
            last = runner.run(recover(args.url, args.ledger))
        except BKError as error:
            print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
            sys.exit(1)
        print(json.dumps({"last": last}), flush=True)


if __name__ == "__main__":
    main()
