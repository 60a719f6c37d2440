"""Faults on real bookie processes, checked by a history (tests/faults/history.py).

Each bookie runs as its own process behind its own fault proxy (tests/faults/proxy.py): clients
reach it only through the proxy, whose address is what the bookie's registration says. Writer tasks
pipeline unique values into E3/Qw2/Qa2, E3/Qw3/Qa2 and (with 6 bookies) striped E5/Qw3/Qa2 ledgers,
starting a new ledger whenever one fails. A seeded nemesis meanwhile kills bookies with SIGKILL and
restarts them (same data dir and port), pauses them (SIGSTOP/SIGCONT), or partitions them at the
proxy (both directions, or answers only). Then everything heals, every ledger is recovered by three
racing recoverers and read back by three independent clients, and the history is checked: no acked
add lost, readers agree, no phantom, recoverers agree, LACs monotonic.

``FAULT_CYCLES`` scales the number of nemesis cycles (`make chaos` runs many); ``FAULT_SEED`` picks
the schedule. On a violation the test keeps the history next to the bookies' data dirs and logs and
prints how to replay the seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from bookkeeper_aio import BKError, BookKeeper, ClientConfig
from metadata.bookies import BookieInfo, BookieRegistration
from metadata.cluster import connect as metadata_connect
from metadata.cluster import ensure_cluster
from tests.faults.history import History
from tests.faults.proxy import FaultProxy, Mode
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

pytestmark = pytest.mark.etcd

CONFIG = ClientConfig(
    add_timeout_s=1.5,
    read_timeout_s=1.5,
    connect_timeout_s=1.0,
    reconnect_backoff_max_s=0.3,
    explicit_lac_interval_ms=50,
)
SHAPES = [(3, 2, 2), (3, 3, 2)]
STRIPED = (5, 3, 2)
WINDOW = 32
PENDING_WAIT_S = 10.0
RECOVERY_PARALLEL = 8


def _cycles(default: int) -> int:
    return int(os.environ.get("FAULT_CYCLES", default))


def _seed() -> int:
    return int(os.environ.get("FAULT_SEED", random.SystemRandom().randrange(1_000_000)))


class FaultCluster:
    """N bookie processes, each behind a fault proxy, registered under the proxy's address."""

    def __init__(self, url: str, root: str, base: Path) -> None:
        self.url, self.root, self.base = url, root, base
        self.meta = metadata_connect(url)
        self.bookies: list[BookieProcess] = []
        self.proxies: list[FaultProxy] = []
        self.registrations: list[BookieRegistration | None] = []

    async def start(self, count: int) -> None:
        await ensure_cluster(self.meta.store, self.root)
        for index in range(count):
            bookie = BookieProcess(self.base / f"b{index}", bookie_id=f"b{index}")
            await asyncio.to_thread(bookie.start)
            proxy = await FaultProxy(bookie.address).start()
            self.bookies.append(bookie)
            self.proxies.append(proxy)
            self.registrations.append(None)
            await self._register(index)

    async def _register(self, index: int) -> None:
        host, port = self.proxies[index].address
        registration = BookieRegistration(
            self.meta.store, self.root, BookieInfo(f"b{index}", host, port), ttl_s=5
        )
        await registration.start()
        self.registrations[index] = registration

    async def _unregister(self, index: int) -> None:
        registration, self.registrations[index] = self.registrations[index], None
        if registration is not None:
            await registration.close()

    async def kill(self, index: int) -> None:
        await asyncio.to_thread(self.bookies[index].kill)
        await self._unregister(index)  # a dead bookie's lease would expire: do it at once

    async def restart(self, index: int) -> None:
        await asyncio.to_thread(self.bookies[index].restart)
        await self._register(index)

    async def heal(self) -> None:
        for index, bookie in enumerate(self.bookies):
            bookie.resume() if bookie.running else await self.restart(index)
            self.proxies[index].set(Mode.PASS)
            if self.registrations[index] is None:
                await self._register(index)

    async def close(self) -> None:
        for index in range(len(self.bookies)):
            with contextlib.suppress(Exception):
                await self._unregister(index)
        for proxy in self.proxies:
            await proxy.close()
        for bookie in self.bookies:
            bookie.cleanup()
        await self.meta.close()


@pytest.fixture
async def faults(etcd_server: EtcdCluster, tmp_path: Path) -> AsyncIterator[FaultCluster]:
    root = f"/bookkeeper/faults-{uuid.uuid4().hex[:12]}"
    cluster = FaultCluster(etcd_server.url(root), root, tmp_path)
    yield cluster
    await cluster.close()


@dataclass
class Workload:
    """Writer tasks appending unique values until ``stop`` is set; every add goes into ``history``."""

    bk: BookKeeper
    history: History
    shapes: list[tuple[int, int, int]]
    stop: asyncio.Event
    ledgers: list[int]

    async def writer(self, name: str, rng: random.Random) -> None:
        sequence = 0
        while not self.stop.is_set():
            ensemble, wq, aq = rng.choice(self.shapes)
            try:
                handle = await self.bk.create_ledger(ensemble, wq, aq, password=b"f")
            except BKError:
                await asyncio.sleep(0.1)  # too few bookies up for this shape right now
                continue
            self.ledgers.append(handle.id)
            pending: set[asyncio.Future[int]] = set()
            broken = False
            while not self.stop.is_set() and not broken:
                op = self.history.invoke(name, handle.id, f"{name}-{sequence}".encode())
                sequence += 1
                try:
                    future = await handle.append_async(op.value)
                except BKError as error:
                    self.history.failed(op, error)
                    break
                future.add_done_callback(lambda f, op=op: self._done(op, f))
                pending.add(future)
                future.add_done_callback(pending.discard)
                if len(pending) >= WINDOW:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    broken = any(f.exception() is not None for f in done if not f.cancelled())
            if pending:
                await asyncio.wait(pending, timeout=PENDING_WAIT_S)
            handle.abort()  # left open: recovery closes it after the faults

    def _done(self, op: object, future: asyncio.Future[int]) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self.history.ok(op, future.result())  # type: ignore[arg-type]
        else:
            self.history.failed(op, error)  # type: ignore[arg-type]


Nemesis = Callable[[FaultCluster, random.Random], Awaitable[None]]


async def kill_restart(cluster: FaultCluster, rng: random.Random) -> None:
    index = rng.randrange(len(cluster.bookies))
    await cluster.kill(index)
    await asyncio.sleep(rng.uniform(0.05, 0.4))
    await cluster.restart(index)


async def pause_resume(cluster: FaultCluster, rng: random.Random) -> None:
    bookie = rng.choice(cluster.bookies)
    bookie.pause()
    await asyncio.sleep(rng.uniform(0.3, 2.0))  # across the add timeout too, sometimes
    bookie.resume()


async def partition(cluster: FaultCluster, rng: random.Random) -> None:
    proxy = rng.choice(cluster.proxies)
    proxy.set(rng.choice([Mode.BLACKHOLE, Mode.BLACKHOLE_DOWN, Mode.RESET]))
    await asyncio.sleep(rng.uniform(0.3, 2.0))
    proxy.set(Mode.PASS)


async def _run(
    cluster: FaultCluster,
    bookies: int,
    shapes: list[tuple[int, int, int]],
    nemesis: Nemesis,
    cycles: int,
    tmp_path: Path,
) -> History:
    seed = _seed()
    rng = random.Random(seed)
    await cluster.start(bookies)
    history = History()
    stop = asyncio.Event()
    async with BookKeeper.connect(cluster.url, config=CONFIG) as bk:
        workload = Workload(bk, history, shapes, stop, [])
        writers = [asyncio.create_task(workload.writer(f"w{i}", random.Random(seed + i))) for i in range(3)]
        await asyncio.sleep(0.3)
        for _ in range(cycles):
            await nemesis(cluster, rng)
            await asyncio.sleep(rng.uniform(0.05, 0.3))
        stop.set()
        await asyncio.gather(*writers)
        await cluster.heal()
        await _recover_and_read(cluster, history, workload.ledgers)
    problems = history.check()
    if problems:
        history.dump(tmp_path / "history.jsonl")
        pytest.fail(
            f"{len(problems)} violations (seed {seed}; history, data dirs and logs kept in {tmp_path}; "
            f"replay: FAULT_SEED={seed} pytest {os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}):\n"
            + "\n".join(problems)
        )
    counts = history.counts()
    assert counts["ok"] > 0, counts  # the workload made progress through the faults
    return history


async def _recover_and_read(cluster: FaultCluster, history: History, ledgers: list[int]) -> None:
    """Three racing recoverers per ledger, then three independent readers (ledgers in parallel)."""
    clients = [BookKeeper.connect(cluster.url, config=CONFIG) for _ in range(3)]
    slots = asyncio.Semaphore(RECOVERY_PARALLEL)
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(client) for client in clients]

        async def one(ledger_id: int) -> None:
            async with slots:
                handles = await asyncio.gather(
                    *(bk.open_ledger(ledger_id, password=b"f", recovery=True) for bk in opened)
                )
                for handle in handles:
                    history.recovered_at(ledger_id, handle.last_add_confirmed)
                for bk in opened:
                    reader = await bk.open_ledger(ledger_id, password=b"f")
                    history.lac_seen(ledger_id, reader.last_add_confirmed)
                    last = reader.last_add_confirmed
                    entries = (
                        [] if last < 0 else [(e.entry_id, e.payload) async for e in reader.read(0, last)]
                    )
                    history.read_back(ledger_id, entries)

        await asyncio.gather(*(one(ledger_id) for ledger_id in ledgers))


async def test_kill_9_and_restart_bookies(faults: FaultCluster, tmp_path: Path) -> None:
    history = await _run(faults, 4, SHAPES, kill_restart, _cycles(6), tmp_path)
    assert history.counts()["ok"] > 50


async def test_pause_bookies(faults: FaultCluster, tmp_path: Path) -> None:
    await _run(faults, 4, SHAPES, pause_resume, _cycles(4), tmp_path)


async def test_partition_bookies_at_the_proxy(faults: FaultCluster, tmp_path: Path) -> None:
    await _run(faults, 4, SHAPES, partition, _cycles(4), tmp_path)


@pytest.mark.slow
async def test_kill_9_with_striped_ledgers(faults: FaultCluster, tmp_path: Path) -> None:
    await _run(faults, 6, [STRIPED], kill_restart, _cycles(20), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("nemesis", [kill_restart, pause_resume, partition])
async def test_chaos(faults: FaultCluster, tmp_path: Path, nemesis: Nemesis) -> None:
    """`make chaos`: many cycles (FAULT_CYCLES, default 200) of one nemesis, mixed shapes."""
    await _run(faults, 6, [*SHAPES, STRIPED], nemesis, _cycles(200), tmp_path)
