"""Separate hosts on one machine: network namespaces on a bridge, each with its own IP.

    hosts = NetnsHosts.create(3)        # raises NetnsUnavailable (with the reason) where not permitted
    hosts.address(0)                    # '10.77.N.10': the host's real address, reachable from here
    hosts.wrap(0, ["python", "-m", "bookie", ...])   # the command, run inside host 0's namespace
    hosts.link_down(0); hosts.link_up(0)             # the fault: host 0's cable pulled / plugged in
    hosts.close()                       # namespaces, links and bridge gone

Layout: a bridge ``bkb<tag>`` in the root namespace holds ``gateway`` (``10.77.N.1/24``); host ``i`` is
namespace ``bkns-<tag>-<i>`` with ``eth0`` = ``10.77.N.(10+i)/24`` (default route via the gateway),
joined to the bridge by a veth pair whose root end is ``bkv<tag><i>``. Processes of the root namespace
(tests, etcd bound to the gateway address) reach every host by its address, and hosts reach each other
and the gateway: nothing goes through loopback. ``N`` is picked free at creation, ``tag`` is random, so
several harnesses can live side by side. `link_down` sets the root end of the host's veth down: packets
to and from it are dropped (no RST), as with a pulled cable; its processes keep running.

Needs root (CAP_NET_ADMIN) and ``ip`` (iproute2); :func:`unavailable_reason` says why not, for a skip.
Processes started with :meth:`wrap` must be stopped before :meth:`close` (``ip netns exec`` execs
the command, so the pid is the process's own and signals reach it).
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

SUBNET_PREFIX = "10.77"
HOST_OFFSET = 10


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, not permitted)."""


def _ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`{' '.join(command)}` failed: {result.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here, or None when they can (tries one and removes it)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"bkprobe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except NetnsUnavailable as exc:
        return f"`ip netns add` is not permitted here: {exc}"
    with contextlib.suppress(NetnsUnavailable):
        _ip("netns", "delete", probe)
    return None


def _free_subnet() -> int:
    used = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=False).stdout
    free = [n for n in range(1, 255) if f"{SUBNET_PREFIX}.{n}.0/24" not in used]
    if not free:
        raise NetnsUnavailable(f"no free {SUBNET_PREFIX}.N.0/24 subnet")
    return random.choice(free)


@dataclass
class NetnsHosts:
    count: int
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: int = 0
    _created: list[str] = field(default_factory=list)

    @classmethod
    def create(cls, count: int) -> NetnsHosts:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        hosts = cls(count, subnet=_free_subnet())
        try:
            hosts._build()
        except BaseException:
            hosts.close()
            raise
        return hosts

    @property
    def bridge(self) -> str:
        return f"bkb{self.tag}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (bind etcd here for hosts to reach it)."""
        return f"{SUBNET_PREFIX}.{self.subnet}.1"

    def namespace(self, index: int) -> str:
        return f"bkns-{self.tag}-{index}"

    def veth(self, index: int) -> str:
        return f"bkv{self.tag}{index}"

    def address(self, index: int) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.{HOST_OFFSET + index}"

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(f"link:{self.bridge}")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index in range(self.count):
            ns, veth = self.namespace(index), self.veth(index)
            _ip("netns", "add", ns)
            self._created.append(f"netns:{ns}")
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            self._created.append(f"link:{veth}")
            _ip("link", "set", f"{veth}p", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("link", "set", f"{veth}p", "name", "eth0", netns=ns)
            _ip("addr", "add", f"{self.address(index)}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
            _ip("route", "add", "default", "via", self.gateway, netns=ns)

    def prefix(self, index: int) -> list[str]:
        """What runs a command inside host ``index``'s namespace (``BookieProcess(wrapper=...)``)."""
        return ["ip", "netns", "exec", self.namespace(index)]

    def wrap(self, index: int, command: list[str]) -> list[str]:
        """``command`` to run inside host ``index``'s namespace."""
        return [*self.prefix(index), *command]

    def link_down(self, index: int) -> None:
        _ip("link", "set", self.veth(index), "down")

    def link_up(self, index: int) -> None:
        _ip("link", "set", self.veth(index), "up")

    def close(self) -> None:
        """Remove what was created, newest first (deleting a namespace removes its veth pair)."""
        for item in reversed(self._created):
            kind, name = item.split(":", 1)
            with contextlib.suppress(NetnsUnavailable):
                _ip("netns", "delete", name) if kind == "netns" else _ip("link", "delete", name)
        self._created.clear()

    def __enter__(self) -> NetnsHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
