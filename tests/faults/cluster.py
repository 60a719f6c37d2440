"""A cluster for the fault tests: N bookie processes, each behind its own fault proxy, and etcd.

Clients reach a bookie only through its proxy, whose address is what the bookie's registration
says, so a proxy fault (tests/faults/proxy.py) is a fault of that client<->bookie link. Verbs: kill
(SIGKILL), restart (same data dir and port), pause/resume through the `BookieProcess`, heal
(everything running, every link passing, every bookie registered). `recover_and_read` ends a run:
three racing recoverers per ledger, then three independent readers, all into a history.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bookkeeper_aio import BKError, BKTimeout, BookKeeper, ClientConfig
from bookkeeper_aio.cli.netns import NetnsHosts
from metadata.bookies import BookieInfo, BookieRegistration
from metadata.cluster import connect as metadata_connect
from metadata.cluster import ensure_cluster
from tests.faults.history import History
from tests.faults.proxy import FaultProxy, Mode
from tests.harness.bookie_proc import BookieProcess
from tests.harness.etcd import EtcdCluster

CONFIG = ClientConfig(
    add_timeout_s=1.5,
    read_timeout_s=1.5,
    connect_timeout_s=1.0,
    reconnect_backoff_max_s=0.3,
    explicit_lac_interval_ms=50,
)
READBACK_CONFIG = dataclasses.replace(CONFIG, read_timeout_s=10.0)
"""The recover-and-read phase after heal: ledgers in parallel through the test loop's proxies."""
LIVENESS_S = 120.0
"""After heal, every ledger is recovered and read back within this (else the run fails)."""
RECOVERY_PARALLEL = 8
START_TIMEOUT_S = 60.0
"""A (re)started bookie must print READY within this: 20 s (the harness's default) was once not enough
for a restart in make chaos on the loaded 2-core machine (the process logged nothing in 20 s)."""
T = TypeVar("T")
WINDOW = 32
RATE = 250.0
"""Appends per second per writer at most: the faults are the point, not the throughput, and every
entry written is read back three times at the end (unpaced, 6 cycles wrote 130k entries)."""
PENDING_WAIT_S = 10.0
CLOSE_WAIT_S = 30.0  # a close that hangs longer fails the test (TimeoutError: not typed)
WRITERS_STOP_S = 90.0


def fault_cycles(default: int) -> int:
    """Nemesis cycles of a run: ``$FAULT_CYCLES`` (`make chaos`), else ``default``."""
    return int(os.environ.get("FAULT_CYCLES", default))


def fault_seed() -> int:
    """The run's schedule: ``$FAULT_SEED`` to replay one, else a fresh random seed."""
    return int(os.environ.get("FAULT_SEED", random.SystemRandom().randrange(1_000_000)))


class FaultCluster:
    """N bookie processes, each behind a fault proxy, registered under the proxy's address."""

    def __init__(self, url: str, root: str, base: Path, etcd: EtcdCluster | None = None) -> None:
        self.url, self.root, self.base = url, root, base
        self.etcd = etcd  # for nemeses that kill its members
        self.meta = metadata_connect(url)
        self.bookies: list[BookieProcess] = []
        self.proxies: list[FaultProxy] = []
        self.registrations: list[BookieRegistration | None] = []
        self.faulty_max: int | None = None
        """Bookies a nemesis may hold faulty at once (`claimed`); None: any number."""
        self._claimed: set[int] = set()

    async def start(self, count: int, bookie_args: list[str] | None = None) -> None:
        """Start ``count`` bookies (in parallel), each behind a proxy, and register them."""
        await ensure_cluster(self.meta.store, self.root)
        first = len(self.bookies)
        fresh = [
            BookieProcess(self.base / f"b{index}", bookie_id=f"b{index}", extra_args=bookie_args)
            for index in range(first, first + count)
        ]
        self.bookies += fresh
        await asyncio.gather(*(asyncio.to_thread(bookie.start, START_TIMEOUT_S) for bookie in fresh))
        for index in range(first, first + count):
            self.proxies.append(await FaultProxy(self.bookies[index].address).start())
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

    @contextlib.asynccontextmanager
    async def claimed(self, rng: random.Random) -> AsyncIterator[int]:
        """A bookie for one nemesis cycle (drawn by ``rng``) that no concurrent cycle holds, while at
        most `faulty_max` are held: nemeses running in parallel lanes never fault one bookie twice."""
        while True:
            free = [i for i in range(len(self.bookies)) if i not in self._claimed]
            if free and (self.faulty_max is None or len(self._claimed) < self.faulty_max):
                break
            await asyncio.sleep(0.05)
        index = rng.choice(free)
        self._claimed.add(index)
        try:
            yield index
        finally:
            self._claimed.discard(index)

    async def kill(self, index: int) -> None:
        await asyncio.to_thread(self.bookies[index].kill)
        await self._unregister(index)  # a dead bookie's lease would expire: do it at once

    async def restart(self, index: int) -> None:
        await asyncio.to_thread(self.bookies[index].restart, START_TIMEOUT_S)
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


class NetnsFaultCluster(FaultCluster):
    """Bookies on separate hosts: each in its own network namespace with its own IP
    (bookkeeper_aio/cli/netns.py), registered and reached by that address, no proxy. The link fault is
    `link_down` / `link_up` of a host."""

    def __init__(self, url: str, root: str, base: Path, hosts: NetnsHosts) -> None:
        super().__init__(url, root, base)
        self.hosts = hosts

    async def start(self, count: int, bookie_args: list[str] | None = None) -> None:
        assert count <= self.hosts.count, "one host per bookie"
        await ensure_cluster(self.meta.store, self.root)
        self.bookies = [
            BookieProcess(
                self.base / f"b{index}",
                bookie_id=f"b{index}",
                host=self.hosts.address(index),
                extra_args=bookie_args,
                wrapper=self.hosts.prefix(index),
            )
            for index in range(count)
        ]
        await asyncio.gather(*(asyncio.to_thread(bookie.start, START_TIMEOUT_S) for bookie in self.bookies))
        self.registrations = [None] * count
        for index in range(count):
            await self._register(index)

    async def _register(self, index: int) -> None:
        host, port = self.bookies[index].address
        assert not host.startswith("127."), "a host's bookie is reached by its own address"
        registration = BookieRegistration(
            self.meta.store, self.root, BookieInfo(f"b{index}", host, port), ttl_s=5
        )
        await registration.start()
        self.registrations[index] = registration

    async def link_down(self, index: int) -> None:
        await asyncio.to_thread(self.hosts.link_down, index)

    async def link_up(self, index: int) -> None:
        await asyncio.to_thread(self.hosts.link_up, index)

    async def heal(self) -> None:
        for index, bookie in enumerate(self.bookies):
            await self.link_up(index)
            bookie.resume() if bookie.running else await self.restart(index)
            if self.registrations[index] is None:
                await self._register(index)


async def stop_writers(stop: asyncio.Event, writers: list[asyncio.Task[None]]) -> None:
    """Tell the writer tasks to stop and wait for them, at most WRITERS_STOP_S (liveness: each has
    at most PENDING_WAIT_S of adds to wait for, and a close CLOSE_WAIT_S); a writer still stuck then
    fails the run with where it is stuck (an add or ensemble change that never ends)."""
    stop.set()
    done, stuck = await asyncio.wait(writers, timeout=WRITERS_STOP_S)
    for task in done:
        task.result()  # a writer's own error (untyped: not a BKError) fails the run
    if stuck:
        where = io.StringIO()
        for task in stuck:
            task.print_stack(file=where)
            task.cancel()
        stacks = where.getvalue()
        raise AssertionError(f"{len(stuck)} writers still running {WRITERS_STOP_S} s after stop:\n{stacks}")


def abandon_writers(stop: asyncio.Event, writers: list[asyncio.Task[None]]) -> None:
    """A run that failed midway: its writer tasks must not go on (the package's shared cluster runs
    later tests on the same event loop)."""
    stop.set()
    for task in writers:
        task.cancel()


async def _until_done(make: Callable[[], Awaitable[T]], deadline: float) -> T:
    """``await make()``, again after a timeout or a retriable error until ``deadline`` (the
    liveness bound after heal): the read-back runs many ledgers at once through the proxies of the
    test's own loop, and a slow answer there is not what the run checks."""
    while True:
        try:
            return await make()
        except BKError as error:
            if not (error.retriable or isinstance(error, BKTimeout)) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def recover_and_read(cluster: FaultCluster, history: History, ledgers: list[int]) -> None:
    """Three racing recoverers per ledger, then three independent readers (ledgers in parallel).
    Every ledger must be recovered and read within LIVENESS_S of the heal."""
    clients = [BookKeeper.connect(cluster.url, config=READBACK_CONFIG) for _ in range(3)]
    slots = asyncio.Semaphore(RECOVERY_PARALLEL)
    deadline = time.monotonic() + LIVENESS_S
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(client) for client in clients]

        async def read_whole(bk: BookKeeper, ledger_id: int) -> tuple[int, list[tuple[int, bytes]]]:
            reader = await bk.open_ledger(ledger_id, password=b"f")
            last = reader.last_add_confirmed
            return last, [] if last < 0 else [(e.entry_id, e.payload) async for e in reader.read(0, last)]

        async def one(ledger_id: int) -> None:
            async with slots:
                handles = await asyncio.gather(
                    *(
                        _until_done(
                            lambda bk=bk: bk.open_ledger(ledger_id, password=b"f", recovery=True), deadline
                        )
                        for bk in opened
                    )
                )
                for handle in handles:
                    history.recovered_at(ledger_id, handle.last_add_confirmed)
                for bk in opened:
                    last, entries = await _until_done(lambda bk=bk: read_whole(bk, ledger_id), deadline)
                    history.lac_seen(ledger_id, last)
                    history.read_back(ledger_id, entries)

        await asyncio.gather(*(one(ledger_id) for ledger_id in ledgers))


@dataclass
class Workload:
    """Writer tasks appending unique values until ``stop`` is set; every add goes into ``history``."""

    bk: BookKeeper
    history: History
    shapes: list[tuple[int, int, int]]
    stop: asyncio.Event
    ledgers: list[int]
    roll_every: int = 0  # > 0: close the ledger after this many appends and start a new one

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
            started, appended = time.monotonic(), 0
            while (
                not self.stop.is_set()
                and not broken
                and not (self.roll_every and appended >= self.roll_every)
            ):
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
                appended += 1
                ahead = appended / RATE - (time.monotonic() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            if pending:
                await asyncio.wait(pending, timeout=PENDING_WAIT_S)
            if not broken and not self.stop.is_set():  # rolled over: close it (metadata CAS)
                with contextlib.suppress(BKError):  # typed failures only; recovery closes it then
                    await asyncio.wait_for(handle.close(), CLOSE_WAIT_S)
            handle.abort()  # left open (unless closed): recovery closes it after the faults

    def _done(self, op: object, future: asyncio.Future[int]) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self.history.ok(op, future.result())  # type: ignore[arg-type]
        else:
            self.history.failed(op, error)  # type: ignore[arg-type]
