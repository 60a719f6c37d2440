"""Spark's driver-side commit and abort, on fake bookies and MemoryStore (no Spark session: the
methods are called directly, each on a writer object of its own, as Spark runs ``commit`` and
``abort`` in Python workers of their own, the streaming ones on a writer created anew)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest

from bookkeeper_aio import BookKeeper, describe_log, open_log_writer
from bookkeeper_aio.log import _common as common_module
from bookkeeper_aio.log import admin as admin_module
from bookkeeper_aio.spark import stream_writer
from bookkeeper_aio.spark import writer as spark_writer
from bookkeeper_aio.spark.writer import LedgerWritten, WriteSpec
from metadata.errors import CasResultUnknown
from tests.unit.log.fakes import world
from tests.unit.log.test_cas_landing_late import _LandsLate


@dataclasses.dataclass
class _Setup:
    bk: BookKeeper
    manager: _LandsLate
    spec: WriteSpec


@contextlib.asynccontextmanager
async def _log_losing_the_commit(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[_Setup]:
    """Log "out" with one ledger; the driver-side calls run on this loop against the world's
    client; the CAS that lists ledgers is held (its answer lost) and the list then stays
    unreadable long enough for `append_ledgers` to give up settling it (`CasResultUnknown`)."""
    monkeypatch.setattr(common_module, "SETTLE_RETRY_S", 0.001)
    async with world(clients=1) as w:
        (bk,) = w.clients
        writer = await open_log_writer(bk, "out")
        await writer.append(b"a")
        await writer.close()
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(
            spark_writer.runtime, "run", lambda make: asyncio.run_coroutine_threadsafe(make(), loop).result()
        )

        @contextlib.asynccontextmanager
        async def connect(url: str, *, probe: bool = True) -> AsyncIterator[BookKeeper]:
            yield bk

        monkeypatch.setattr(spark_writer, "connect", connect)
        manager = _LandsLate(w.store, unreadable=1 + common_module.SETTLE_ATTEMPTS_MAX)
        monkeypatch.setattr(admin_module, "log_manager", lambda _bk: manager)
        spec = WriteSpec("unused", "out", b"", "payload", 3, 2, 2, "job-1", writer.ledger_id)
        yield _Setup(bk, manager, spec)


async def _task_ledger(setup: _Setup, attempt: int = 0) -> LedgerWritten:
    """What a write task leaves: a closed ledger tagged with the job and the log."""
    handle = await spark_writer._create(setup.bk, setup.spec)
    await handle.append(b"row")
    await handle.close()
    return LedgerWritten(handle.id, 1, 3, attempt)


async def _listed(bk: BookKeeper) -> list[int]:
    return [ledger.ledger_id for ledger in (await describe_log(bk, "out")).ledgers]


def _batch_writer(spec: WriteSpec) -> spark_writer.BookKeeperBatchWriter:
    """The writer as a commit or abort worker unpickles it: the planner's spec, a new object."""
    made = spark_writer.BookKeeperBatchWriter.__new__(spark_writer.BookKeeperBatchWriter)
    made.spec = spec
    return made


def _stream_writer(spec: WriteSpec) -> stream_writer.BookKeeperStreamWriter:
    """The writer as a commit or abort worker creates it: a new job id (`parse_write_spec`)."""
    made = stream_writer.BookKeeperStreamWriter.__new__(stream_writer.BookKeeperStreamWriter)
    made.spec = dataclasses.replace(spec, job_id=f"job-of-{id(made)}")
    made.writer_id = None
    return made


async def test_a_batch_jobs_abort_after_an_unknown_commit_leaves_the_ledgers_the_late_cas_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Spark calls ``abort(messages)`` when ``commit`` raises. After `CasResultUnknown` the commit's
    CAS may still land: deleting its ledgers then would leave the log listing deleted ledgers
    (rows lost). A leftover of a killed attempt (tagged, in no message) is still deleted."""
    async with _log_losing_the_commit(monkeypatch) as setup:
        leftover = (await _task_ledger(setup)).ledger_id  # an earlier attempt's, its worker killed
        written = await _task_ledger(setup, attempt=1)
        setup.manager.armed = lambda md: written.ledger_id in md.ledger_ids
        with pytest.raises(CasResultUnknown):
            await asyncio.to_thread(_batch_writer(setup.spec).commit, [written])
        await asyncio.to_thread(_batch_writer(setup.spec).abort, [written])
        assert await setup.bk.context.ledgers.exists(written.ledger_id)
        assert not await setup.bk.context.ledgers.exists(leftover)
        assert await setup.manager.land()
        assert written.ledger_id in await _listed(setup.bk)


async def test_a_streaming_batchs_abort_after_an_unknown_commit_leaves_the_ledgers_the_late_cas_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _log_losing_the_commit(monkeypatch) as setup:
        written = await _task_ledger(setup)
        message = stream_writer.BatchLedgerWritten(written, "spark-query-q", "q")
        setup.manager.armed = lambda md: written.ledger_id in md.ledger_ids
        with pytest.raises(CasResultUnknown):
            await asyncio.to_thread(_stream_writer(setup.spec).commit, [message], 0)
        await asyncio.to_thread(_stream_writer(setup.spec).abort, [message], 0)
        assert await setup.bk.context.ledgers.exists(written.ledger_id)
        assert await setup.manager.land()
        assert written.ledger_id in await _listed(setup.bk)


@pytest.mark.parametrize("kind", ["batch", "stream"])
async def test_an_abort_after_a_failed_task_still_deletes_the_finished_tasks_ledgers(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A failed task's message is None: no commit ran, and nothing else deletes the ledgers of the
    tasks that finished."""
    async with _log_losing_the_commit(monkeypatch) as setup:
        written = await _task_ledger(setup)
        if kind == "batch":
            await asyncio.to_thread(_batch_writer(setup.spec).abort, [written, None])
        else:
            message = stream_writer.BatchLedgerWritten(written, "spark-query-q", "q")
            await asyncio.to_thread(_stream_writer(setup.spec).abort, [message, None], 0)
        assert not await setup.bk.context.ledgers.exists(written.ledger_id)
        assert written.ledger_id not in await _listed(setup.bk)


async def test_a_streaming_commit_of_a_retried_task_deletes_the_leftover_of_its_killed_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The commit runs on a writer created anew (another job id): it looks for leftovers with the
    job id the tasks wrote with, which their messages carry, else it never finds one."""
    async with _log_losing_the_commit(monkeypatch) as setup:
        leftover = (await _task_ledger(setup)).ledger_id  # attempt 0, its worker killed
        written = await _task_ledger(setup, attempt=1)
        job = (setup.spec.job_id, setup.spec.floor_ledger_id)
        message = stream_writer.BatchLedgerWritten(written, "spark-query-q", "q", job)
        await asyncio.to_thread(_stream_writer(setup.spec).commit, [message], 0)
        assert written.ledger_id in await _listed(setup.bk)
        assert not await setup.bk.context.ledgers.exists(leftover)
