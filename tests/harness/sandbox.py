"""A real ``bkaio sandbox`` subprocess (etcd + bookie processes) and ``bkaio`` commands against it.

    with running_sandbox(home, "--bookies", "3", "--no-demo") as box:  # waits for "serving;"
        box.url, box.child_pids, box.lines     # from what it printed up to then
        bkaio(box.home, "bookies", "--json")   # a CompletedProcess; check=True asserts exit 0
    # on exit it is stopped (SIGTERM, a wait, SIGKILL), and so is any child it left behind

``home`` is the sandbox's ``$BKAIO_HOME`` (``sandbox_env(home)`` is the environment for anything
that should find it by itself). The sandbox's stderr (the demo's progress line) goes to its stdout,
so ``lines`` has both. Stopping the children left alive matters after a test kills the sandbox with
SIGKILL: each child runs in its own session and outlives it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BKAIO = [sys.executable, "-m", "bookkeeper_aio.cli.main"]
READY_TIMEOUT_S = 90.0
PROCESS_ROW = re.compile(r"^(?:etcd|bookie-\d+)\s+(\d+)\s")  # a row of the process table: name, pid


@dataclass
class RunningSandbox:
    proc: subprocess.Popen[str]
    url: str
    child_pids: list[int]
    home: Path
    lines: list[str]


def sandbox_env(home: Path) -> dict[str, str]:
    """This environment with ``$BKAIO_HOME`` set to ``home`` and no ``$BKAIO_METADATA``."""
    env = dict(os.environ)
    env["BKAIO_HOME"] = str(home)
    env.pop("BKAIO_METADATA", None)
    return env


def read_until_ready(proc: subprocess.Popen[str], timeout_s: float = READY_TIMEOUT_S) -> list[str]:
    """The lines the sandbox prints up to and with its ``serving;`` line."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("serving;"):
            return lines
    raise AssertionError("sandbox did not become ready:\n" + "\n".join(lines))


def cluster_url(lines: Iterable[str]) -> str:
    """The metadata URL of the ``cluster ready: <url>`` line."""
    lines = list(lines)
    url = next((line.split(": ", 1)[1] for line in lines if line.startswith("cluster ready: ")), None)
    assert url is not None, lines
    return url


def child_pids(lines: Iterable[str]) -> list[int]:
    """The pids of the process table's rows (etcd, bookie-0, ...), in order."""
    return [int(m.group(1)) for line in lines if (m := PROCESS_ROW.match(line))]


@contextmanager
def running_sandbox(
    home: Path, *args: str, preexec_fn: Callable[[], object] | None = None
) -> Iterator[RunningSandbox]:
    """``bkaio sandbox *args`` with ``$BKAIO_HOME`` = ``home``, once it serves; always stopped."""
    proc = subprocess.Popen(
        [*BKAIO, "sandbox", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # the progress line goes to stderr, not a TTY here
        text=True,
        env=sandbox_env(home),
        preexec_fn=preexec_fn,
    )
    pids: list[int] = []
    try:
        lines = read_until_ready(proc)
        pids = child_pids(lines)
        yield RunningSandbox(proc, cluster_url(lines), pids, home, lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stop_pids(pids)  # after a SIGKILL the children are orphans
        if proc.stdout is not None:
            proc.stdout.close()


def stop_pids(pids: list[int]) -> None:
    """SIGTERM to each pid still alive, up to 30 s for them to exit, then SIGKILL."""
    for pid in pids:
        if alive(pid):
            subprocess.run(["kill", "-TERM", str(pid)], check=False)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            subprocess.run(["kill", "-KILL", str(pid)], check=False)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (its parent, the sandbox, has exited)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def bkaio(
    home: Path, *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``bkaio *args`` with ``$BKAIO_HOME`` = ``home``; ``check`` asserts it exits 0."""
    result = subprocess.run(
        [*BKAIO, *args], capture_output=True, text=True, env=sandbox_env(home), timeout=timeout, check=False
    )
    if check:
        assert result.returncode == 0, f"bkaio {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result
