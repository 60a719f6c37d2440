"""`bkaio sandbox --hosts N`: each bookie on a host of its own (a network namespace with its own IP
on a bridge), etcd and the demo on this machine reaching them by those addresses; everything the
run created is gone after it."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bookkeeper_aio.cli.netns import NetnsHosts, unavailable_reason
from tests.harness.sandbox import alive, bkaio, child_pids, running_sandbox

REPO = Path(__file__).resolve().parents[3]

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
    assert _namespaces() <= before  # the hosts are gone with the sandbox (another run's may go too)
    assert not (tmp_path / "sandbox" / "sandbox.netns").exists()


def _acked(history: Path) -> dict[int, int]:
    """value index -> entry id, for every append the writer saw acked (whole lines only)."""
    acked = {}
    for line in history.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            acked[int(parts[0])] = int(parts[1])
    return acked


def _wait(what: str, ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_cut_host_is_replaced_healed_and_comes_back(tmp_path: Path) -> None:
    """Acceptance (issue 22): 5 bookies on 5 IPs; a client on a sixth host writes while one bookie's
    link is cut: its ledger moves on by an ensemble change, autorecovery heals the cut bookie's
    fragment after the delay, the restored link brings the bookie back, and every acked entry reads
    back identical."""
    with running_sandbox(tmp_path, "--hosts", "5", "--no-demo") as box:
        tag, count, network = (tmp_path / "sandbox" / "sandbox.netns").read_text().split()
        hosts = NetnsHosts(int(count), tag, network)  # the sandbox's hosts; the client's is ours
        client = hosts.add_host()
        history, stop = tmp_path / "history", tmp_path / "stop"
        command = [sys.executable, "-m", "tests.integration.cli.netns_client"]
        writer = subprocess.Popen(
            hosts.wrap(client, [*command, "write", box.url, str(history), str(stop)]),
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert writer.stdout is not None
            first = json.loads(writer.stdout.readline())
            ledger_id, victim = first["ledger"], first["ensemble"][0]
            victim_host = int(victim.removeprefix("bookie-"))
            _wait("300 acked appends", lambda: len(_acked(history)) >= 300, 60)
            hosts.link_down(victim_host)
            cut_at = len(_acked(history))
            _wait("300 appends acked after the cut", lambda: len(_acked(history)) >= cut_at + 300, 90)
            stop.touch()
            assert writer.wait(60) == 0
            last_entry = json.loads(writer.stdout.readline())["last_entry"]

            def healed() -> bool:
                shown = json.loads(bkaio(tmp_path, "ledger", "show", str(ledger_id), "--json").stdout)
                return all(victim not in e["bookies"] for e in shown["ensembles"])

            _wait("autorecovery to replace the cut bookie", healed, 180)
            hosts.link_up(victim_host)

            def all_writable() -> bool:
                listed = json.loads(bkaio(tmp_path, "bookies", "--json").stdout)
                return sum(1 for b in listed if b["state"] == "writable") == 5

            _wait("the cut bookie to register again", all_writable, 90)
            read = subprocess.run(
                hosts.wrap(client, [*command, "read", box.url, str(ledger_id)]),
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            payloads = json.loads(read.stdout)
            acked = _acked(history)
            assert len(payloads) == last_entry + 1
            for n, entry_id in acked.items():
                assert payloads[entry_id] == f"value-{n}", (n, entry_id)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
            if writer.stdout is not None:
                writer.stdout.close()
            hosts.close()  # the client's host; the sandbox removes its own
