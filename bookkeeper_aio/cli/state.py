"""Where ``bkaio`` finds its cluster: ``--metadata URL``, ``$BKAIO_METADATA``, or the state file
the sandbox writes (``$BKAIO_HOME/sandbox.json``, default ``~/.bkaio``).

The state file records the sandbox's pid: a sandbox killed with SIGKILL leaves it behind, so it is
used only while that pid is alive (and is a sandbox); otherwise the commands say the sandbox is not
running instead of timing out against a dead etcd.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METADATA_ENV = "BKAIO_METADATA"


class NoClusterConfigured(RuntimeError):
    pass


def home() -> Path:
    return Path(os.environ.get("BKAIO_HOME") or Path.home() / ".bkaio")


def state_path() -> Path:
    return home() / "sandbox.json"


def write_state(state: dict[str, Any]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def read_state() -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None
    return data


def clear_state(pid: int) -> None:
    """Remove the state file if it still belongs to the sandbox with ``pid``."""
    state = read_state()
    if state and state.get("pid") == pid:
        state_path().unlink(missing_ok=True)


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


def resolve_metadata_url(explicit: str | None) -> str:
    if explicit:
        return explicit
    env = os.environ.get(METADATA_ENV)
    if env:
        return env
    state = read_state()
    if state and state.get("metadata_url"):
        pid = state.get("pid")
        if isinstance(pid, int) and not sandbox_alive(pid):
            raise NoClusterConfigured(
                f"the sandbox is not running (stale state from pid {pid} in {state_path()}): "
                "start it with `make run` (bkaio sandbox), or pass --metadata etcd://HOST:PORT/ROOT"
            )
        return str(state["metadata_url"])
    raise NoClusterConfigured(
        f"no cluster given: pass --metadata etcd://HOST:PORT/ROOT, set ${METADATA_ENV}, "
        "or start a sandbox with `make run` (bkaio sandbox)"
    )
