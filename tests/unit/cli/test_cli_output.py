"""What ``bkaio`` prints, without a cluster: progress lines, JSON payloads, ledger views, errors."""

from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bookkeeper_aio.cli import main, output, shell, state


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_without_a_tty_prints_the_final_line_once() -> None:
    out = io.StringIO()
    progress = output.Progress("write", 10, out=out)
    for done in range(1, 11):
        progress.update(done)
    progress.update(10)
    progress.finish()
    finals = [line for line in out.getvalue().splitlines() if " 10/10 " in line]
    assert len(finals) == 1, out.getvalue()


def test_progress_without_a_tty_prints_a_final_line_that_adds_something() -> None:
    out = io.StringIO()
    progress = output.Progress("write", 10, out=out)
    progress.update(10)
    progress.finish("done")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[-1].endswith("done")


def test_progress_on_a_tty_redraws_one_line_and_ends_it() -> None:
    out = _Tty()
    progress = output.Progress("write", 10, out=out, every_s=0)
    for done in range(1, 11):
        progress.update(done)
    progress.finish()
    assert out.getvalue().count("\n") == 1
    assert " 10/10 " in out.getvalue().rsplit("\r", 1)[-1]


def test_json_payload_is_whole_utf8_or_base64() -> None:
    text = ("é" * 100).encode()
    assert shell._whole(text) == {"payload": "é" * 100, "encoding": "utf-8"}
    binary = b"\xff\x00" * 100
    row = shell._whole(binary)
    assert row["encoding"] == "base64"
    assert base64.b64decode(row["payload"]) == binary
    json.dumps(row)


def test_ledger_view_is_readable_text() -> None:
    view = {
        "ledger_id": 7,
        "state": "CLOSED",
        "ensembles": [
            {"first_entry_id": 0, "bookies": ["bookie-0", "bookie-1"]},
            {"first_entry_id": 42, "bookies": ["bookie-2", "bookie-1"]},
        ],
        "custom_metadata": {"app": b"sandbox-demo".hex(), "blob": b"\x00\xff".hex()},
    }
    lines = shell._ledger_lines(view)
    assert "  0: [bookie-0, bookie-1]" in lines
    assert "  42: [bookie-2, bookie-1]" in lines
    assert "  app: sandbox-demo" in lines
    assert "  blob: 0x00ff" in lines
    assert not any("{" in line for line in lines)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_state_file_says_the_sandbox_is_not_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BKAIO_HOME", str(tmp_path))
    monkeypatch.delenv(state.METADATA_ENV, raising=False)
    pid = _dead_pid()
    state.write_state({"metadata_url": "etcd://127.0.0.1:1/bookkeeper/sandbox", "pid": pid})
    with pytest.raises(state.NoClusterConfigured, match=rf"not running \(stale state from pid {pid} "):
        state.resolve_metadata_url(None)
    assert state.resolve_metadata_url("etcd://h:1/r") == "etcd://h:1/r"  # an explicit URL still wins


def test_state_of_another_process_with_the_recorded_pid_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pid of a killed sandbox reused by something else (here: this test) is not a sandbox."""
    monkeypatch.setenv("BKAIO_HOME", str(tmp_path))
    monkeypatch.delenv(state.METADATA_ENV, raising=False)
    state.write_state({"metadata_url": "etcd://127.0.0.1:1/bookkeeper/sandbox", "pid": 1})
    if not Path("/proc/1/cmdline").exists():
        pytest.skip("needs /proc")
    with pytest.raises(state.NoClusterConfigured, match="not running"):
        state.resolve_metadata_url(None)


def test_os_error_names_the_configured_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BKAIO_HOME", str(tmp_path))
    args = argparse.Namespace(command="sandbox", data_dir=tmp_path / "data")
    error = PermissionError(13, "Permission denied", str(tmp_path / "data" / "logs"))
    message = main._os_error(error, args)
    assert message.startswith(f"{tmp_path}/data/logs (in {tmp_path}/data, given with --data-dir)")
    assert "Permission denied" in message
    home_error = PermissionError(13, "Permission denied", str(tmp_path / "sandbox.tmp"))
    assert "from $BKAIO_HOME" in main._os_error(home_error, args)


def test_the_log_demo_line_says_what_each_ledger_holds() -> None:
    from bookkeeper_aio.cli.demo import log_demo_line
    from bookkeeper_aio.log import LogPosition

    positions: list[LogPosition | None] = [LogPosition(7, i) for i in range(260)] + [
        LogPosition(9, i) for i in range(240)
    ]
    line = log_demo_line(500, positions, 2)
    assert "500 JSON orders in 2 ledgers (260/240 records: rolled after about every 125)" in line
