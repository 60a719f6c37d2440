"""Issue 14's acceptance runs for logs, on real bookie processes and real etcd.

- Leader churn: two writer *processes* (tests/integration/log/writer_worker.py) take the log from
  each other while the other appends; a history of every append and every revision of the ledger
  list (metadata watch) is checked against a reader from "earliest" (tests/harness/log_history.py),
  and a following reader that ran all along must have seen exactly the same records (one from
  "latest", opened mid-churn, a suffix of them). Variants (slow): both writers rolling every 7
  appends (takeovers land on rolls under way), a third party truncating all along, both processes
  opening at the same moment, writers killed with SIGKILL mid-append, and an idempotent producer on
  a sequenced log failing over between the processes (every sequence exactly once).
- Roll under load: pipelined appends with a roll every N entries: no gap, no duplicate; the longest
  append pause during a roll is printed next to the roll's own CAS time (measured, not asserted:
  docs/benchmarks.md has the numbers).
- A tailing reader across rolls and takeovers delivers every acked record once, in order.

The full-size runs (100 takeovers, 100,000 appends) are ``slow``; small versions run by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bookkeeper_aio import (
    BookKeeper,
    LogFenced,
    LogPosition,
    LogRecord,
    open_log_reader,
    open_log_writer,
    truncate_log,
)
from bookkeeper_aio.errors import BKError
from bookkeeper_aio.log.writer import LogWriter
from metadata import log_metadata as log_serde
from metadata.log_manager import LogManager
from metadata.log_metadata import LogLedgerState, LogMetadata
from metadata.store import EventKind, MetadataStore
from tests.harness.log_history import (
    AppendRecord,
    LogHistory,
    Outcome,
    latest_rows,
    outcome_of,
)
from tests.integration.log.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd

REPO_ROOT = Path(__file__).resolve().parents[3]
QUORUM: dict[str, Any] = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}
WAIT_S = 30.0


# ---------------------------------------------------------------------------------------- helpers
class ListSampler:
    """Every revision of a log's ledger list, from a metadata watch, into ``history.sample``."""

    def __init__(self, store: MetadataStore, root: str, name: str, history: LogHistory) -> None:
        self._store = store
        self._manager = LogManager(store, root)
        self._key = self._manager.keys.log(name)
        self._name = name
        self._history = history
        self._task: asyncio.Task[None] | None = None
        self.last: LogMetadata | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        revision = await self._store.current_revision()
        self._task = asyncio.create_task(self._run(revision + 1))

    async def _run(self, revision: int) -> None:
        events = self._store.watch(self._key, start_revision=revision)
        async with contextlib.aclosing(events):
            async for event in events:
                if event.kind is EventKind.PUT and event.value is not None:
                    self.last = log_serde.decode(event.value, key=self._key, name=self._name)
                    self._history.sample(self.last)
                    self._changed.set()

    async def stop(self) -> None:
        """Once the watch delivered the list as it is now (so the last state is sampled too)."""
        now = (await self._manager.read(self._name)).metadata
        async with asyncio.timeout(WAIT_S):
            while self.last != now:
                self._changed.clear()
                await self._changed.wait()
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class WriterProcess:
    """One ``python -m tests.integration.log.writer_worker`` child, driven through stdin/stdout."""

    def __init__(self, process: asyncio.subprocess.Process, writer_id: str, out_file: Path) -> None:
        self.process = process
        self.writer_id = writer_id
        self.out_file = out_file
        self.lines: list[str] = []

    @classmethod
    async def spawn(
        cls,
        url: str,
        log: str,
        writer_id: str,
        base: Path,
        window: int = 16,
        roll_entries: int = 0,
        stream: bool = False,
    ) -> WriterProcess:
        out_file = base / f"history-{writer_id}.jsonl"
        stderr = open(base / f"worker-{writer_id}.log", "wb")  # noqa: ASYNC230,SIM115 -- a test's log
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.integration.log.writer_worker",
            url,
            log,
            writer_id,
            str(out_file),
            str(window),
            str(roll_entries),
            *(["stream"] if stream else []),
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
        stderr.close()
        worker = cls(process, writer_id, out_file)
        await worker.expect("ready")
        return worker

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command.encode() + b"\n")

    async def expect(self, prefix: str, timeout_s: float = WAIT_S) -> str:
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout_s):
            while True:
                raw = await self.process.stdout.readline()
                if not raw:
                    raise AssertionError(
                        f"{self.writer_id} exited ({await self.process.wait()}) before {prefix!r}"
                    )
                line = raw.decode().strip()
                self.lines.append(line)
                if line.startswith(prefix):
                    return line

    async def finish(self) -> list[AppendRecord]:
        self.send("close")
        await self.expect("done")
        await self.process.wait()
        return latest_rows(self.out_file.read_text())

    async def kill(self) -> list[AppendRecord]:
        """SIGKILL (a streaming worker's history survives it)."""
        self.process.kill()
        await self.process.wait()
        return latest_rows(self.out_file.read_text())

    async def reap(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


def _acked(position: LogPosition | None) -> tuple[Outcome, LogPosition | None]:
    """An ack's outcome: a position; None (a skipped duplicate) cannot happen on these logs."""
    assert position is not None, "an append on a log without sequences was skipped"
    return Outcome.OK, position


async def _read_all(bk: BookKeeper, name: str) -> list[LogRecord]:
    reader = await open_log_reader(bk, name, password=b"pw")
    return [record async for record in reader]


class Pump:
    """Appends ``<writer>-<sequence>`` values through ``append_async`` without pause (``window`` in
    flight) into a `LogHistory`, until stopped or the writer fails."""

    def __init__(self, writer: LogWriter, writer_id: str, history: LogHistory, window: int = 32) -> None:
        self.writer = writer
        self.writer_id = writer_id
        self.history = history
        self.records: list[AppendRecord] = []
        self._window = window
        self._stopping = False
        self.acked = 0
        self.error: BaseException | None = None
        self._acked_changed = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    sequence_start: dict[str, int] = {}

    async def _run(self) -> None:
        slots = asyncio.Semaphore(self._window)
        inflight: set[asyncio.Future[Any]] = set()

        def finish(record: AppendRecord, future: asyncio.Future[Any]) -> None:
            slots.release()
            inflight.discard(future)
            record.completed_s = time.monotonic()
            if future.cancelled():
                record.outcome, record.error = Outcome.INDETERMINATE, "cancelled"
                return
            error = future.exception()
            if error is None:
                record.outcome, record.position = _acked(future.result())
                self.acked += 1
                self._acked_changed.set()
            else:
                record.outcome, record.error = outcome_of(error), repr(error)
                self.error = self.error or error

        while not self._stopping and self.error is None:
            await slots.acquire()
            sequence = Pump.sequence_start.get(self.writer_id, 0)
            Pump.sequence_start[self.writer_id] = sequence + 1
            record = AppendRecord(self.writer_id, sequence, Outcome.INDETERMINATE, invoked_s=time.monotonic())
            self.records.append(record)
            self.history.add(record)
            try:
                future = await self.writer.append_async(record.value)
            except BKError as error:
                slots.release()
                record.completed_s = time.monotonic()
                record.outcome, record.error = outcome_of(error), repr(error)
                self.error = error
                break
            inflight.add(future)
            future.add_done_callback(functools.partial(finish, record))
        if inflight:
            await asyncio.wait(set(inflight))

    async def wait_acked(self, count: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while self.acked < count:
                if self.task.done():
                    raise AssertionError(f"pump stopped after {self.acked} acks: {self.error!r}")
                self._acked_changed.clear()
                await self._acked_changed.wait()

    async def stop(self) -> None:
        self._stopping = True
        await self.task


class Tailer:
    """Iterates a following reader in a task; waits on how many records arrived."""

    def __init__(self, reader: AsyncGenerator[LogRecord, None]) -> None:
        self.records: list[LogRecord] = []
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._run(reader))
        self.task.add_done_callback(lambda _: self._changed.set())

    async def _run(self, reader: AsyncGenerator[LogRecord, None]) -> None:
        async with contextlib.aclosing(reader):
            async for record in reader:
                self.records.append(record)
                self._changed.set()

    async def wait_for(self, count: int, timeout_s: float = WAIT_S) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.records) < count:
                if self.task.done():
                    self.task.result()
                    raise AssertionError("the following reader ended")
                self._changed.clear()
                await self._changed.wait()

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


# ------------------------------------------------------------------------------ 1. leader churn
class OpenFailed(AssertionError):
    """A writer process could not open the log (its ``open_failed`` line)."""


async def _leader_churn(
    cluster: Cluster,
    bk: BookKeeper,
    base: Path,
    takeovers: int,
    roll_entries: int = 0,
    truncate_every_s: float | None = None,
) -> None:
    """``truncate_every_s``: a third party also truncates the log before its last ledger that often
    (then acked appends in truncated ledgers are not required, and no following reader runs: one
    that falls behind a truncation gets `LogTruncated`, as documented)."""
    await cluster.start(4)
    name = "churn"
    await LogManager(cluster.meta.store, cluster.root).create(name)
    history = LogHistory()
    sampler = ListSampler(cluster.meta.store, cluster.root, name, history)
    await sampler.start()
    tailer = latest = None
    latest_opened_s = 0.0
    if truncate_every_s is None:
        tailer = Tailer(await open_log_reader(bk, name, password=b"pw", follow=True))  # all along
    truncations = [0]

    async def truncate_often(every_s: float) -> None:
        manager = LogManager(cluster.meta.store, cluster.root)
        while True:
            await asyncio.sleep(every_s)
            ledgers = (await manager.read(name)).metadata.ledger_ids
            if len(ledgers) > 1:
                await truncate_log(bk, name, LogPosition(ledgers[-1], 0), password=b"pw")
                truncations[0] += 1

    truncating = None if truncate_every_s is None else asyncio.create_task(truncate_often(truncate_every_s))
    workers: list[WriterProcess] = []
    try:
        for writer_id in ("A", "B"):
            workers.append(
                await WriterProcess.spawn(cluster.url, name, writer_id, base, roll_entries=roll_entries)
            )
        for session in range(takeovers + 1):
            worker = workers[session % 2]
            if session == 2 and tailer is not None:  # mid-churn, while a writer appends
                latest = Tailer(await open_log_reader(bk, name, start="latest", password=b"pw", follow=True))
                latest_opened_s = time.monotonic()  # CLOCK_MONOTONIC: the workers' clock too
            worker.send("open")  # fences the other, which is appending without pause
            opened = await worker.expect("open")  # "opened ..." or "open_failed <error>"
            if not opened.startswith("opened "):
                raise OpenFailed(f"writer {worker.writer_id}, session {session}: {opened}")
            await worker.expect("acked")  # this session has acks: the next open is a takeover under load
        for worker in workers:
            history.extend(await worker.finish())
    finally:
        if truncating is not None:
            truncating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await truncating
        for worker in workers:
            await worker.reap()
    read = await _read_all(bk, name)
    await sampler.stop()
    if tailer is not None:
        # the reader that followed the log through every takeover saw exactly the log, once, in order
        await tailer.wait_for(len(read))
        await asyncio.sleep(0.1)  # nothing more may come
        await tailer.stop()
        assert [(r.position, r.payload) for r in tailer.records] == [(r.position, r.payload) for r in read]
    if latest is not None:
        # from "latest": a suffix of the log, holding every append acked that started after it opened
        await latest.wait_for(1)
        await asyncio.sleep(0.1)
        await latest.stop()
        got = [(r.position, r.payload) for r in latest.records]
        assert got == [(r.position, r.payload) for r in read][len(read) - len(got) :]
        seen = {payload for _, payload in got}
        later = [
            r for r in history.appends.values() if r.outcome is Outcome.OK and r.invoked_s > latest_opened_s
        ]
        assert later
        assert all(r.value in seen for r in later)
    final = (await LogManager(cluster.meta.store, cluster.root).read(name)).metadata
    # without rolls one ledger is OPEN at a time; a roll lists the new one before closing the old
    result = history.check(read, open_max=2 if roll_entries else 1, truncated_before=final.truncated_before)
    rolling = sum(1 for sample in history.samples if sum(s is LogLedgerState.OPEN for _, s in sample) == 2)
    print(f"\nleader churn, {takeovers} takeovers, roll every {roll_entries}: {result.summary()}")
    mid_roll = _takeovers_during_a_roll(history)
    print(f"list samples with two OPEN ledgers (a roll under way): {rolling}; takeovers of them: {mid_roll}")
    assert result.ok, result.summary()
    # every session but the last was ended by the next open, while it was appending
    fenced = sum(line == "stopped LogFenced" for worker in workers for line in worker.lines)
    assert fenced == takeovers, [worker.lines for worker in workers]
    if truncate_every_s is not None:
        print(f"truncations: {truncations[0]}, the log now starts at ledger {final.ledger_ids[0]}")
        assert truncations[0] > 0
        assert final.truncated_before > 0
    elif not roll_entries:
        assert result.ledgers == takeovers + 1
    else:
        assert rolling > 0
        assert mid_roll > 0  # takeovers did land on a roll under way
    assert result.acked >= 20 * (takeovers + 1)


async def test_leader_churn_small(cluster: Cluster, bk: BookKeeper, tmp_path: Path) -> None:
    await _leader_churn(cluster, bk, tmp_path, takeovers=5)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_leader_churn_100_takeovers(cluster: Cluster, bk: BookKeeper, tmp_path: Path) -> None:
    await _leader_churn(cluster, bk, tmp_path, takeovers=100)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_dueling_opens(cluster: Cluster, bk: BookKeeper, tmp_path: Path) -> None:
    """Both processes open the log at the same moment, 30 times (leader suggestion gone wrong: both
    believe they lead). Whatever the interleaving, the history holds: no ack is lost or moved."""
    await cluster.start(3)
    name = "duel"
    await LogManager(cluster.meta.store, cluster.root).create(name)
    history = LogHistory()
    sampler = ListSampler(cluster.meta.store, cluster.root, name, history)
    await sampler.start()
    workers: list[WriterProcess] = []
    try:
        for writer_id in ("A", "B"):
            workers.append(await WriterProcess.spawn(cluster.url, name, writer_id, tmp_path))
        for _ in range(30):
            for worker in workers:
                worker.send("open")
            lines = [await worker.expect("open") for worker in workers]
            assert all(line.startswith("opened ") for line in lines), lines
            await asyncio.sleep(0.1)  # the survivor appends, the loser finds out
        for worker in workers:
            history.extend(await worker.finish())
    finally:
        for worker in workers:
            await worker.reap()
    read = await _read_all(bk, name)
    await sampler.stop()
    result = history.check(read, open_max=1)
    print(f"\ndueling opens, 30 rounds: {result.summary()}")
    assert result.ok, result.summary()
    assert result.acked > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_leader_churn_under_truncation(cluster: Cluster, bk: BookKeeper, tmp_path: Path) -> None:
    """50 takeovers (writers rolling every 7 appends) while a third party truncates the log before
    its last ledger every 20 ms."""
    await _leader_churn(cluster, bk, tmp_path, takeovers=50, roll_entries=7, truncate_every_s=0.02)


def _takeovers_during_a_roll(history: LogHistory) -> int:
    """List changes that took a list with two OPEN ledgers to one where both are CLOSED and a
    further ledger was appended: a new writer fenced both ledgers of a roll under way."""
    count = 0
    for before, after in itertools.pairwise(history.samples):
        opened = [ledger_id for ledger_id, state in before if state is LogLedgerState.OPEN]
        states = dict(after)
        if (
            len(opened) == 2
            and all(states.get(ledger_id) is LogLedgerState.CLOSED for ledger_id in opened)
            and len(after) > len(before)
        ):
            count += 1
    return count


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_leader_churn_100_takeovers_with_rolls(
    cluster: Cluster, bk: BookKeeper, tmp_path: Path
) -> None:
    """Each writer also rolls every 7 appends: takeovers land during rolls too (two OPEN ledgers,
    the case for fencing the last two)."""
    await _leader_churn(cluster, bk, tmp_path, takeovers=100, roll_entries=7)


async def _idempotent_failover(cluster: Cluster, bk: BookKeeper, base: Path, takeovers: int) -> None:
    """One logical producer on a sequenced log fails over between two processes: each new leader
    resumes at the lowest sequence the old one had not seen acknowledged, so it re-sends records the
    old leader may have written ("fenced means maybe written"); the log must hold every sequence
    exactly once, contiguous, in order."""
    await cluster.start(3)
    name = "exactly-once"
    await LogManager(cluster.meta.store, cluster.root).create(name, sequenced=True)
    tailer = Tailer(await open_log_reader(bk, name, password=b"pw", follow=True))
    workers: list[WriterProcess] = []
    resume = 0
    resent = 0
    try:
        for writer_id in ("A", "B"):
            workers.append(await WriterProcess.spawn(cluster.url, name, writer_id, base))
        for session in range(takeovers + 1):
            worker, other = workers[session % 2], workers[(session + 1) % 2]
            worker.send("open_hold")  # fences the other, which is appending without pause
            opened = (await worker.expect("opened")).split()
            last_in_log = -1 if opened[2] == "None" else int(opened[2])
            if session:
                stopped = await other.expect("stopped")
                assert stopped.startswith("stopped LogFenced resume="), stopped
                resume = int(stopped.rsplit("=", 1)[1])
                assert last_in_log >= resume - 1  # every acknowledged sequence is in the log
                resent += last_in_log - resume + 1  # maybe-written records sent again
            worker.send(f"pump_from {resume}")
            await worker.expect("acked")
        histories = [await worker.finish() for worker in workers]
    finally:
        for worker in workers:
            await worker.reap()
    read = await _read_all(bk, name)
    await tailer.wait_for(len(read))
    await asyncio.sleep(0.1)  # nothing more may come
    await tailer.stop()
    assert tailer.records == read  # the following reader too: each sequence once, same positions
    sequences = [record.sequence for record in read]
    assert sequences == list(range(len(read))), "not every sequence exactly once, in order"
    assert all(record.payload == f"m-{record.sequence}".encode() for record in read)
    positions = [record.position for record in read]
    assert positions == sorted(set(positions))
    at = {record.sequence: record.position for record in read}
    acked = [r for history in histories for r in history if r.outcome is Outcome.OK]
    for record in acked:  # acknowledged: in the log, where its ack said
        assert at.get(record.sequence) == record.position, record
    skipped = sum(1 for history in histories for r in history if r.error == "skipped")
    print(
        f"\nidempotent failover, {takeovers} takeovers: {len(read)} records, {len(acked)} acked, "
        f"{resent} re-sent maybe-written, {skipped} skipped as duplicates"
    )
    assert resent > 0  # the takeovers did land on appends in flight
    assert skipped == resent  # each re-sent record the log already held was dropped, no other


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_idempotent_appends_across_50_takeovers(
    cluster: Cluster, bk: BookKeeper, tmp_path: Path
) -> None:
    await _idempotent_failover(cluster, bk, tmp_path, takeovers=50)


async def _writers_killed(cluster: Cluster, bk: BookKeeper, base: Path, rounds: int) -> None:
    """Each writer process is killed with SIGKILL while it appends; the next one takes the log
    over from a dead leader (recovering its ledger). Histories are streamed by the workers."""
    await cluster.start(3)
    name = "killed"
    await LogManager(cluster.meta.store, cluster.root).create(name)
    history = LogHistory()
    sampler = ListSampler(cluster.meta.store, cluster.root, name, history)
    await sampler.start()
    tailer = Tailer(await open_log_reader(bk, name, password=b"pw", follow=True))
    for index in range(rounds):
        worker = await WriterProcess.spawn(cluster.url, name, f"k{index}", base, stream=True)
        try:
            worker.send("open")
            await worker.expect("opened")
            await worker.expect("acked")
            history.extend(await (worker.kill() if index < rounds - 1 else worker.finish()))
        finally:
            await worker.reap()
    read = await _read_all(bk, name)
    await sampler.stop()
    await tailer.wait_for(len(read))
    await asyncio.sleep(0.1)  # nothing more may come
    await tailer.stop()
    assert [(r.position, r.payload) for r in tailer.records] == [(r.position, r.payload) for r in read]
    result = history.check(read, open_max=1)
    print(f"\nwriters killed, {rounds - 1} kills: {result.summary()}")
    assert result.ok, result.summary()
    assert result.ledgers == rounds
    assert result.indeterminate >= rounds - 1  # each died with appends in flight


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_takeovers_from_writers_killed_mid_append(
    cluster: Cluster, bk: BookKeeper, tmp_path: Path
) -> None:
    await _writers_killed(cluster, bk, tmp_path, rounds=11)


# ---------------------------------------------------------------------------- 2. roll under load
class Timings:
    """Start/end (monotonic s) of every roll, ledger-list CAS and ledger creation."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {"roll": [], "cas": [], "create": []}

    def wrap(self, what: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            result = await call(*args, **kwargs)
            self.spans[what].append((started, time.monotonic()))
            return result

        return timed


async def _roll_under_load(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch, appends: int, roll_every: int
) -> None:
    await cluster.start(3)
    name = "rolling"
    timings = Timings()
    monkeypatch.setattr(LogManager, "write", timings.wrap("cas", LogManager.write))
    monkeypatch.setattr(LogWriter, "roll", timings.wrap("roll", LogWriter.roll))
    monkeypatch.setattr(bk, "create_ledger", timings.wrap("create", bk.create_ledger))
    await LogManager(cluster.meta.store, cluster.root).create(name)
    history = LogHistory()
    sampler = ListSampler(cluster.meta.store, cluster.root, name, history)
    await sampler.start()
    writer = await open_log_writer(bk, name, roll_entries_max=roll_every, **QUORUM)
    window = 256
    slots = asyncio.Semaphore(window)
    records: list[AppendRecord] = []

    def finish(record: AppendRecord, future: asyncio.Future[Any]) -> None:
        slots.release()
        record.completed_s = time.monotonic()
        error = future.exception()
        if error is None:
            record.outcome, record.position = _acked(future.result())
        else:
            record.outcome, record.error = outcome_of(error), repr(error)

    lags: list[tuple[float, float]] = []  # (when, how late a 1 ms sleep woke up): event-loop stalls

    async def lag_monitor() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.001)
            now = time.monotonic()
            lags.append((now, now - before - 0.001))

    monitor = asyncio.create_task(lag_monitor())
    futures = []
    started = time.monotonic()
    for sequence in range(appends):
        await slots.acquire()
        record = AppendRecord("w", sequence, Outcome.INDETERMINATE, invoked_s=time.monotonic())
        records.append(record)
        future = await writer.append_async(record.value)
        future.add_done_callback(functools.partial(finish, record))
        futures.append(future)
        if sequence % 16 == 15:
            await asyncio.sleep(0)  # this loop never waits while slots are free: no long bursts
    await asyncio.gather(*futures)
    elapsed = time.monotonic() - started
    monitor.cancel()
    await writer.close()
    history.extend(records)
    read = await _read_all(bk, name)
    await sampler.stop()

    # a roll has two OPEN ledgers for a moment (the new one is listed before the old one is closed)
    result = history.check(read, open_max=2)
    assert result.ok, result.summary()
    assert result.acked == appends == result.read  # no gap, no duplicate
    per_ledger = Counter(r.position.ledger_id for r in read)
    ledgers = sorted(per_ledger)
    assert len(ledgers) >= 2
    # a roll starts once roll_every appends went to the ledger; appends go on to it until the CAS
    assert all(per_ledger[ledger_id] >= roll_every for ledger_id in ledgers[:-1]), per_ledger
    # the pauses: per roll, the window from its start to its close CAS
    rolls, spares = _roll_windows(timings)
    report = _pause_report(records, rolls, spares)
    in_roll = [lag for t, lag in lags if any(w["start"] <= t <= w["end"] + 0.001 for w in rolls)]
    report["loop_lag_ms_max_in_roll"] = round(max(in_roll, default=0) * 1e3, 2)
    report["loop_lag_ms_max"] = round(max((lag for _, lag in lags), default=0) * 1e3, 2)
    report["appends_per_s"] = round(appends / elapsed)
    report["ledgers"] = result.ledgers
    report["entries_per_ledger_max"] = max(per_ledger.values())
    print(f"\nroll under load, {appends} appends, roll every {roll_every}: {report}")


def _roll_windows(timings: Timings) -> tuple[list[dict[str, float]], list[tuple[float, float]]]:
    """One dict per roll: its start, the end of a create within it (a roll without a spare), the
    CAS that listed the new ledger, its end (after the close CAS). And the spares' preparations:
    from each create outside a roll (not the open's) to the end of the CAS that followed it."""
    spans = timings.spans
    rolls, spares = [], []
    for start, end in spans["roll"]:
        creates = [c for c in spans["create"] if start <= c[0] <= end]
        cas = [c for c in spans["cas"] if start <= c[0] <= end]
        create_end = creates[0][1] if creates else start
        rolls.append(
            {
                "start": start,
                "create_end": create_end,
                "cas_start": cas[0][0],
                "cas_end": cas[0][1],
                "end": end,
            }
        )
    for start, end in spans["create"][1:]:
        if not any(w["start"] <= start <= w["end"] for w in rolls):
            spare_cas = [c for c in spans["cas"] if c[0] >= end]
            spares.append((start, spare_cas[0][1] if spare_cas else end))
    return rolls, spares


def _longest_gap(gaps: list[tuple[float, float]], start: float, end: float) -> float:
    return max((b - a for a, b in gaps if start <= b and a <= end), default=0.0)


def _pause_report(
    records: list[AppendRecord], rolls: list[dict[str, float]], spares: list[tuple[float, float]]
) -> dict[str, Any]:
    """Per roll: the longest gap between consecutive completions that overlaps the roll (and the
    phase it overlaps most: create, CAS, close), the longest latency of an append in flight during
    it, and the roll's CAS time; the longest gap in a window as long as the roll just before it
    (the journals' own rhythm: completions come in group commits). Then the same gaps and
    latencies outside every roll, and the longest gap during each spare's preparation (its create
    and the CAS recording it) against as long a window before it."""
    done = sorted((r for r in records if r.outcome is Outcome.OK), key=lambda r: r.completed_s)
    completions = [r.completed_s for r in done]
    gaps = list(itertools.pairwise(completions))
    per_roll = []
    before: list[float] = []  # per roll: the longest gap in as long a window just before it
    inside: set[int] = set()
    previous_end = float("-inf")
    for w in rolls:
        touching = [i for i, (a, b) in enumerate(gaps) if w["start"] <= b and a <= w["end"]]
        quiet_from = w["start"] - (w["end"] - w["start"])
        if quiet_from > previous_end:
            before.append(_longest_gap(gaps, quiet_from, w["start"]))
        previous_end = w["end"]
        inside.update(touching)
        gap_index = max(touching, key=lambda i: gaps[i][1] - gaps[i][0], default=None)
        phase = "-"
        gap = 0.0
        if gap_index is not None:
            a, b = gaps[gap_index]
            gap = b - a
            phases = {
                "create": (w["start"], w["create_end"]),
                "cas": (w["cas_start"], w["cas_end"]),
                "close": (w["cas_end"], w["end"]),
            }
            phase = max(phases, key=lambda k: min(b, phases[k][1]) - max(a, phases[k][0]))
        latency = max(
            (
                r.completed_s - r.invoked_s
                for r in done
                if w["start"] <= r.completed_s and r.invoked_s <= w["end"]
            ),
            default=0.0,
        )
        per_roll.append((gap, latency, w["cas_end"] - w["cas_start"], phase))
    outside_gaps = [b - a for i, (a, b) in enumerate(gaps) if i not in inside]
    outside_latency = [
        r.completed_s - r.invoked_s
        for r in done
        if not any(w["start"] <= r.completed_s and r.invoked_s <= w["end"] for w in rolls)
    ]

    def ms(values: list[float], how: Callable[[list[float]], float]) -> float | None:
        return round(how(values) * 1e3, 2) if values else None

    spare_gap = [_longest_gap(gaps, a, b) for a, b in spares]
    before_spare = [_longest_gap(gaps, a - (b - a), a) for a, b in spares]
    gap_in = [g for g, _, _, _ in per_roll]
    lat_in = [lat for _, lat, _, _ in per_roll]
    cas = [c for _, _, c, _ in per_roll]
    return {
        "rolls": len(rolls),
        "roll_ms_median": ms([w["end"] - w["start"] for w in rolls], statistics.median),
        "roll_cas_ms_median": ms(cas, statistics.median),
        "roll_cas_ms_max": ms(cas, max),
        "roll_gap_ms_median": ms(gap_in, statistics.median),
        "roll_gap_ms_max": ms(gap_in, max),
        "rolls_gap_longer_than_cas": sum(g > c for g, _, c, _ in per_roll),
        "before_roll_gap_ms_median": ms(before, statistics.median),
        "roll_gap_phase": dict(Counter(p for _, _, _, p in per_roll)),
        "spares": len(spares),
        "spare_ms_median": ms([b - a for a, b in spares], statistics.median),
        "spare_gap_ms_median": ms(spare_gap, statistics.median),
        "before_spare_gap_ms_median": ms(before_spare, statistics.median),
        "roll_latency_ms_median": ms(lat_in, statistics.median),
        "roll_latency_ms_max": ms(lat_in, max),
        "outside_gap_ms_p99": ms(outside_gaps, lambda v: statistics.quantiles(v, n=100)[98]),
        "outside_gap_ms_max": ms(outside_gaps, max),
        "outside_latency_ms_median": ms(outside_latency, statistics.median),
        "outside_latency_ms_max": ms(outside_latency, max),
    }


async def test_roll_under_load_small(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _roll_under_load(cluster, bk, monkeypatch, appends=3000, roll_every=500)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_roll_under_load_100k(
    cluster: Cluster, bk: BookKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _roll_under_load(cluster, bk, monkeypatch, appends=100_000, roll_every=5000)


# ---------------------------------------------------------------------- 3. tailing across changes
async def test_tailing_across_10_rolls_and_3_takeovers(cluster: Cluster, bk: BookKeeper) -> None:
    """Each takeover is a new client (as a new leader process would be), under load; the rolls are
    the current writer's, under load too."""
    await cluster.start(3)
    name = "tailed"
    await LogManager(cluster.meta.store, cluster.root).create(name)
    history = LogHistory()
    sampler = ListSampler(cluster.meta.store, cluster.root, name, history)
    await sampler.start()
    tailer = Tailer(await open_log_reader(bk, name, password=b"pw", follow=True))
    rolls_per_session = (3, 3, 2, 2)
    async with contextlib.AsyncExitStack() as stack:
        pump: Pump | None = None
        for session, rolls in enumerate(rolls_per_session):
            client = await stack.enter_async_context(BookKeeper.connect(cluster.url, config=CONFIG))
            writer = await open_log_writer(client, name, **QUORUM)  # fences the previous, still appending
            if pump is not None:
                await pump.task  # ends with LogFenced
                assert isinstance(pump.error, LogFenced), pump.error
            pump = Pump(writer, f"s{session}", history)
            for _ in range(rolls):
                await pump.wait_acked(pump.acked + 50)
                await writer.roll()
            await pump.wait_acked(pump.acked + 50)
        assert pump is not None
        await pump.stop()
        await writer.close()
    final = await _read_all(bk, name)
    await tailer.wait_for(len(final))
    await asyncio.sleep(0.2)  # nothing more may come
    await tailer.stop()
    await sampler.stop()
    assert [(r.position, r.payload) for r in tailer.records] == [(r.position, r.payload) for r in final]
    result = history.check(tailer.records, open_max=2)
    print(f"\ntailing across rolls and takeovers: {result.summary()}")
    assert result.ok, result.summary()
    assert result.ledgers == sum(rolls_per_session) + len(rolls_per_session)
