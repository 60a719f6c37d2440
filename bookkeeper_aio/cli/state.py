"""Where ``bkaio`` finds its cluster: ``--metadata URL``, ``$BKAIO_METADATA``, or the state file
the sandbox writes (``$BKAIO_HOME/sandbox.json``, default ``~/.bkaio``).

The state file records the sandbox's pid: a sandbox killed with SIGKILL leaves it behind, so it is
used only while that pid is alive (and is a sandbox); otherwise the commands say the sandbox is not
running instead of timing out against a dead etcd. The lookup itself is the client's
(:mod:`bookkeeper_aio.client.discovery`, which ``BookKeeper.connect()`` uses without a URL); this
module words its errors for the command line and writes the state file.
"""

from __future__ import annotations

import json
from typing import Any

from bookkeeper_aio.client import discovery
from bookkeeper_aio.client.discovery import (
    METADATA_ENV,
    home,
    pid_alive,
    read_state,
    sandbox_alive,
    state_path,
)

__all__ = [
    "METADATA_ENV",
    "NoClusterConfigured",
    "clear_state",
    "home",
    "pid_alive",
    "read_state",
    "resolve_metadata_url",
    "sandbox_alive",
    "state_path",
    "write_state",
]


class NoClusterConfigured(RuntimeError):
    pass


def write_state(state: dict[str, Any]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(path)


def clear_state(pid: int) -> None:
    """Remove the state file if it still belongs to the sandbox with ``pid``."""
    state = read_state()
    if state and state.get("pid") == pid:
        state_path().unlink(missing_ok=True)


def resolve_metadata_url(explicit: str | None) -> str:
    try:
        return discovery.find_metadata_url(explicit)
    except discovery.SandboxNotRunning as error:
        raise NoClusterConfigured(
            f"the sandbox is not running (stale state from pid {error.pid} in {error.path}): "
            "start it with `make run` (bkaio sandbox), or pass --metadata etcd://HOST:PORT/ROOT"
        ) from None
    except discovery.NoClusterFound:
        raise NoClusterConfigured(
            f"no cluster given: pass --metadata etcd://HOST:PORT/ROOT, set ${METADATA_ENV}, "
            "or start a sandbox with `make run` (bkaio sandbox)"
        ) from None
