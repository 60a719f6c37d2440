"""Batch writes: one ledger per task, all of a job's ledgers into the log in one CAS, or none.

Each task creates a ledger (id above the log's last ledger at that moment, ``after_ledger_id``)
when its first row arrives, appends its rows' payloads in order, closes the ledger and returns its
id in the commit message. A task whose code fails deletes its ledger before failing; one whose
Python worker Spark kills (an upstream failure in the same task, a cancelled job) cannot, so the
driver looks for the job's unlisted ledgers (tagged with the job id) on abort, and on commit when
a task ran more than once. The driver's ``commit`` appends every task's ledger to the log with
one ``append_ledgers`` (a CAS on the log's list: readers see all of the job's rows or none);
a ``commit`` whose CAS did not happen deletes them, and so does ``abort`` after a failed task. A
ledger the log lists is never deleted: after an error whose outcome is not known (the metadata
store did not answer), the log's list is read back first, and a commit whose CAS stays unsettled
(`CasResultUnknown`: it may list them yet) leaves them all; Spark's ``abort`` after a failed
commit leaves the commit's ledgers as the commit left them (`after_commit`).

Order: each task's rows stay in order in its ledger; a job's ledgers go into the log in ledger id
order, which is the order the tasks created them (when each got its first row), not partition order:
a DataFrame's ``orderBy`` holds within each task's ledger only.

A task learns only its own attempt number (PySpark's ``TaskContext`` has no stage attempt number):
a task of an abandoned stage attempt (a stage retried after a fetch failure) whose worker was killed
leaves its ledger unless the job aborts (docs/spark.md "Known limits").
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import structlog
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from bookkeeper_aio import (
    BKError,
    BookKeeper,
    CasResultUnknown,
    LedgerHandle,
    NoSuchLedger,
    NoSuchLog,
    Unauthorized,
    append_ledgers,
    describe_log,
)
from bookkeeper_aio.log import LEDGER_LOG_KEY
from bookkeeper_aio.spark import options as opt
from bookkeeper_aio.spark import runtime
from bookkeeper_aio.spark.catalog import connect

if TYPE_CHECKING:
    from pyarrow import RecordBatch

log = structlog.get_logger("bookkeeper_aio.spark.writer")

JOB_METADATA_KEY = "bookkeeper-aio.spark.job"
"""Custom metadata on every ledger a write task creates: the job's id (finds a ledger a killed
executor left behind: it is in no log's list)."""

ENSEMBLE_DEFAULT, WRITE_QUORUM_DEFAULT, ACK_QUORUM_DEFAULT = 3, 2, 2


@dataclass(frozen=True, slots=True)
class WriteSpec:
    """What a write task needs (plain data: pickled to the executors)."""

    metadata: str
    log: str
    password: bytes = field(repr=False)  # logs and tracebacks print the repr
    payload_column: str
    ensemble: int
    write_quorum: int
    ack_quorum: int
    job_id: str
    floor_ledger_id: int = 0
    """The log's last ledger when the job started: every ledger of the job has a larger id."""


@dataclass(frozen=True, slots=True)
class LedgerWritten(WriterCommitMessage):
    """A task's result: its closed ledger (None: the task had no rows) and what it holds;
    ``attempt`` > 0 when Spark ran the task before (an earlier attempt may have left a ledger)."""

    ledger_id: int | None
    entries: int
    payload_bytes: int
    attempt: int = 0


def parse_write_spec(
    options: Mapping[str, str], schema: StructType, allowed: frozenset[str], mode: str
) -> WriteSpec:
    opt.check_known(options, allowed, mode)
    source = opt.parse_source(options, allow_ledgers=False)
    assert source.log is not None
    column = opt.get(options, opt.PAYLOAD_COLUMN) or "payload"
    check_payload_column(schema, column)
    sizes = [
        opt.parse_positive_int(options, name, default)
        for name, default in (
            (opt.ENSEMBLE, ENSEMBLE_DEFAULT),
            (opt.WRITE_QUORUM, WRITE_QUORUM_DEFAULT),
            (opt.ACK_QUORUM, ACK_QUORUM_DEFAULT),
        )
    ]
    ensemble, write_quorum, ack_quorum = (size for size in sizes if size is not None)
    if not ensemble >= write_quorum >= ack_quorum:
        raise opt.SparkOptionError(
            opt.WRITE_QUORUM,
            f"need ensemble >= writeQuorum >= ackQuorum, got {ensemble} >= {write_quorum} >= {ack_quorum}",
        )
    return WriteSpec(
        metadata=source.metadata,
        log=source.log,
        password=source.password,
        payload_column=column,
        ensemble=ensemble,
        write_quorum=write_quorum,
        ack_quorum=ack_quorum,
        job_id=uuid.uuid4().hex,
    )


def check_payload_column(schema: StructType, column: str) -> None:
    names = schema.fieldNames()
    if column not in names:
        raise opt.SparkColumnError(
            column,
            f"the DataFrame has no column {column!r} (its columns: {names}); name the payload column "
            'with .option("payloadColumn", ...) or select one as "payload"',
        )
    data_type = schema[column].dataType
    if not isinstance(data_type, BinaryType | StringType):
        raise opt.SparkColumnError(
            column,
            f"must be BINARY or STRING (UTF-8 encoded), got {data_type.simpleString()}; "
            f"cast or encode it, e.g. to_json(...) or col({column!r}).cast('binary')",
        )


class BookKeeperBatchWriter(DataSourceArrowWriter):
    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise opt.SparkOptionError(
                "mode", "a log is append-only: use .mode('append') (overwrite would drop its history)"
            )
        spec = parse_write_spec(options, schema, opt.WRITE_OPTIONS, "batch write")
        self.spec = runtime.run(lambda: with_floor(spec))

    def write(self, iterator: Iterator[RecordBatch]) -> LedgerWritten:
        return runtime.run(lambda: write_task(self.spec, iterator))

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        retried = any(isinstance(m, LedgerWritten) and m.attempt > 0 for m in messages)
        runtime.run(lambda: commit_ledgers(self.spec, _written(messages), None, sweep=retried))

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        committed = after_commit(messages)
        runtime.run(lambda: abort_job(self.spec, _written(messages), after_commit=committed))


def _written(messages: Sequence[WriterCommitMessage | None]) -> list[int]:
    return sorted(m.ledger_id for m in messages if isinstance(m, LedgerWritten) and m.ledger_id is not None)


def after_commit(messages: Sequence[WriterCommitMessage | None]) -> bool:
    """Whether an ``abort(messages)`` follows a commit of them: every task's message is there (a
    failed task's is None), so every task finished and Spark called ``commit``, which raised. That
    commit decided about those ledgers already (it deleted the ones the log does not list, or left
    them all when its CAS's outcome is unknown: `CasResultUnknown`, the CAS may list them yet), so
    the abort must not delete them. Spark runs ``commit`` and ``abort`` each in a Python worker of
    its own, on a writer unpickled (batch) or created (streaming) anew: the messages are all that
    abort learns of the commit."""
    return all(m is not None for m in messages)


async def write_task(spec: WriteSpec, batches: Iterator[RecordBatch]) -> LedgerWritten:
    """Append the payloads of ``batches`` to a new ledger and close it; delete it on failure.

    The rows come from the JVM through a blocking iterator, so every append of a batch is
    acknowledged before the next batch is pulled: the event loop never sits blocked while adds
    are in flight (their timeouts would fire before their answers were read)."""
    context = TaskContext.get()
    attempt = context.attemptNumber() if context is not None else 0
    async with connect(spec.metadata, probe=False) as bk:
        handle: LedgerHandle | None = None
        entries = payload_bytes = 0
        try:
            for batch in batches:
                payloads = _payloads(batch, spec.payload_column)
                if not payloads:
                    continue
                if handle is None:
                    handle = await _create(bk, spec)
                futures = [await handle.append_async(payload) for payload in payloads]
                await asyncio.gather(*futures)
                entries += len(payloads)
                payload_bytes += sum(len(payload) for payload in payloads)
            if handle is None:
                return LedgerWritten(None, 0, 0, attempt)
            await handle.close()
        except BaseException:
            if handle is not None:
                await _delete_quietly(bk, handle.id, spec.password)
            raise
        log.info("spark.ledger_written", log=spec.log, ledger_id=handle.id, entries=entries, job=spec.job_id)
        return LedgerWritten(handle.id, entries, payload_bytes, attempt)


async def _create(bk: BookKeeper, spec: WriteSpec) -> LedgerHandle:
    after = await last_ledger_id(bk, spec.log)
    return await bk.create_ledger(
        spec.ensemble,
        spec.write_quorum,
        spec.ack_quorum,
        password=spec.password,
        custom_metadata={JOB_METADATA_KEY: spec.job_id.encode(), LEDGER_LOG_KEY: spec.log.encode()},
        after_ledger_id=after,
    )


async def last_ledger_id(bk: BookKeeper, name: str) -> int:
    """The id new ledgers for the log must be above (0 for a log that does not exist yet)."""
    try:
        info = await describe_log(bk, name)
    except NoSuchLog:
        return 0
    if info.ledgers:
        return info.ledgers[-1].ledger_id
    return max(0, info.truncated_before - 1)


def _payloads(batch: RecordBatch, column: str) -> list[bytes]:
    array: Any = batch.column(batch.schema.get_field_index(column))
    if array.null_count:
        row = next(i for i, value in enumerate(array.is_valid().to_pylist()) if not value)
        raise opt.SparkColumnError(column, f"a null payload (row {row} of a batch): filter or fill the nulls")
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        return [value.encode() for value in array.to_pylist()]
    payloads: list[bytes] = array.to_pylist()
    return payloads


async def commit_ledgers(
    spec: WriteSpec,
    ledger_ids: list[int],
    token: tuple[str, int] | None,
    *,
    sweep: bool = False,
    tag: str | None = None,
) -> bool:
    """Append the ledgers to the log in one CAS (with ``token``: exactly once per token; ``tag``:
    what produced the batch, the token's tag, `append_ledgers`'s ``commit_tag``). False: a
    replay of an already committed token (its ledgers are deleted). On a failure the ledgers the
    log does not list are deleted and the error is raised, but for an unknown outcome
    (`CasResultUnknown`: the CAS may list them yet), which leaves them to a later sweep.
    ``sweep`` (some task ran more than once): afterwards, delete the job's ledgers the log does
    not list, which failed attempts whose Python worker Spark killed before it could delete them
    left behind."""
    if not ledger_ids and token is None:
        return True
    async with connect(spec.metadata) as bk:
        return await commit_with(bk, spec, ledger_ids, token, sweep=sweep, tag=tag)


async def commit_with(
    bk: BookKeeper,
    spec: WriteSpec,
    ledger_ids: list[int],
    token: tuple[str, int] | None,
    *,
    sweep: bool,
    tag: str | None = None,
) -> bool:
    """`commit_ledgers` with the client ``bk``. Once the CAS applied the job is committed whatever
    happens next: the sweep is best effort (a failure is logged; the leftovers keep their job tag)."""
    try:
        appended = await append_ledgers(
            bk, spec.log, ledger_ids, password=spec.password, commit=token, commit_tag=tag
        )
    except CasResultUnknown:
        # the CAS may yet list them: they stay (tagged with the job id) for a later sweep
        raise
    except BaseException:
        await _discard_unlisted(bk, spec, ledger_ids)
        raise
    if not appended:
        log.info("spark.commit_replayed", log=spec.log, token=token, ledgers=ledger_ids)
        await _discard_unlisted(bk, spec, ledger_ids)
        return False
    log.info("spark.committed", log=spec.log, token=token, ledgers=ledger_ids, job=spec.job_id)
    if sweep:
        try:
            await _discard_unlisted(bk, spec, await _ledgers_of_job(bk, spec))
        except BKError as error:
            log.warning("spark.sweep_failed", log=spec.log, job=spec.job_id, error=repr(error))
    return True


async def discard_unlisted(spec: WriteSpec, ledger_ids: list[int]) -> None:
    async with connect(spec.metadata) as bk:
        await _discard_unlisted(bk, spec, ledger_ids)


async def with_floor(spec: WriteSpec) -> WriteSpec:
    """``spec`` with the log's last ledger id now (also checks the metadata URL on the driver)."""
    async with connect(spec.metadata) as bk:
        return dataclasses.replace(spec, floor_ledger_id=await last_ledger_id(bk, spec.log))


async def abort_job(spec: WriteSpec, ledger_ids: list[int], *, after_commit: bool = False) -> None:
    """Delete the ledgers of finished tasks, then look for those of tasks Spark killed when the job
    failed (a killed task's Python worker gets SIGKILL: it cannot delete its own): ledgers above
    the job's floor whose custom metadata carries the job's id, and which the log does not list.
    With ``after_commit`` (the abort of a failed commit of ``ledger_ids``) those ledgers are left
    as that commit left them (its CAS may still list them); only the other leftovers go."""
    async with connect(spec.metadata) as bk:
        if after_commit:
            kept = set(ledger_ids)
        else:
            await _discard_unlisted(bk, spec, ledger_ids)
            kept = set()
        await _discard_unlisted(bk, spec, [i for i in await _ledgers_of_job(bk, spec) if i not in kept])


async def _ledgers_of_job(bk: BookKeeper, spec: WriteSpec) -> list[int]:
    found: list[int] = []
    async for ledger_id in bk.list_ledgers():
        if ledger_id <= spec.floor_ledger_id:
            continue
        try:
            handle = await bk.open_ledger(ledger_id, password=spec.password)
        except (NoSuchLedger, Unauthorized):  # deleted meanwhile; another password: not ours
            continue
        except BKError as error:
            log.warning("spark.abort_scan_skipped", ledger_id=ledger_id, error=repr(error))
            continue
        if handle.metadata.custom_metadata.get(JOB_METADATA_KEY) == spec.job_id.encode():
            found.append(ledger_id)
    return found


async def _discard_unlisted(bk: BookKeeper, spec: WriteSpec, ledger_ids: list[int]) -> None:
    """Delete those of ``ledger_ids`` the log does not list (never a listed one: if the list cannot
    be read, nothing is deleted and the ledgers stay as orphans, tagged with the job id)."""
    if not ledger_ids:
        return
    try:
        info = await describe_log(bk, spec.log)
        listed = {ledger.ledger_id for ledger in info.ledgers}
    except NoSuchLog:
        listed = set()
    except BKError as error:
        log.warning("spark.discard_skipped", log=spec.log, ledgers=ledger_ids, error=repr(error))
        return
    for ledger_id in ledger_ids:
        if ledger_id not in listed:
            await _delete_quietly(bk, ledger_id, spec.password)


async def _delete_quietly(bk: BookKeeper, ledger_id: int, password: bytes) -> None:
    try:
        await bk.delete_ledger(ledger_id, password=password)
    except NoSuchLedger:
        pass
    except BKError as error:  # the original failure matters more; the orphan keeps its job tag
        log.warning("spark.delete_failed", ledger_id=ledger_id, error=repr(error))
