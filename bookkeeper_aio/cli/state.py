"""Where ``bkaio`` finds its cluster: ``--metadata URL``, ``$BKAIO_METADATA``, or the state file
the sandbox writes (``$BKAIO_HOME/sandbox.json``, default ``~/.bkaio``)."""

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


def resolve_metadata_url(explicit: str | None) -> str:
    if explicit:
        return explicit
    env = os.environ.get(METADATA_ENV)
    if env:
        return env
    state = read_state()
    if state and state.get("metadata_url"):
        return str(state["metadata_url"])
    raise NoClusterConfigured(
        f"no cluster given: pass --metadata etcd://HOST:PORT/ROOT, set ${METADATA_ENV}, "
        "or start a sandbox with `make run` (bkaio sandbox)"
    )
