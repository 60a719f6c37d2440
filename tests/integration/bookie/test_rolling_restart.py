"""A rolling restart (docs/operations.md, *Upgrades*): five self-registering bookies restarted one at
a time with SIGTERM under a steady write load. The writer never fails (each departure is an
ensemble change onto a spare), every acked entry reads back identical, and the add latency during
the restarts is reported (p50 / p99 / max, printed with ``-s``)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from pathlib import Path

import pytest

import metadata
from bookkeeper_aio import BookKeeper, ClientConfig
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

from .test_gc import init_cluster

pytestmark = [pytest.mark.etcd, pytest.mark.slow]

RATE_PER_S = 500


async def _registered(url: str) -> set[str]:
    async with metadata.connect(url) as conn:
        return set((await metadata.list_bookies(conn.store, conn.root)).writable)


async def test_rolling_restart_under_write_load_never_fails_the_writer(
    etcd_server: EtcdCluster, tmp_path: Path
) -> None:
    url = etcd_server.url(f"/bookkeeper/roll-{uuid.uuid4().hex[:8]}")
    await init_cluster(url)
    procs = [
        BookieProcess(
            tmp_path / f"b{i}", f"b{i}", extra_args=["--metadata", url, "--registration-ttl-s", "3"]
        )
        for i in range(5)
    ]
    try:
        for proc in procs:
            proc.start()
        config = ClientConfig(add_timeout_s=2.0, read_timeout_s=5.0)
        async with BookKeeper.connect(url, config=config) as bk:
            handle = await bk.create_ledger(3, 2, 2, password=b"roll")
            latencies: list[float] = []
            acked: dict[int, bytes] = {}
            stop = asyncio.Event()

            async def write() -> None:
                n = 0
                pending: set[asyncio.Future[int]] = set()
                while not stop.is_set():
                    payload = f"value-{n}".encode()
                    sent = time.perf_counter()
                    future = await handle.append_async(payload)

                    def done(f: asyncio.Future[int], payload: bytes = payload, sent: float = sent) -> None:
                        pending.discard(f)
                        if not f.cancelled() and f.exception() is None:
                            latencies.append(time.perf_counter() - sent)
                            acked[f.result()] = payload

                    future.add_done_callback(done)
                    pending.add(future)
                    n += 1
                    await asyncio.sleep(1 / RATE_PER_S)
                await asyncio.gather(*pending)  # raises the first failed append

            started = time.perf_counter()
            writer = asyncio.create_task(write())
            await asyncio.sleep(1.0)
            for proc in procs:  # one at a time, as the guide says
                assert proc.stop() == 0
                proc.start()
                async with asyncio.timeout(30):
                    while proc.bookie_id not in await _registered(url):  # noqa: ASYNC110 (polls etcd)
                        await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)
                assert not writer.done(), writer
            stop.set()
            await writer  # the writer never failed
            elapsed = time.perf_counter() - started
            await handle.close()
            md = handle.metadata
            assert len(md.ensembles) >= 2  # the restarts moved it onto other bookies
            reader = await bk.open_ledger(handle.id, password=b"roll")
            read = {entry.entry_id: entry.payload async for entry in reader.read()}
            assert {i: read[i] for i in acked} == acked
            ordered = sorted(latencies)
            p50 = statistics.median(ordered) * 1e3
            p99 = ordered[int(0.99 * len(ordered))] * 1e3
            print(
                f"rolling restart of 5 bookies: {len(acked)} appends in {elapsed:.1f} s "
                f"({len(acked) / elapsed:.0f}/s, paced at up to {RATE_PER_S}/s), "
                f"{len(md.ensembles)} fragments; add latency p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
                f"max {ordered[-1] * 1e3:.1f} ms"
            )
    finally:
        for proc in procs:
            proc.cleanup()
