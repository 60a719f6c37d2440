"""The front door: `bkaio sandbox` as a newcomer runs it, and every shell command against it.

One sandbox subprocess (etcd + 3 bookies) serves the module; each shell command runs as a real
`bkaio` subprocess with --json and its output is checked. The module ends by stopping the sandbox
with SIGTERM and checking that no child process survived (by PID).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BKAIO = [sys.executable, "-m", "bookkeeper_aio.cli.main"]
READY_TIMEOUT_S = 90.0


@dataclass
class RunningSandbox:
    proc: subprocess.Popen[str]
    url: str
    child_pids: list[int]
    home: Path
    lines: list[str]


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["BKAIO_HOME"] = str(home)
    env.pop("BKAIO_METADATA", None)
    return env


def _read_until_ready(proc: subprocess.Popen[str], deadline: float) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("serving;"):
            return lines
    raise AssertionError("sandbox did not become ready:\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSandbox]:
    home = tmp_path_factory.mktemp("bkaio-home")
    proc = subprocess.Popen(
        [*BKAIO, "sandbox", "--bookies", "3", "--no-demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(home),
    )
    try:
        lines = _read_until_ready(proc, time.monotonic() + READY_TIMEOUT_S)
        url = next(line.split(": ", 1)[1] for line in lines if line.startswith("cluster ready: "))
        pids = [int(m.group(1)) for line in lines if (m := re.match(r"^(?:etcd|bookie-\d+)\s+(\d+)\s", line))]
        yield RunningSandbox(proc, url, pids, home, lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def bkaio(box: RunningSandbox, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*BKAIO, *args], capture_output=True, text=True, env=_env(box.home), timeout=120, check=False
    )
    if check:
        assert result.returncode == 0, f"bkaio {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_sandbox_prints_connection_and_process_table(sandbox: RunningSandbox) -> None:
    assert sandbox.url.startswith("etcd://127.0.0.1:")
    assert len(sandbox.child_pids) == 4, sandbox.lines  # etcd + 3 bookies
    state = json.loads((sandbox.home / "sandbox.json").read_text())
    assert state["metadata_url"] == sandbox.url


def test_bookie_metrics_endpoints_are_listed_and_serve(sandbox: RunningSandbox) -> None:
    urls = [m.group(0) for line in sandbox.lines if (m := re.search(r"http://[\d.]+:\d+/metrics", line))]
    assert len(urls) == 3, sandbox.lines
    with urllib.request.urlopen(urls[0], timeout=10) as response:
        body = response.read().decode()
    assert "bookie_journal_fsync_seconds" in body


def test_simpletest_uses_the_sandbox_by_default(sandbox: RunningSandbox) -> None:
    result = json.loads(bkaio(sandbox, "simpletest", "--entries", "200", "--json").stdout)
    assert result["ok"] is True
    assert result["entries"] == 200


def test_bookies_lists_three_writable_with_disk_usage(sandbox: RunningSandbox) -> None:
    rows = json.loads(bkaio(sandbox, "bookies", "--json").stdout)
    assert [row["state"] for row in rows] == ["writable"] * 3
    assert all(row["error"] == "" and row["free_disk"] != "?" for row in rows), rows


def test_ledger_commands_show_read_list_delete(sandbox: RunningSandbox) -> None:
    script = (
        "import asyncio, sys\n"
        "from bookkeeper_aio import BookKeeper\n"
        "async def main():\n"
        "    async with BookKeeper.connect(sys.argv[1]) as bk:\n"
        "        lh = await bk.create_ledger(3, 2, 2, password=b'pw')\n"
        "        for i in range(5):\n"
        "            await lh.append(b'entry-%d' % i)\n"
        "        await lh.close()\n"
        "        print(lh.id)\n"
        "asyncio.run(main())\n"
    )
    made = subprocess.run(
        [sys.executable, "-c", script, sandbox.url], capture_output=True, text=True, check=True
    )
    ledger_id = made.stdout.strip()
    listing = json.loads(bkaio(sandbox, "ledgers", "--json", "-l").stdout)
    assert int(ledger_id) in [row["ledger_id"] for row in listing["ledgers"]]
    shown = json.loads(bkaio(sandbox, "ledger", "show", ledger_id, "--json").stdout)
    assert (shown["state"], shown["last_entry_id"], shown["ensemble_size"]) == ("CLOSED", 4, 3)
    read = json.loads(bkaio(sandbox, "ledger", "read", ledger_id, "--password", "pw", "--json").stdout)
    assert [row["payload"] for row in read] == [f"entry-{i}" for i in range(5)]
    wrong = bkaio(sandbox, "ledger", "read", ledger_id, "--password", "nope", check=False)
    assert wrong.returncode == 1
    assert "Unauthorized" in wrong.stderr
    bkaio(sandbox, "ledger", "delete", ledger_id, "--json")
    missing = bkaio(sandbox, "ledger", "show", ledger_id, check=False)
    assert missing.returncode == 1
    assert "NoSuchLedger" in missing.stderr


def test_cluster_init_is_idempotent(sandbox: RunningSandbox) -> None:
    first = json.loads(bkaio(sandbox, "cluster", "init", "--json").stdout)
    again = json.loads(bkaio(sandbox, "cluster", "init", "--json").stdout)
    assert first["instance_id"] == again["instance_id"]


def test_bookie_format_forgets_an_unknown_cookie(sandbox: RunningSandbox) -> None:
    result = json.loads(bkaio(sandbox, "bookie", "format", "127.0.0.1:1", "--json").stdout)
    assert result["metadata_cookie_deleted"] is False


def test_no_cluster_configured_says_what_to_do(tmp_path: Path) -> None:
    env = _env(tmp_path)
    result = subprocess.run([*BKAIO, "ledgers"], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 1
    assert "make run" in result.stderr


def test_zz_sigterm_stops_every_child(sandbox: RunningSandbox) -> None:
    sandbox.proc.send_signal(signal.SIGTERM)
    assert sandbox.proc.wait(60) == 0
    for pid in sandbox.child_pids:
        assert not _alive(pid), f"child {pid} outlived the sandbox"
    assert not (sandbox.home / "sandbox.json").exists()


def _alive(pid: int) -> bool:
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


def test_make_run_path_demo_completes_and_cleans_up(tmp_path: Path) -> None:
    """What `make run` does, shortened: sandbox + demo, then (--no-serve) a clean stop."""
    result = subprocess.run(
        [*BKAIO, "sandbox", "--no-serve", "--demo-entries", "2000"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cluster ready: etcd://" in result.stdout
    assert "tailing reader saw 2200 entries, in order and byte-identical" in result.stdout
    pids = [int(m.group(1)) for m in re.finditer(r"^(?:etcd|bookie-\d+)\s+(\d+)\s", result.stdout, re.M)]
    assert len(pids) == 4
    assert not any(_alive(pid) for pid in pids)
    # a second run reuses the data directory cleanly
    again = subprocess.run(
        [*BKAIO, "sandbox", "--no-serve", "--no-demo"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=180,
    )
    assert again.returncode == 0, again.stdout + again.stderr


def test_sigint_stops_a_sandbox_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A background job of a non-interactive shell starts with SIGINT ignored; kill -INT must work."""
    proc = subprocess.Popen(
        [*BKAIO, "sandbox", "--bookies", "1", "--no-demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(tmp_path),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        lines = _read_until_ready(proc, time.monotonic() + READY_TIMEOUT_S)
        pids = [int(m.group(1)) for line in lines if (m := re.match(r"^(?:etcd|bookie-\d+)\s+(\d+)\s", line))]
        assert len(pids) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert not any(_alive(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_closed_stdout_still_stops_every_child(tmp_path: Path) -> None:
    """`bkaio sandbox | head -3`: writes to the closed pipe fail, the children must still stop."""
    proc = subprocess.Popen(
        [*BKAIO, "sandbox", "--bookies", "1", "--no-serve", "--demo-entries", "500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(tmp_path),
    )
    assert proc.stdout is not None
    head = [proc.stdout.readline() for _ in range(5)]  # up to the process table
    pids = [int(m.group(1)) for line in head if (m := re.match(r"^(?:etcd|bookie-\d+)\s+(\d+)\s", line))]
    assert len(pids) == 2, head
    proc.stdout.close()  # like `head` exiting
    proc.wait(120)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
