"""Where a client finds its cluster when it is given no metadata URL: the lookup ``bkaio`` uses too.

In order: an explicit URL, ``$BKAIO_METADATA``, then the state file the running sandbox writes
(``$BKAIO_HOME/sandbox.json``, default ``~/.bkaio``). The state file records the sandbox's pid: a
sandbox killed with SIGKILL leaves it behind, so it is used only while that pid is alive and is a
sandbox; otherwise the lookup says the sandbox is not running instead of timing out against a dead
etcd.

It lives on the client floor (``bookkeeper_aio.cli.state`` re-exports it) because
``BookKeeper.connect()`` without a URL needs it and the client must not import the CLI.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bookkeeper_aio.errors import BKInterfaceError

METADATA_ENV = "BKAIO_METADATA"
HOME_ENV = "BKAIO_HOME"
CLIENT_CONFIG_ENV = "BKAIO_CLIENT_CONFIG"  # = client.config.CONFIG_FILE_ENV (a test pins them)


class NoClusterFound(BKInterfaceError):
    """No metadata URL was given and none was found (``$BKAIO_METADATA``, a running sandbox)."""


class SandboxNotRunning(NoClusterFound):
    """The sandbox's state file names a process that is gone (or is no sandbox): ``pid``, ``path``."""

    def __init__(self, message: str, pid: int, path: Path) -> None:
        super().__init__(message)
        self.pid = pid
        self.path = path


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".bkaio")


def state_path() -> Path:
    return home() / "sandbox.json"


def read_state() -> dict[str, Any] | None:
    """The sandbox's state file, None when missing or unreadable."""
    try:
        data: dict[str, Any] = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(0) is all we know


def sandbox_alive(pid: int) -> bool:
    """Whether ``pid`` is a live sandbox (not a process that reused the pid of a dead one)."""
    if not pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid
    return b"sandbox" in cmdline


def find_client_config(url: str | None) -> str | None:
    """The client config file for a client given no config: ``$BKAIO_CLIENT_CONFIG``, else the one
    the running sandbox wrote (``bkaio sandbox --tls``: its CA and token) when ``url`` is that
    sandbox's, else None (defaults plus ``BKAIO_CLIENT_*`` variables)."""
    explicit = os.environ.get(CLIENT_CONFIG_ENV)
    if explicit:
        return explicit
    state = read_state()
    if not state or not state.get("client_config") or state.get("metadata_url") != url:
        return None
    pid = state.get("pid")
    if isinstance(pid, int) and sandbox_alive(pid):
        return str(state["client_config"])
    return None


def find_metadata_url(explicit: str | None = None) -> str:
    """``explicit``, else ``$BKAIO_METADATA``, else the running sandbox's URL.

    Raises SandboxNotRunning (the state file is stale) or NoClusterFound (nothing configured), both
    BKInterfaceError.
    """
    if explicit:
        return explicit
    env = os.environ.get(METADATA_ENV)
    if env:
        return env
    state = read_state()
    if state and state.get("metadata_url"):
        pid = state.get("pid")
        if isinstance(pid, int) and not sandbox_alive(pid):
            raise SandboxNotRunning(
                f"the sandbox is not running (stale state from pid {pid} in {state_path()}): "
                "start it with `make run`, or pass a metadata URL etcd://HOST:PORT/ROOT",
                pid,
                state_path(),
            )
        return str(state["metadata_url"])
    raise NoClusterFound(
        f"no cluster given: pass a metadata URL, set {METADATA_ENV}, or start the sandbox with `make run`"
    )
