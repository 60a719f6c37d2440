"""`bkaio sandbox --hosts N`: each bookie on a host of its own (a network namespace with its own IP
on a bridge), etcd and the demo on this machine reaching them by those addresses; everything the
run created is gone after it."""

from __future__ import annotations

import ipaddress
import re
import subprocess
from pathlib import Path

import pytest

from bookkeeper_aio.cli.netns import unavailable_reason
from tests.harness.sandbox import alive, bkaio, child_pids

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_sandbox_on_hosts_runs_the_demo_across_them(tmp_path: Path) -> None:
    before = _namespaces()
    result = bkaio(
        tmp_path, "sandbox", "--hosts", "3", "--no-serve", "--demo-entries", "500", check=False, timeout=180
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "on hosts of their own" in result.stdout
    addresses = re.findall(r"^bookie-\d+\s+\d+\s+(\S+):3181\s", result.stdout, re.MULTILINE)
    assert len(addresses) == 3
    assert len(set(addresses)) == 3
    assert not any(ipaddress.ip_address(a).is_loopback for a in addresses)
    url = re.search(r"cluster ready: etcd://([\d.]+):", result.stdout)
    assert url is not None
    gateway = ipaddress.ip_interface(f"{url.group(1)}/24")
    assert all(ipaddress.ip_address(a) in gateway.network for a in addresses)  # one bridge
    assert "tailing reader saw 600 entries, in order and byte-identical" in result.stdout
    assert "a following reader saw each once, in order, across rolls" in result.stdout
    assert not any(alive(pid) for pid in child_pids(result.stdout.splitlines()))
    assert _namespaces() == before  # the hosts are gone with the sandbox
    assert not (tmp_path / "sandbox" / "sandbox.netns").exists()
