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
import os
import socket
from pathlib import Path
from typing import Any

import metadata
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
    "ADMIN_TOKEN_ENV",
    "METADATA_ENV",
    "NoClusterConfigured",
    "admin_token",
    "clear_state",
    "home",
    "pid_alive",
    "read_state",
    "resolve_metadata_url",
    "sandbox_alive",
    "state_path",
    "write_state",
]


ADMIN_TOKEN_ENV = "BKAIO_ADMIN_TOKEN_FILE"
PROBE_TIMEOUT_S = 0.5
"""How long the refused-connection probe of one etcd endpoint may take (a host that drops the
connect silently costs this once; the command then goes on and the store's own budget decides)."""


class NoClusterConfigured(RuntimeError):
    pass


def admin_token(explicit_file: str | None) -> str | None:
    """The token for bookies' admin state changes: the first line of ``explicit_file``, else of
    ``$BKAIO_ADMIN_TOKEN_FILE``, else of the running sandbox's token file; None when none is set.
    Raises ``SystemExit`` naming a file that cannot be read."""
    path = explicit_file or os.environ.get(ADMIN_TOKEN_ENV)
    if not path:
        current = read_state()
        if current and current.get("admin_token_file") and sandbox_alive(int(current.get("pid", 0))):
            path = str(current["admin_token_file"])
    if not path:
        return None
    try:
        token = Path(path).read_text().strip().splitlines()
    except OSError as error:
        raise SystemExit(f"cannot read the admin token file {path}: {error}") from None
    if not token or not token[0].strip():
        raise SystemExit(f"the admin token file {path} is empty")
    return token[0].strip()


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


def resolve_metadata_url(explicit: str | None, *, probe: bool = True) -> str:
    """The cluster's metadata URL (see the module docstring). Raises `NoClusterConfigured`, and
    with ``probe`` `metadata.MetadataUnavailable` at once when every etcd endpoint refuses a
    connection (:func:`fail_fast_when_refused`; a daemon passes False: it rides a restart out)."""
    try:
        url = discovery.find_metadata_url(explicit)
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
    if probe:
        fail_fast_when_refused(url)
    return url


def fail_fast_when_refused(url: str) -> None:
    """Raise `metadata.MetadataUnavailable` when every etcd endpoint of ``url`` refuses a TCP
    connection: nothing listens there, and a command would otherwise spend the store's whole
    operation budget (``op_timeout_s``, about 6 s with the connect) retrying before saying so.

    Only the command line's one-shot commands do this, before they connect: the library keeps
    retrying within its budget (an etcd restarting takes a few seconds to listen again; a daemon,
    `bkaio autorecovery run`, or a writer should ride that out). Any other outcome of the probe
    (connected, no answer within `PROBE_TIMEOUT_S`, an unknown host) leaves the decision to the
    store. TLS URLs are not probed:
    a bare TCP connection to a TLS etcd makes it log a rejected handshake for every command.
    """
    try:
        parsed = metadata.parse_url(url)
    except metadata.InvalidUrl:
        return  # the command reports it when it connects
    if parsed.scheme != "etcd" or parsed.tls or parsed.ca_file or parsed.cert_file:
        return
    for host, port in parsed.endpoints:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                return
        except ConnectionRefusedError:
            continue
        except OSError:
            return
    targets = ", ".join(f"{host}:{port}" for host, port in parsed.endpoints)
    raise metadata.MetadataUnavailable(
        f"connection refused by every etcd endpoint ({targets}): nothing listens there"
    )
