"""A log writer in its own process, driven line by line on stdin (the acceptance tests' competitors).

    python -m tests.integration.log.writer_worker URL LOG WRITER_ID OUT_FILE [WINDOW] [ROLL_ENTRIES] [stream]

Commands (stdin, one per line):

- ``open``: become the log's writer (`open_log_writer`: fences whoever wrote before), then append
  without pause (``WINDOW`` appends in flight, values ``<WRITER_ID>-<sequence>``) until fenced.
  Answers ``opened <ledger_id>``, then ``acked <n>`` once this session has ``n`` = 20 acks, and
  ``stopped <reason>`` when the session ends (fenced, or another error).
- ``close``: stop appending, close the writer if it still leads, write every append's outcome to
  ``OUT_FILE`` (`tests.harness.log_history.AppendRecord` rows as JSON lines) and answer ``done``.
  With ``stream`` every append is written to ``OUT_FILE`` (unbuffered) when it starts and again
  when it completes, so a worker killed with SIGKILL leaves its history: the last row of an append
  counts (`tests.harness.log_history.latest_rows`), one that never completed is indeterminate.

A sequenced log (an idempotent producer that fails over between the processes):

- ``open_hold``: become the writer, answer ``opened <ledger_id> <last_sequence>``, append nothing.
- ``pump_from N``: append messages ``m-<n>`` with ``sequence=n`` from ``n = N`` on, without pause,
  until fenced; ``stopped <reason> resume=<r>`` names the lowest sequence of this session that was
  neither acknowledged nor skipped as already in the log (the producer's restart point). Here
  ``AppendRecord.sequence`` is the message's sequence; a skipped duplicate (``append`` returned
  None) is recorded as ``fail`` ("skipped").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from typing import Any, BinaryIO

from bookkeeper_aio import BookKeeper, ClientConfig, LogFenced, open_log_writer
from bookkeeper_aio.errors import BKError
from bookkeeper_aio.log.writer import LogWriter
from tests.harness.log_history import AppendRecord, Outcome, outcome_of

CONFIG = ClientConfig(add_timeout_s=2.0, read_timeout_s=2.0, reconnect_backoff_max_s=0.5)
QUORUM = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}
ACKED_REPORT = 20


def say(line: str) -> None:
    print(line, flush=True)


class Worker:
    def __init__(
        self, bk: BookKeeper, log_name: str, writer_id: str, window: int, roll: int, journal: BinaryIO | None
    ) -> None:
        self.bk = bk
        self.journal = journal
        self.log_name = log_name
        self.writer_id = writer_id
        self.window = window
        self.roll = roll or None
        self.records: list[AppendRecord] = []
        self.sequence = 0
        self.writer: LogWriter | None = None
        self.pump: asyncio.Task[None] | None = None
        self.stopping = False

    async def open(self, *, hold: bool = False) -> None:
        await self.stop_pump()
        self.stopping = False
        self.writer = await open_log_writer(
            self.bk,
            self.log_name,
            roll_entries_max=self.roll,
            **QUORUM,  # type: ignore[arg-type]
        )
        if hold:
            say(f"opened {self.writer.ledger_id} {self.writer.last_sequence}")
            return
        say(f"opened {self.writer.ledger_id}")
        self.pump = asyncio.create_task(self._pump(self.writer))

    def pump_from(self, first: int) -> None:
        assert self.writer is not None
        assert self.pump is None
        self.pump = asyncio.create_task(self._pump(self.writer, first))

    async def _pump(self, writer: LogWriter, first_message: int | None = None) -> None:
        """Appends until fenced or stopped; ``first_message``: a sequenced producer from there."""
        slots = asyncio.Semaphore(self.window)
        acked = [0]
        stopped: list[str] = []
        inflight: set[asyncio.Future[Any]] = set()

        def finish(record: AppendRecord, future: asyncio.Future[Any]) -> None:
            slots.release()
            inflight.discard(future)
            record.completed_s = time.monotonic()
            try:
                _complete(record, future)
            finally:
                self._note(record)

        def _complete(record: AppendRecord, future: asyncio.Future[Any]) -> None:
            if future.cancelled():
                record.outcome, record.error = Outcome.INDETERMINATE, "cancelled"
                return
            error = future.exception()
            if error is None and future.result() is None:  # a duplicate the writer skipped
                record.outcome, record.error = Outcome.FAIL, "skipped"
                return
            if error is None:
                record.outcome, record.position = Outcome.OK, future.result()
                acked[0] += 1
                if acked[0] == ACKED_REPORT:
                    say(f"acked {ACKED_REPORT}")
                return
            record.outcome, record.error = outcome_of(error), repr(error)
            if not stopped:
                stopped.append(type(error).__name__)

        session: list[AppendRecord] = []
        message = first_message
        while not self.stopping and not stopped:
            await slots.acquire()
            if message is None:
                record = AppendRecord(self.writer_id, self.sequence, Outcome.INDETERMINATE)
                self.sequence += 1
                payload, sequence = record.value, None
            else:
                record = AppendRecord(self.writer_id, message, Outcome.INDETERMINATE)
                payload, sequence = f"m-{message}".encode(), message
                message += 1
            self.records.append(record)
            session.append(record)
            record.invoked_s = time.monotonic()
            self._note(record)
            try:
                future = await writer.append_async(payload, sequence=sequence)
            except BKError as error:
                slots.release()
                record.completed_s = time.monotonic()
                record.outcome, record.error = outcome_of(error), repr(error)
                self._note(record)
                stopped.append(type(error).__name__)
                break
            inflight.add(future)
            future.add_done_callback(functools.partial(finish, record))
        if inflight:
            await asyncio.wait(set(inflight))
        if stopped and first_message is None:
            say(f"stopped {stopped[0]}")
        elif stopped:
            unsure = (r.sequence for r in session if r.outcome is not Outcome.OK and r.error != "skipped")
            resume = min(unsure, default=message)  # a skipped duplicate is in the log: not again
            say(f"stopped {stopped[0]} resume={resume}")

    def _note(self, record: AppendRecord) -> None:
        if self.journal is not None:
            self.journal.write(record.to_json().encode() + b"\n")

    async def stop_pump(self) -> None:
        self.stopping = True
        if self.pump is not None:
            await self.pump
            self.pump = None

    async def close(self, out_file: str) -> None:
        await self.stop_pump()
        if self.writer is not None:
            with contextlib.suppress(LogFenced):
                await self.writer.close()
        if self.journal is None:
            with open(out_file, "w") as out:  # noqa: ASYNC230 -- once, at the end
                out.write("".join(record.to_json() + "\n" for record in self.records))
        say("done")


async def main(
    url: str, log_name: str, writer_id: str, out_file: str, window: int, roll: int, stream: bool
) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with BookKeeper.connect(url, config=CONFIG) as bk:
        journal = open(out_file, "wb", buffering=0) if stream else None  # noqa: ASYNC230,SIM115
        worker = Worker(bk, log_name, writer_id, window, roll, journal)
        say("ready")
        while line := (await reader.readline()).decode().strip():
            if line in ("open", "open_hold"):
                try:
                    await worker.open(hold=line == "open_hold")
                except BKError as error:
                    say(f"open_failed {error!r}")
            elif line.startswith("pump_from "):
                worker.pump_from(int(line.split()[1]))
            elif line == "close":
                await worker.close(out_file)
                return


if __name__ == "__main__":
    url, log_name, writer_id, out_file = sys.argv[1:5]
    window = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    roll = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    stream = len(sys.argv) > 7 and sys.argv[7] == "stream"
    asyncio.run(main(url, log_name, writer_id, out_file, window, roll, stream))
