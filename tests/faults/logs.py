"""Log writers fighting for the leadership of one log, for the fault scenarios (tests/faults/test_logs.py,
and `make test`'s tests/faults/test_nemesis.py::test_ledgers_and_logs_under_one_nemesis).

`LogFight` runs three log writer processes (tests/faults/procs.py ``logwriter``) on one log: each opens it
as writer (`open_log_writer`: fence the last two ledgers, CAS the list), appends unique values pipelined
and rolls every 10 appends, until another one takes the log over (its appends then fail with
`LogFenced`) or a fault fails an append; then it waits a moment and takes the log back: the leadership
changes about every second. Its nemeses kill a writer process with SIGKILL (a new incarnation starts)
or stop one with SIGSTOP for up to 2 s (a paused leader: the others take over, and once it runs again
its appends must fail). A metadata watch records every version of the log's ledger list, and a
tailing reader (``follow=True``) reads the log all along.

After heal (`finish`): liveness — a new writer must open the log and append within the liveness bound
(the log is writable again), and the tailing reader must reach that append; the whole log is read from
"earliest" by two independent clients, and the history is checked (tests/faults/history.py
`LogHistory`): at most one OPEN ledger in any version of the list (a roll's two of one writer aside),
no acked data outside the list, every acked append read exactly once at its position and in order per
writer, nothing read that was not appended, the tailing reader's records all where the final read has
them, every list mark equal to its ledger's own last entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
import uuid
from pathlib import Path

import pytest

from bookkeeper_aio import BKError, BookKeeper, LogPosition, open_log_reader, open_log_writer
from metadata.log_manager import LogManager, VersionedLog
from metadata.log_metadata import LogLedgerState
from tests.faults import figures
from tests.faults.cluster import CONFIG, LIVENESS_S, READBACK_CONFIG, FaultCluster, fault_seed
from tests.faults.history import LogHistory, Record
from tests.faults.procs import PASSWORD, load_log_writer_history, spawn

WRITERS = 3
START_TIMEOUT_S = 30.0
WATCH_CATCH_UP_S = 30.0
PAUSE_S = (0.5, 2.0)
"""How long a writer process stays stopped (SIGSTOP): long enough for another to take the log over."""
FINAL = b"final"


class LogWriterProc:
    """One incarnation of a log writer process."""

    def __init__(self, proc: asyncio.subprocess.Process, path: Path) -> None:
        self.proc, self.path = proc, path

    @classmethod
    async def start(cls, url: str, log_name: str, path: Path, seed: int) -> LogWriterProc:
        proc = await spawn(
            path.with_suffix(".log"), "logwriter", url, log_name, str(path), "--seed", str(seed)
        )
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            raise
        assert line, f"log writer exited with {await proc.wait()} before starting"
        assert json.loads(line)["started"] == path.stem
        return cls(proc, path)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)


def _view(versioned: VersionedLog) -> list[tuple[int, bool, int | None]]:
    return [
        (entry.ledger_id, entry.state is LogLedgerState.OPEN, entry.last_entry_id)
        for entry in versioned.metadata.ledgers
    ]


async def _watch(manager: LogManager, name: str, history: LogHistory) -> None:
    changes = manager.watch(name)
    async with contextlib.aclosing(changes):
        async for versioned in changes:
            assert versioned is not None, "the log was deleted"
            history.list_seen(versioned.version, _view(versioned))


async def _tail(bk: BookKeeper, name: str, out: list[Record], last: bytes, errors: list[str]) -> None:
    """A tailing reader from "earliest" until it hands out ``last``; after an error it goes on
    right after the last record it handed out."""
    start: LogPosition | str = "earliest"
    while True:
        try:
            reader = await open_log_reader(bk, name, start=start, password=PASSWORD, follow=True)  # type: ignore[arg-type]
            async with contextlib.aclosing(reader):
                async for record in reader:
                    position = record.position
                    out.append(((position.ledger_id, position.entry_id), record.payload))
                    start = LogPosition(position.ledger_id, position.entry_id + 1)
                    if record.payload == last:
                        return
        except BKError as error:
            errors.append(f"{type(error).__name__}: {error}")
            await asyncio.sleep(0.2)


async def _read_all(bk: BookKeeper, name: str, deadline: float) -> list[Record]:
    while True:
        try:
            reader = await open_log_reader(bk, name, start="earliest", password=PASSWORD)
            return [((r.position.ledger_id, r.position.entry_id), r.payload) async for r in reader]
        except BKError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _append_after_heal(bk: BookKeeper, name: str, history: LogHistory, deadline: float) -> bool:
    """Liveness: a new writer opens the log and appends ``final`` (retrying until ``deadline``)."""
    op = history.invoke("final", b"final")
    while True:
        try:
            writer = await open_log_writer(bk, name, password=PASSWORD)
            history.leader("final", writer.ledger_id)
            position = await writer.append(b"final")
            assert position is not None
            history.ok(op, position)
            await writer.close()
            return True
        except BKError as error:
            if op.outcome is not None or time.monotonic() > deadline:
                if op.outcome is None:
                    history.failed(op, error)
                return op.outcome is not None
            await asyncio.sleep(0.2)


class LogFight:
    """Log writer processes fighting for one log of ``cluster``, watched and tailed (module docstring).
    ``async with``: started on entry; `kill_writer` and `pause_writer` are nemeses (their ``cluster``
    argument aside); `stop` kills the writers (before the heal), `finish` checks after the heal."""

    def __init__(self, cluster: FaultCluster, tmp_path: Path, writers: int = WRITERS) -> None:
        self.cluster, self.tmp_path, self.count = cluster, tmp_path, writers
        self.seed = fault_seed()
        self.name = f"faults-{uuid.uuid4().hex[:8]}"
        self.history = LogHistory()
        self.manager = LogManager(cluster.meta.store, cluster.root)
        self.writers: list[LogWriterProc] = []
        self._started: list[LogWriterProc] = []  # every incarnation: `stop` kills them all
        self.files: list[Path] = []
        self._incarnations = [0] * writers
        self._tail: list[Record] = []
        self._tail_errors: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stack = contextlib.AsyncExitStack()
        self.bk: BookKeeper | None = None

    async def __aenter__(self) -> LogFight:
        os.makedirs(self.tmp_path, exist_ok=True)
        await self.manager.create(self.name)
        self._tasks.append(asyncio.create_task(_watch(self.manager, self.name, self.history)))
        self.bk = await self._stack.enter_async_context(BookKeeper.connect(self.cluster.url, config=CONFIG))
        self._tasks.append(
            asyncio.create_task(_tail(self.bk, self.name, self._tail, FINAL, self._tail_errors))
        )
        self.writers = list(await asyncio.gather(*(self._start_writer(i) for i in range(self.count))))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Whatever happened: no writer process and no task left behind (the package's shared
        cluster runs later tests on the same event loop)."""
        await self.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._stack.aclose()

    async def _start_writer(self, index: int) -> LogWriterProc:
        self._incarnations[index] += 1
        path = self.tmp_path / f"lw{index}.{self._incarnations[index]}.jsonl"
        self.files.append(path)
        writer = await LogWriterProc.start(
            self.cluster.url, self.name, path, self.seed * 100 + len(self.files)
        )
        self._started.append(writer)
        return writer

    async def kill_writer(self, _cluster: FaultCluster, rng: random.Random) -> None:
        """Nemesis: SIGKILL a log writer process, then start a new incarnation of it."""
        index = rng.randrange(len(self.writers))
        await self.writers[index].kill()
        await asyncio.sleep(rng.uniform(0.05, 0.3))
        self.writers[index] = await self._start_writer(index)

    async def pause_writer(self, _cluster: FaultCluster, rng: random.Random) -> None:
        """Nemesis: SIGSTOP a log writer process for a while (the others take the log over), SIGCONT."""
        writer = rng.choice(self.writers)
        writer.signal(signal.SIGSTOP)
        await asyncio.sleep(rng.uniform(*PAUSE_S))
        writer.signal(signal.SIGCONT)

    async def stop(self) -> None:
        """SIGKILL every writer process: acks not yet recorded count as indeterminate. Every
        incarnation, not only the current ones: two kill cycles in parallel lanes may replace the
        same writer twice."""
        for writer in self._started:
            await writer.kill()

    async def finish(self, scenario: str, cycles: int) -> list[str]:
        """After the heal: liveness, read back, check; the figures recorded; the problems found (the
        history kept in ``tmp_path`` when there are some)."""
        assert self.bk is not None
        await self.stop()
        history, bk = self.history, self.bk
        deadline = time.monotonic() + LIVENESS_S
        history.writable_after_heal = await _append_after_heal(bk, self.name, history, deadline)
        follower = self._tasks[1]
        if history.writable_after_heal:  # else the check says so
            try:
                await asyncio.wait_for(asyncio.shield(follower), max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                pytest.fail(
                    f"{scenario}: the tailing reader never reached the final append "
                    f"(its last errors: {self._tail_errors[-3:]})"
                )
        history.tailed(self._tail)
        async with BookKeeper.connect(self.cluster.url, config=READBACK_CONFIG) as other:
            for client in (bk, other):
                history.read_back(await _read_all(client, self.name, deadline))
        final = await self.manager.read(self.name)
        for ledger_id in final.metadata.ledger_ids:
            md = (await bk.context.ledgers.read(ledger_id)).metadata
            history.ledger_end(ledger_id, md.last_entry_id if md.is_closed else None)
        caught_up = time.monotonic() + WATCH_CATCH_UP_S
        while not history.versions or history.versions[-1][0] < final.version:
            assert time.monotonic() < caught_up, "the metadata watch never saw the final list"
            await asyncio.sleep(0.05)
        for path in self.files:
            load_log_writer_history(path, history)
        problems = history.check()
        row = figures.record(scenario, history, cycles=cycles, seed=self.seed)
        if problems:
            history.dump(self.tmp_path / "history.jsonl")
            return [
                f"{scenario}: {len(problems)} violations (seed {self.seed}; history and writer files kept in "
                f"{self.tmp_path}, data dirs and logs in {self.cluster.base}):",
                *problems,
            ]
        assert row["ok"] > 1, row  # appends went through
        assert row["takeovers"] > self.count, row  # and the leadership moved
        return []
