"""Tailing log readers (``open_log_reader(..., follow=True)``) on real bookies and real etcd."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest

from bookkeeper_aio import BookKeeper, LogFenced, LogPosition, LogRecord, open_log_reader, open_log_writer
from metadata.log_manager import LogManager
from tests.integration.log.conftest import CONFIG, Cluster

pytestmark = pytest.mark.etcd

QUORUM = {"ensemble": 3, "write_quorum": 2, "ack_quorum": 2, "password": b"pw"}
WAIT_S = 5.0


class _Tailer:
    """Iterates a following reader in a task; tests wait on how many records arrived."""

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

    async def wait_for(self, count: int) -> list[LogRecord]:
        async with asyncio.timeout(WAIT_S):
            while len(self.records) < count:
                if self.task.done():
                    self.task.result()
                    raise AssertionError("the following reader ended")
                self._changed.clear()
                await self._changed.wait()
        return self.records

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def _follow(bk: BookKeeper, name: str, **kwargs: object) -> _Tailer:
    reader = await open_log_reader(bk, name, password=b"pw", follow=True, **kwargs)  # type: ignore[arg-type]
    return _Tailer(reader)


async def _read_all(bk: BookKeeper, name: str) -> list[LogRecord]:
    reader = await open_log_reader(bk, name, password=b"pw")
    return [record async for record in reader]


async def test_follows_appends_across_rolls_from_an_empty_log(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    await LogManager(cluster.meta.store, cluster.root).create("live")  # no ledger yet
    tailer = await _follow(bk, "live")
    writer = await open_log_writer(bk, "live", **QUORUM)  # type: ignore[arg-type]
    expected: list[tuple[LogPosition, bytes]] = []
    for chunk in range(4):  # 3 rolls
        for i in range(5):
            payload = f"r{chunk}-{i}".encode()
            expected.append((await writer.append(payload), payload))
        # every acked append arrives while the ledger is still open (LAC long polls)
        got = await tailer.wait_for(len(expected))
        assert [(r.position, r.payload) for r in got] == expected
        if chunk < 3:
            await writer.roll()
    await writer.close()
    assert len({p.ledger_id for p, _ in expected}) == 4
    # a reader that starts mid-log follows from there too
    late = await _follow(bk, "live", start=expected[7][0])
    await late.wait_for(len(expected) - 7)
    writer2 = await open_log_writer(bk, "live", **QUORUM)  # type: ignore[arg-type]
    expected.append((await writer2.append(b"more"), b"more"))
    await writer2.close()
    await tailer.wait_for(len(expected))
    await late.wait_for(len(expected) - 7)
    await tailer.stop()
    await late.stop()
    assert [(r.position, r.payload) for r in tailer.records] == expected  # exactly once, in order
    assert [(r.position, r.payload) for r in late.records] == expected[7:]


async def test_follows_across_a_takeover(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    acked: list[tuple[LogPosition, bytes]] = []
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk_a:
        writer_a = await open_log_writer(bk_a, "events", **QUORUM)  # type: ignore[arg-type]
        tailer = await _follow(bk, "events")
        for i in range(5):
            acked.append((await writer_a.append(f"a{i}".encode()), f"a{i}".encode()))
        await tailer.wait_for(len(acked))
        # sent, not waited for: the takeover's recovery decides whether they are in the log
        unacked = [await writer_a.append_async(f"u{i}".encode()) for i in range(5)]
        writer_b = await open_log_writer(bk, "events", **QUORUM)  # type: ignore[arg-type]
        outcomes = await asyncio.gather(*unacked, return_exceptions=True)
        for i, outcome in enumerate(outcomes):
            assert isinstance(outcome, LogPosition | LogFenced)
            if isinstance(outcome, LogPosition):
                acked.append((outcome, f"u{i}".encode()))
        b_acked = [(await writer_b.append(f"b{i}".encode()), f"b{i}".encode()) for i in range(3)]
        await writer_b.close()
        with contextlib.suppress(LogFenced):
            await writer_a.close()
    log_now = [(r.position, r.payload) for r in await _read_all(bk, "events")]
    got = await tailer.wait_for(len(log_now))
    await tailer.stop()
    # exactly the log: A's recovered ledger up to its last entry, then B's, each once, in order
    assert [(r.position, r.payload) for r in got] == log_now
    assert [p for p, _ in log_now] == sorted({p for p, _ in log_now})
    assert set(acked) <= set(log_now)
    assert log_now[-3:] == b_acked
    a_ledger = acked[0][0].ledger_id
    assert [p for p, _ in log_now if p.ledger_id == a_ledger] == [
        LogPosition(a_ledger, i) for i in range(len(log_now) - 3)
    ]


async def test_closing_a_following_reader_leaves_no_tasks(cluster: Cluster, bk: BookKeeper) -> None:
    await cluster.start(3)
    writer = await open_log_writer(bk, "quiet", **QUORUM)  # type: ignore[arg-type]
    for i in range(3):
        await writer.append(f"{i}".encode())
    before = asyncio.all_tasks()

    async def no_leftover() -> None:  # tasks started since `before` end (gRPC winds a call down)
        started = {t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()}
        if started:
            _, pending = await asyncio.wait(started, timeout=WAIT_S)
            assert not pending

    # closed mid-tail, between records (aclose of a suspended generator)
    reader = await open_log_reader(bk, "quiet", password=b"pw", follow=True)
    async with contextlib.aclosing(reader):
        async for record in reader:
            if record.position.entry_id == 1:
                break
    await no_leftover()
    # cancelled while waiting in a long poll (caught up on an open ledger)
    tailer = await _follow(bk, "quiet")
    await tailer.wait_for(3)
    assert not tailer.task.done()
    await tailer.stop()
    await no_leftover()
    # cancelled while waiting for the next ledger (the last one is closed)
    await writer.close()
    tailer = await _follow(bk, "quiet")
    await tailer.wait_for(3)
    assert not tailer.task.done()
    await tailer.stop()
    await no_leftover()
