"""Streaming writes, exactly once: a micro-batch's ledgers and its (writer id, batch id) token go
into the log in one CAS (``append_ledgers(..., commit=token)``).

Each task writes its rows to a ledger of its own, as a batch write does (``writer.write_task``).
The driver's ``commit(messages, batch_id)`` appends the batch's ledgers together with the token.
Spark replays a batch whose commit it did not record (the driver died after our CAS and before
its own commit log): the replay's tasks write new ledgers, and ``append_ledgers`` sees the token
already committed, changes nothing and returns False; the replay's ledgers are then deleted. So
every row is in the log once, where the Kafka and Pulsar sinks would hold it twice.

The writer id is the ``writerId`` option, else ``spark-query-<id>`` from the streaming query's
id, which Spark keeps in the checkpoint (stable across restarts; a new checkpoint is a new query,
with batch ids from 0 again). Two queries writing one log need distinct writer ids: a batch id
below the one its writer id already committed is refused (``SparkOptionError`` naming ``writerId``),
never dropped as a replay. So is an equal batch id from another query: with an explicit
``writerId`` the token is committed with the query id as its tag (``append_ledgers(...,
commit_tag=...)``), and only the same query's batch is a replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from bookkeeper_aio import CommitTokenReused
from bookkeeper_aio.spark import options as opt
from bookkeeper_aio.spark import runtime
from bookkeeper_aio.spark.writer import (
    LedgerWritten,
    WriteSpec,
    after_commit,
    commit_ledgers,
    discard_unlisted,
    parse_write_spec,
    with_floor,
    write_task,
)

if TYPE_CHECKING:
    from pyarrow import RecordBatch

QUERY_ID_PROPERTY = "sql.streaming.queryId"
"""The task-local property in which Spark's stream execution passes the query's id."""


@dataclass(frozen=True, slots=True)
class BatchLedgerWritten(WriterCommitMessage):
    written: LedgerWritten
    writer_id: str
    query_id: str | None = None
    """The streaming query's id (Spark's task-local property), the token's tag; None: not known."""
    job: tuple[str, int] | None = None
    """The task's writer's job id (the tag on its ledger) and floor. Spark runs the driver's
    ``commit`` on a writer created anew, with a job id of its own: its look for leftovers takes
    the tasks' from here. None: not known."""


class BookKeeperStreamWriter(DataSourceStreamArrowWriter):
    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool) -> None:
        if overwrite:
            raise opt.SparkOptionError("outputMode", "a log is append-only: use outputMode('append')")
        spec = parse_write_spec(options, schema, opt.STREAM_WRITE_OPTIONS, "streaming write")
        self.spec = runtime.run(lambda: with_floor(spec))
        self.writer_id = opt.get(options, opt.WRITER_ID) or None

    def write(self, iterator: Iterator[RecordBatch]) -> BatchLedgerWritten:
        query_id = _query_id()
        if self.writer_id is not None:
            writer_id = self.writer_id
        elif query_id is not None:
            writer_id = f"spark-query-{query_id}"
        else:
            raise opt.SparkOptionError(
                opt.WRITER_ID,
                "the streaming query's id is not known to the task: set a writerId for the query",
            )
        written = runtime.run(lambda: write_task(self.spec, iterator))
        return BatchLedgerWritten(written, writer_id, query_id, (self.spec.job_id, self.spec.floor_ledger_id))

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        ledger_ids, writer_id, query_id = _batch(messages)
        if writer_id is None:
            return  # no task wrote anything
        retried = any(isinstance(m, BatchLedgerWritten) and m.written.attempt > 0 for m in messages)
        # The default writer id holds the query id already: a tag would only take room in the list.
        tag = None if writer_id == f"spark-query-{query_id}" else query_id
        spec = _tasks_spec(self.spec, messages)
        try:
            runtime.run(
                lambda: commit_ledgers(spec, ledger_ids, (writer_id, batchId), sweep=retried, tag=tag)
            )
        except CommitTokenReused as error:
            raise writer_id_reused(self.spec.log, error) from error

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:
        if after_commit(messages):
            return  # the batch's commit failed and already decided about its ledgers
        ledger_ids, _, _ = _batch(messages)
        runtime.run(lambda: discard_unlisted(self.spec, ledger_ids))


def writer_id_reused(log: str, error: CommitTokenReused) -> opt.SparkOptionError:
    """What to tell when this writer id already committed a batch id above this one, or this one
    from another query: the writer id is another query's (or this query's, started again from a new
    checkpoint, whose batch ids start at 0 again). Its rows would be dropped as a replay; the query
    stops instead."""
    if error.batch_id == error.committed:
        which = f"from another query ({error.committed_tag}), not as a batch of this one"
    else:
        which = f"above this batch {error.batch_id}"
    return opt.SparkOptionError(
        opt.WRITER_ID,
        f"writer id {error.importer!r} already committed batch {error.committed} into log {log!r}, "
        f"{which}: another query, or "
        "this one from a new checkpoint (batch ids start at 0 again), used this writerId. Nothing of "
        "this batch was written: give the query a new writerId (or leave it out: the default is per "
        "checkpoint), or restart it from the checkpoint that committed those batches",
    )


def _query_id() -> str | None:
    context = TaskContext.get()
    query_id = context.getLocalProperty(QUERY_ID_PROPERTY) if context is not None else None
    return query_id or None


def _tasks_spec(spec: WriteSpec, messages: Sequence[WriterCommitMessage | None]) -> WriteSpec:
    """``spec`` with the job id and floor the batch's tasks wrote with (when the messages tell one)."""
    jobs = {m.job for m in messages if isinstance(m, BatchLedgerWritten) and m.job is not None}
    if len(jobs) != 1:
        return spec
    ((job_id, floor),) = jobs
    return dataclasses.replace(spec, job_id=job_id, floor_ledger_id=floor)


def _batch(messages: Sequence[WriterCommitMessage | None]) -> tuple[list[int], str | None, str | None]:
    """The batch's ledger ids, its writer id (None: no task wrote a row) and its query id."""
    done = [m for m in messages if isinstance(m, BatchLedgerWritten)]
    ids = sorted(m.written.ledger_id for m in done if m.written.ledger_id is not None)
    writer_ids = {m.writer_id for m in done}
    query_ids = {m.query_id for m in done}
    assert len(writer_ids) <= 1, writer_ids
    assert len(query_ids) <= 1, query_ids
    return ids, (writer_ids.pop() if writer_ids and ids else None), (query_ids.pop() if query_ids else None)
