"""One sandbox per ``$BKAIO_HOME``: a second one would overwrite the home's state file (where every
``bkaio`` command finds the sandbox) and remove it when it stops, leaving the first one unreachable
by name and its admin token unfound. It is refused, with what to do instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bookkeeper_aio.cli import sandbox
from bookkeeper_aio.cli.procs import ChildFailed


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("BKAIO_HOME", str(tmp_path))
    return tmp_path


def test_a_second_sandbox_for_the_same_home_is_refused_while_the_first_holds_it(home: Path) -> None:
    with sandbox._home_lock():
        assert (home / sandbox.HOME_LOCK_FILE).read_text() == str(os.getpid())
        with pytest.raises(ChildFailed) as refused, sandbox._home_lock():
            pass
    message = str(refused.value)
    assert "is already running for this $BKAIO_HOME" in message
    assert "still starting" in message  # no state file yet: the first is between lock and start
    assert "`BKAIO_HOME=DIR bkaio sandbox`" in message
    assert "--data-dir" not in message  # the advice that led into the clash
    with sandbox._home_lock():  # released when the first one ends
        pass


def test_a_live_sandbox_named_by_the_state_file_is_respected_without_the_lock(home: Path) -> None:
    """A sandbox started before the lock existed names itself only in the state file."""
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "sandbox"]) as other:
        try:
            # Until the child has exec'd, its cmdline is this process's (no "sandbox" in it): under
            # load that took long enough for the check to find no sandbox.
            cmdline = Path(f"/proc/{other.pid}/cmdline")
            for _ in range(1000):
                if b"sandbox" in cmdline.read_bytes():
                    break
                time.sleep(0.01)
            (home / "sandbox.json").write_text(
                json.dumps({"pid": other.pid, "data_dir": "/elsewhere", "metadata_url": "etcd://h:1/r"})
            )
            with pytest.raises(ChildFailed) as refused, sandbox._home_lock():
                pass
        finally:
            other.kill()
    message = str(refused.value)
    assert f"a sandbox (pid {other.pid}, data dir /elsewhere, cluster etcd://h:1/r)" in message
    assert f"kill -INT {other.pid}" in message
    # a state file left by a dead sandbox does not hold the home
    with sandbox._home_lock():
        pass
