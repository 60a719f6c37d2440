"""The autorecovery commands' bad input: a clear one-line error and exit 1, never a traceback.

Each runs ``bkaio`` in a process of its own: ``main()`` configures logging for its process, and a
configuration pointing at a test's captured (then closed) stream would break later tests' logging.
"""

from __future__ import annotations

import subprocess
import sys


def _bkaio(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bookkeeper_aio.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_list_with_a_bad_limit() -> None:
    result = _bkaio("autorecovery", "list-underreplicated", "--limit", "0", "--metadata", "memory://")
    assert result.returncode == 1
    assert "--limit must be >= 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_root_without_a_cluster() -> None:
    result = _bkaio("autorecovery", "status", "--metadata", "memory:///bookkeeper/nothing-here")
    assert result.returncode == 1
    assert "bkaio cluster init" in result.stderr


def test_bad_durations_name_the_option() -> None:
    result = _bkaio("recover", "b1", "--open-ledger-grace", "-5", "--metadata", "memory://")
    assert result.returncode == 1
    assert "open_ledger_grace_s" in result.stderr


def test_bad_metadata_url() -> None:
    result = _bkaio("autorecovery", "enable", "--metadata", "http://nope")
    assert result.returncode == 1
    assert "etcd://" in result.stderr
    assert "Traceback" not in result.stderr
