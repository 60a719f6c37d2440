"""The front door: `bkaio sandbox` as a newcomer runs it, and every shell command against it.

One sandbox subprocess (etcd + 3 bookies) serves the module; each shell command runs as a real
`bkaio` subprocess with --json and its output is checked. The module ends by stopping the sandbox
with SIGTERM and checking that no child process survived (by PID).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bookkeeper_aio.cli.demo import DEMO_PASSWORD
from bookkeeper_aio.cli.passwords import PASSWORDS_ENV
from bookkeeper_aio.cli.sandbox import AUTORECOVERY_PASSWORDS_FILE, CHILDREN_FILE
from tests.harness.sandbox import (
    BKAIO,
    RunningSandbox,
    alive,
    bkaio,
    child_pids,
    running_sandbox,
    sandbox_env,
)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSandbox]:
    with running_sandbox(tmp_path_factory.mktemp("bkaio-home"), "--bookies", "3", "--no-demo") as box:
        yield box


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
    result = json.loads(bkaio(sandbox.home, "simpletest", "--entries", "200", "--json").stdout)
    assert result["ok"] is True
    assert result["entries"] == 200


def test_bookies_lists_three_writable_with_disk_usage(sandbox: RunningSandbox) -> None:
    rows = json.loads(bkaio(sandbox.home, "bookies", "--json").stdout)
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
    listing = json.loads(bkaio(sandbox.home, "ledgers", "--json", "-l").stdout)
    assert int(ledger_id) in [row["ledger_id"] for row in listing["ledgers"]]
    shown = json.loads(bkaio(sandbox.home, "ledger", "show", ledger_id, "--json").stdout)
    assert (shown["state"], shown["last_entry_id"], shown["ensemble_size"]) == ("CLOSED", 4, 3)
    read = json.loads(bkaio(sandbox.home, "ledger", "read", ledger_id, "--password", "pw", "--json").stdout)
    assert [row["payload"] for row in read] == [f"entry-{i}" for i in range(5)]
    wrong = bkaio(sandbox.home, "ledger", "read", ledger_id, "--password", "nope", check=False)
    assert wrong.returncode == 1
    assert "Unauthorized" in wrong.stderr
    # The same password from a file (0600) and from the environment: nothing in the process table.
    password_file = sandbox.home / "ledger.password"
    password_file.write_text("pw\n")
    password_file.chmod(0o600)
    read = json.loads(
        bkaio(
            sandbox.home, "ledger", "read", ledger_id, "--password-file", str(password_file), "--json"
        ).stdout
    )
    assert len(read) == 5
    password_file.chmod(0o644)
    shared = bkaio(
        sandbox.home, "ledger", "read", ledger_id, "--password-file", str(password_file), check=False
    )
    assert shared.returncode == 1
    assert f"chmod 600 {password_file}" in shared.stderr
    from_env = subprocess.run(
        [*BKAIO, "ledger", "read", ledger_id, "--json"],
        capture_output=True,
        text=True,
        env={**sandbox_env(sandbox.home), PASSWORDS_ENV: "pw\n"},
        timeout=120,
        check=True,
    )
    assert len(json.loads(from_env.stdout)) == 5
    bkaio(sandbox.home, "ledger", "delete", ledger_id, "--password", "pw", "--json")
    missing = bkaio(sandbox.home, "ledger", "show", ledger_id, check=False)
    assert missing.returncode == 1
    assert "NoSuchLedger" in missing.stderr


def test_a_tls_client_against_plaintext_bookies_is_told_so(sandbox: RunningSandbox, tmp_path: Path) -> None:
    config = tmp_path / "tls.toml"
    config.write_text("tls_enabled = true\nconnect_timeout_s = 2.0\nadd_timeout_s = 2.0\n")
    result = bkaio(sandbox.home, "--client-config", str(config), "simpletest", "--entries", "3", check=False)
    assert result.returncode == 1
    assert "bkaio simpletest: Unauthorized: bookie-" in result.stderr, result.stderr
    assert "TLS handshake failed" in result.stderr
    assert "NotEnoughBookies" not in result.stderr


def test_the_autorecovery_daemon_reads_its_passwords_from_a_private_file(sandbox: RunningSandbox) -> None:
    """Not from its command line: any local user reads a process's argv (`ps`) for its whole life."""
    data_dir = sandbox.home / "sandbox"
    children = dict(line.split() for line in (data_dir / CHILDREN_FILE).read_text().splitlines())
    argv = Path(f"/proc/{children['autorecovery']}/cmdline").read_bytes().split(b"\0")
    assert b"--password" not in argv
    assert DEMO_PASSWORD not in argv
    assert b"--password-file" in argv
    password_file = data_dir / AUTORECOVERY_PASSWORDS_FILE
    assert argv[argv.index(b"--password-file") + 1] == str(password_file).encode()
    assert password_file.stat().st_mode & 0o777 == 0o600
    assert password_file.read_bytes() == b"\n" + DEMO_PASSWORD + b"\n"  # the empty one, and the demo's


def test_cluster_init_is_idempotent(sandbox: RunningSandbox) -> None:
    first = json.loads(bkaio(sandbox.home, "cluster", "init", "--json").stdout)
    again = json.loads(bkaio(sandbox.home, "cluster", "init", "--json").stdout)
    assert first["instance_id"] == again["instance_id"]


def test_bookie_format_refuses_an_unknown_id_and_a_running_bookie(sandbox: RunningSandbox) -> None:
    unknown = bkaio(sandbox.home, "bookie", "format", "127.0.0.1:1", "--json", check=False)
    assert unknown.returncode == 1
    assert "no bookie '127.0.0.1:1' in this cluster" in unknown.stderr
    running = bkaio(sandbox.home, "bookie", "format", "bookie-0", "--json", check=False)
    assert running.returncode == 1
    assert "bookie-0 is in use: it is registered" in running.stderr


def test_no_cluster_configured_says_what_to_do(tmp_path: Path) -> None:
    result = bkaio(tmp_path, "ledgers", check=False)
    assert result.returncode == 1
    assert "make run" in result.stderr


def test_zz_sigterm_stops_every_child(sandbox: RunningSandbox) -> None:
    sandbox.proc.send_signal(signal.SIGTERM)
    assert sandbox.proc.wait(60) == 0
    for pid in sandbox.child_pids:
        assert not alive(pid), f"child {pid} outlived the sandbox"
    assert not (sandbox.home / "sandbox.json").exists()


def test_make_run_path_demo_completes_and_cleans_up(tmp_path: Path) -> None:
    """What `make run` does, shortened: sandbox + demo, then (--no-serve) a clean stop."""
    result = bkaio(tmp_path, "sandbox", "--no-serve", "--demo-entries", "2000", check=False, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cluster ready: etcd://" in result.stdout
    assert "tailing reader saw 2200 entries, in order and byte-identical" in result.stdout
    pids = child_pids(result.stdout.splitlines())
    assert len(pids) == 4
    assert not any(alive(pid) for pid in pids)
    # a second run reuses the data directory cleanly
    again = bkaio(tmp_path, "sandbox", "--no-serve", "--no-demo", check=False, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr


def test_sigint_stops_a_sandbox_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A background job of a non-interactive shell starts with SIGINT ignored; kill -INT must work."""

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with running_sandbox(tmp_path, "--bookies", "1", "--no-demo", preexec_fn=ignore_sigint) as box:
        assert len(box.child_pids) == 2
        box.proc.send_signal(signal.SIGINT)
        assert box.proc.wait(60) == 130  # Ctrl-C: interrupted (SIGTERM, the service's stop, is 0)
        assert not any(alive(pid) for pid in box.child_pids)


def test_closed_stdout_still_stops_every_child(tmp_path: Path) -> None:
    """`bkaio sandbox | head -3`: writes to the closed pipe fail, the children must still stop."""
    proc = subprocess.Popen(
        [*BKAIO, "sandbox", "--bookies", "1", "--no-serve", "--demo-entries", "500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=sandbox_env(tmp_path),
    )
    assert proc.stdout is not None
    head = [proc.stdout.readline() for _ in range(5)]  # up to the process table
    pids = child_pids(head)
    assert len(pids) == 2, head
    proc.stdout.close()  # like `head` exiting
    proc.wait(120)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)


async def _ledger_on_every_bookie(url: str) -> None:
    from bookkeeper_aio.client.bookkeeper import BookKeeper

    async with BookKeeper.connect(url) as bk:
        lh = await bk.create_ledger(3, 3, 2)
        for _ in range(5):
            await lh.append(b"x" * 100)
        await lh.close()


def test_a_bookie_refusing_to_start_fails_the_sandbox_with_its_reason(tmp_path: Path) -> None:
    """A bookie whose cookie was deleted (``format --force``) while its data dir holds data refuses
    to start on the next run: the sandbox says so, with the bookie's reason, instead of listing it
    with a pid (a stale registration counted as its) and failing later."""
    import asyncio

    home = tmp_path / "home"
    with running_sandbox(home, "--bookies", "3", "--no-demo") as box:
        asyncio.run(_ledger_on_every_bookie(box.url))
        bkaio(home, "bookie", "format", "bookie-0", "--force")
    again = subprocess.run(
        [*BKAIO, "sandbox", "--bookies", "3", "--no-demo", "--no-serve"],
        capture_output=True,
        text=True,
        env=sandbox_env(home),
        timeout=180,
        check=False,
    )
    assert again.returncode == 1, again.stdout
    assert "bkaio sandbox: bookie-0 exited with" in again.stderr, again.stderr
    assert "refusing to start" in again.stderr
    assert "has no cookie for bookie 'bookie-0'" in again.stderr
    assert "PROCESS" not in again.stdout  # no process table listing a bookie that is gone


@pytest.mark.slow  # ~20 s: a sandbox start and a stop that waits out its bookies' grace period
def test_a_child_dying_while_serving_names_its_log(tmp_path: Path) -> None:
    with running_sandbox(tmp_path, "--bookies", "1", "--no-demo") as box:
        etcd_pid = box.child_pids[0]
        subprocess.run(["kill", "-KILL", str(etcd_pid)], check=True)
        assert box.proc.wait(90) == 1
        assert box.proc.stdout is not None
        rest = box.proc.stdout.read()
    assert "stopping: etcd exited with -9" in rest, rest
    assert str(tmp_path / "sandbox" / "logs" / "etcd.log") in rest
    assert not any(alive(pid) for pid in box.child_pids)
