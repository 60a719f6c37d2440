"""One client process of ``bkaio bench``: ``python -m bookkeeper_aio.cli.bench.worker``.

Talks to its parent (:mod:`bookkeeper_aio.cli.bench.clients`) in lines: the spec as one JSON line
on stdin; ``BENCH created N`` on stdout about every 0.5 s while it creates ledgers; ``BENCH ready``
once its ledgers (or NATS publishers) exist and each has written one unmeasured entry (connections
up); then ``go START`` on stdin (a CLOCK_MONOTONIC instant shared by every client process);
``BENCH progress N`` about every 0.5 s; ``BENCH result {json}`` at the end (``BENCH error
MESSAGE`` instead on failure, exit code 1). Logs go to stderr, which the parent sends to a file in
the results folder.

Ledgers are created with the custom metadata ``bkaio-bench`` and closed and deleted at the end,
unless the spec's ``cleanup`` is false: the cluster is a private sandbox, removed after the run (a
million ledgers take as long to close and delete as to create).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import resource
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog
import uvloop

from bookkeeper_aio import LedgerCreateUnknown, MetadataUnavailable
from bookkeeper_aio.cli.bench.load import Span, Submit, SubmitNowait, drive
from bookkeeper_aio.client.bookkeeper import BookKeeper
from bookkeeper_aio.client.config import ClientConfig
from bookkeeper_aio.client.ledger import LedgerHandle
from bookkeeper_aio.common.logging_setup import configure_logging

log = structlog.get_logger(__name__)

PASSWORD = b"bkaio-bench"
BENCH_MARK = "bkaio-bench"


def say(kind: str, data: Any = "") -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    sys.stdout.write(f"BENCH {kind} {text}\n")
    sys.stdout.flush()


PROGRESS_INTERVAL_S = 0.5
"""``BENCH created N`` at most this often while the ledgers are made."""

CREATE_CONCURRENCY = 64
"""Ledgers created (and deleted) at a time: one by one, 100,000 ledgers took minutes."""

CREATE_ATTEMPTS = 5
CREATE_RETRY_S = 0.5
"""A create that failed for a passing reason (etcd slow to answer: nothing was created, or the
outcome is unknown and the client discards that ledger itself) is tried again after this many
seconds times its attempt: creating is not what is measured, and a million creates beside ten
loaded processes meet a few timeouts."""

GC_FREEZE_LEDGERS_MIN = 10_000
"""From this many ledgers the process moves what exists once they are made out of the cyclic
garbage collector's reach (``gc.freeze``), as the bookie does after loading its ledgers: each full
collection walks every tracked object, and the handles of 30,000 ledgers made the client's CPU per
entry 2.4x (docs/benchmarks.md, issue 19). An application holding that many ledgers open would do
the same (or tune ``gc.set_threshold``)."""


Targets = tuple[Sequence[Submit], Sequence[SubmitNowait] | None]
"""What a system under test offers the load loop: a submit per ledger, and their nowait forms."""


@contextlib.asynccontextmanager
async def bookkeeper_target(spec: dict[str, Any]) -> AsyncIterator[Targets]:
    """``spec["ledgers"]`` new ledgers on the cluster at ``spec["metadata_url"]``; closed and deleted
    after if ``spec["cleanup"]``, else left open (aborted) for the sandbox's removal. Appends go
    through ``append_nowait`` when there is room (:data:`~bookkeeper_aio.cli.bench.load.SubmitNowait`)."""
    config = ClientConfig.load(add_window_max=spec["window"])  # BKAIO_CLIENT_* still applies
    loop = asyncio.get_running_loop()
    payload = os.urandom(spec["size"])
    async with BookKeeper.connect(spec["metadata_url"], config=config) as bk:
        handles: list[LedgerHandle] = []

        async def create() -> None:
            for attempt in range(1, CREATE_ATTEMPTS + 1):
                try:
                    handle = await bk.create_ledger(
                        spec["ensemble"],
                        spec["write_quorum"],
                        spec["ack_quorum"],
                        password=PASSWORD,
                        custom_metadata={BENCH_MARK: spec["scenario"].encode()},
                    )
                    break
                except (MetadataUnavailable, LedgerCreateUnknown) as error:
                    if attempt == CREATE_ATTEMPTS:
                        raise
                    log.warning("bench.create_retried", attempt=attempt, error=str(error))
                    await asyncio.sleep(CREATE_RETRY_S * attempt)
            handles.append(handle)
            await handle.append(b"warm-up")  # connections up before the clock starts

        async def delete(handle: LedgerHandle) -> None:
            with contextlib.suppress(Exception):
                handle.abort()
            with contextlib.suppress(Exception):
                await bk.delete_ledger(handle.id, password=PASSWORD)

        try:
            shown = loop.time()
            for start in range(0, spec["ledgers"], CREATE_CONCURRENCY):
                batch = min(CREATE_CONCURRENCY, spec["ledgers"] - start)
                await asyncio.gather(*(create() for _ in range(batch)))
                if loop.time() - shown >= PROGRESS_INTERVAL_S:
                    shown = loop.time()
                    say("created", str(len(handles)))
            if len(handles) >= GC_FREEZE_LEDGERS_MIN:
                gc.freeze()
            yield (
                [functools.partial(handle.append_async, payload) for handle in handles],
                [functools.partial(handle.append_nowait, payload) for handle in handles],
            )
            if spec["cleanup"]:
                for start in range(0, len(handles), CREATE_CONCURRENCY):
                    await asyncio.gather(*(h.close() for h in handles[start : start + CREATE_CONCURRENCY]))
        finally:
            if spec["cleanup"]:
                for start in range(0, len(handles), CREATE_CONCURRENCY):
                    await asyncio.gather(*(delete(h) for h in handles[start : start + CREATE_CONCURRENCY]))
            else:
                for handle in handles:
                    handle.abort()


@contextlib.asynccontextmanager
async def nats_target(spec: dict[str, Any]) -> AsyncIterator[Targets]:
    """Publishers to the JetStream stream of :mod:`bookkeeper_aio.cli.bench.nats_peer`, one subject
    per "ledger"; each publish waits for the stream's acknowledgement (stored by R replicas)."""
    import nats  # the bench extra

    payload = os.urandom(spec["size"])
    nc = await nats.connect(spec["nats_servers"], pending_size=64 * 1024 * 1024)
    try:
        js = nc.jetstream(publish_async_max_pending=spec["window"])
        subjects = [f"{spec['nats_subject']}.{spec['index']}.{i}" for i in range(spec["ledgers"])]
        for subject in subjects:
            await js.publish(subject, b"warm-up")
        yield [functools.partial(js.publish_async, subject, payload) for subject in subjects], None
    finally:
        await nc.close()


async def run(spec: dict[str, Any]) -> int:
    target = nats_target if spec["system"] == "nats" else bookkeeper_target
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for signum in (signal.SIGINT, signal.SIGTERM):  # the parent stops us: clean up, then exit
        loop.add_signal_handler(signum, task.cancel)
    async with target(spec) as (submits, nowait):
        say("ready")
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line.startswith("go "):
            return 1  # the parent gave up (stdin closed)
        span = Span(float(line.split()[1]), spec["warmup_s"], spec["duration_s"], spec["interval_s"])
        result = await drive(
            submits,
            span,
            window=spec["window"],
            rate=spec["rate"],
            latency_from=spec.get("latency_from", "intended"),
            progress=lambda answered: say("progress", str(answered)),
            nowait=nowait,
        )
    # ru_maxrss is in KiB on Linux: the peak of this client process, window and ledgers included
    say(
        "result",
        {
            **result.to_json(),
            "rss_peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        },
    )
    return 0


def main() -> int:
    configure_logging(os.environ.get("BKAIO_BENCH_LOG_LEVEL", "warning"))
    spec = json.loads(sys.stdin.readline())
    try:
        return uvloop.run(run(spec))
    except asyncio.CancelledError:
        return 130
    except Exception as error:  # noqa: BLE001 (any failure is reported to the parent, which says where the log is)
        say("error", f"{type(error).__name__}: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
