"""Writers as OS processes killed with SIGKILL; their ledgers taken over by racing recoverer processes.

Each round starts writer processes (tests/faults/procs.py), one ledger each, appending unique values
and recording their history to a file (``ok`` only once acked). Then, per writer, one of:

- ``kill``: SIGKILL the writer mid-stream, then 1-3 recoverer processes race to recover its ledger;
- ``live``: 1-3 recoverer processes race to recover the ledger while its writer still appends
  (the fence must stop it), then the writer gets SIGKILL.

The writers' files are merged into one history with each recoverer's last entry; every ledger is then
recovered again and read back by three in-process clients (tests/faults/cluster.py). Checks (besides
the history's usual ones): no acked append lost, all recoverers report the same last entry, no ack
above the closed last entry (the ``live`` writer's acks after the fence would be).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from pathlib import Path

import pytest

from tests.faults import figures
from tests.faults.cluster import FaultCluster, fault_cycles, fault_seed, recover_and_read
from tests.faults.conftest import ON_SHARED
from tests.faults.history import History
from tests.faults.procs import load_writer_history, spawn

pytestmark = pytest.mark.etcd

START_TIMEOUT_S = 30.0
ACKED_TIMEOUT_S = 30.0
RECOVER_TIMEOUT_S = 90.0


def _acked(path: Path) -> int:
    try:
        return path.read_text().count('"ok"')
    except FileNotFoundError:
        return 0


class Writer:
    def __init__(self, proc: asyncio.subprocess.Process, path: Path, ledger_id: int) -> None:
        self.proc, self.path, self.ledger_id = proc, path, ledger_id

    @classmethod
    async def start(cls, url: str, path: Path, shape: tuple[int, int, int]) -> Writer:
        shape_arg = ",".join(map(str, shape))
        proc = await spawn(path.with_suffix(".log"), "writer", url, str(path), "--shape", shape_arg)
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            raise
        assert line, f"writer exited with {await proc.wait()} before creating a ledger"
        return cls(proc, path, json.loads(line)["ledger"])

    async def wait_acked(self, count: int) -> None:
        deadline = time.monotonic() + ACKED_TIMEOUT_S
        while await asyncio.to_thread(_acked, self.path) < count:
            assert self.proc.returncode is None, f"writer exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, f"writer acked fewer than {count} in {ACKED_TIMEOUT_S} s"
            await asyncio.sleep(0.05)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        assert await self.proc.wait() == -signal.SIGKILL


async def _recoverers(url: str, ledger_id: int, count: int, log: Path) -> list[int]:
    """``count`` recoverer processes started at once on ``ledger_id``; the last entry each reports."""
    procs = [await spawn(log, "recover", url, str(ledger_id)) for _ in range(count)]
    try:
        outputs = await asyncio.wait_for(
            asyncio.gather(*(proc.communicate() for proc in procs)), RECOVER_TIMEOUT_S
        )
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
    lasts = []
    for proc, (out, _) in zip(procs, outputs, strict=True):
        result = json.loads(out.decode().strip().splitlines()[-1])
        assert proc.returncode == 0, f"recoverer of {ledger_id}: {result}"
        lasts.append(result["last"])
    return lasts


async def _round(
    cluster: FaultCluster, history: History, rng: random.Random, base: Path, number: int
) -> list[int]:
    """One round: two writer processes (E3/Qw2/Qa2 and E3/Qw3/Qa2), one taken over ``kill``, the
    other ``live`` (which one by ``rng``), each raced for by 1-3 recoverers; returns the ledgers."""
    shapes = [(3, 2, 2), (3, 3, 2)]
    writers = await asyncio.gather(
        *(Writer.start(cluster.url, base / f"r{number}w{i}.jsonl", shape) for i, shape in enumerate(shapes))
    )

    modes = rng.sample(["kill", "live"], 2)  # both ways every round, in a seeded order

    async def take_over(writer: Writer, mode: str) -> None:
        await writer.wait_acked(rng.randint(20, 200))
        racers = rng.randint(1, 3)
        if mode == "kill":
            await writer.kill()
            lasts = await _recoverers(cluster.url, writer.ledger_id, racers, base / "recoverers.log")
        else:
            lasts = await _recoverers(cluster.url, writer.ledger_id, racers, base / "recoverers.log")
            await asyncio.sleep(0.5)  # the writer runs on against the fence
            await writer.kill()
        for last in lasts:
            history.recovered_at(writer.ledger_id, last)

    try:
        await asyncio.gather(*(take_over(writer, mode) for writer, mode in zip(writers, modes, strict=True)))
    finally:
        for writer in writers:
            if writer.proc.returncode is None:
                writer.proc.kill()
                await writer.proc.wait()
    for writer in writers:
        assert load_writer_history(writer.path, history) == writer.ledger_id
    return [writer.ledger_id for writer in writers]


async def _run(cluster: FaultCluster, rounds: int, tmp_path: Path) -> History:
    seed = fault_seed()
    rng = random.Random(seed)
    history = History()
    ledgers: list[int] = []
    for number in range(rounds):
        ledgers += await _round(cluster, history, rng, tmp_path, number)
    await recover_and_read(cluster, history, ledgers)
    problems = history.check()
    row = figures.record("writer kill -9 + racing recoverers", history, cycles=rounds, seed=seed)
    if problems:
        history.dump(tmp_path / "history.jsonl")
        pytest.fail(
            f"{len(problems)} violations (seed {seed}; files kept in {tmp_path}, data dirs and logs in "
            f"{cluster.base}; replay: FAULT_SEED={seed}):\n" + "\n".join(problems)
        )
    assert row["ok"], row
    assert all(len(history.recovered[ledger_id]) >= 4 for ledger_id in ledgers)  # racers + 3 after
    return history


@ON_SHARED
async def test_writer_processes_killed_and_raced_for(shared: FaultCluster, tmp_path: Path) -> None:
    await _run(shared, fault_cycles(1), tmp_path)


@pytest.mark.slow
async def test_writer_processes_killed_and_raced_for_many_rounds(
    faults: FaultCluster, tmp_path: Path
) -> None:
    await faults.start(3)
    await _run(faults, fault_cycles(10), tmp_path)
